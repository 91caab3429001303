"""Exact old logits (pi_old) filled on the gateway side, strategies (2) and (3) of the
missing-old-logits paper (arXiv 2605.12070; strategy (1), weight snapshots, lives in
``learner_client.old_logits``).

* ``scorer.OldLogitScorer``: a dedicated scorer engine (reference engine or SGLang, outside
  the generation pool) that re-scores prompt + output with input logprobs under the weight
  version asked for, loading that version's checkpoint when it holds another one.
* ``service.OldLogitService``: the two strategies on top of it.
  - ``model``: every finished trajectory is scored before delivery, each token under its
    own ``policy_version``.
  - ``interruption``: at a swap, after the fence and before the new weights load, the
    partial rollouts the swap interrupted are scored under the outgoing version, then the
    scorer follows the swap; at finish only the tail (the current version) is scored.
  The values travel in the trajectory's ``old_logprobs`` column (wire field 9 of
  TokenColumns), so ``collate`` gives them to the losses with no learner change.
"""

from .scorer import OldLogitScorer, score_payload
from .strategies import OldLogitService

__all__ = ["OldLogitScorer", "OldLogitService", "score_payload"]
