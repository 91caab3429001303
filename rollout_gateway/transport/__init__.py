"""Trajectory transport: the learner-facing gRPC service and server (the codec is
``rollout_proto.codec``; the gateway's Trajectory mapping ``core.wire``)."""
