"""Old-logit strategies: where pi_old comes from when the batch does not carry it.

* ``WeightSnapshotStore``: bounded LRU of CPU weight copies per live version; exact
  per-version recompute (``recompute``, ``functional_runner``).
* ``EwmaWeightTracker``: debiased EWMA proximal weights, beta = W_stale/(W_stale+2),
  auto-reset below 0.9 active-token fraction.
* ``fill_old_logprobs``: the hook for the trajectory's optional old_logprobs column
  (computed at interruption time), filling NaN positions with a strategy.
"""

from .ewma import EwmaWeightTracker, RevisedPPOEWMA, staleness_beta
from .fill import (STRATEGIES, FillContext, Strategy, ewma_strategy, fill_old_logprobs,
                   snapshot_strategy)
from .snapshots import (Runner, SnapshotMissing, WeightSnapshotStore, cpu_copy,
                        functional_runner, live_window)

__all__ = ["STRATEGIES", "EwmaWeightTracker", "FillContext", "RevisedPPOEWMA", "Runner",
           "SnapshotMissing",
           "Strategy", "WeightSnapshotStore", "cpu_copy", "ewma_strategy", "fill_old_logprobs",
           "functional_runner", "live_window", "snapshot_strategy", "staleness_beta"]
