"""The gateway's staleness rule on the learner's side: ``lag``, ``is_stale`` and
``stale_mask`` from ``rollout_proto.staleness``, the one copy both sides use
(``learner_client`` does not import ``rollout_gateway``). (``learner_client.staleness_monitor``
is another thing: what staleness costs a training step, and the learning rate that keeps
it stable.)"""

from rollout_proto.staleness import is_stale, lag, stale_mask

__all__ = ["is_stale", "lag", "stale_mask"]
