"""Test doubles: synthetic trajectories, an in-memory control plane, the gRPC service alone."""
