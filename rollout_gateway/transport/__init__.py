"""Trajectory transport: the learner-facing gRPC service and server, and the control plane
behind it (``learner_control``: versions and hot-swaps through the swap orchestrator). The
codec is ``rollout_proto.codec``; the gateway's Trajectory mapping ``core.trajectory_codec``."""
