"""Trajectory transport: protobuf codec, the learner-facing gRPC service and server."""
