"""rollout-gateway: per-token provenance for asynchronous RL rollouts."""

__version__ = "0.1.0"
