"""Rollouts: n samples per prompt, each its own engine request, stamped and published."""
