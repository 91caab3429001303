"""Staleness is derived, never stored: how far versions lag behind the learner.

The one rule, used wherever the gateway decides staleness (admission at finish, the
store's filter at delivery, an agent session's choice of engine); ``lag``, ``is_stale``
and ``stale_mask`` are ``rollout_proto.staleness``'s, the one copy the learner uses too
(``tests/unit/test_staleness_rules.py`` runs the same cases through both sides' names):

* ``lag = learner_version - version``: how many versions the learner moved past the
  version a token was sampled with (its policy version) or an engine runs (the lag its
  next tokens get). Negative: ahead of the learner.
* stale when ``lag > max_lag``: the bound is inclusive (a lag of exactly ``max_lag`` is
  within it); no bound (None) is never stale. The bound is ``admission.max_staleness`` in
  the gateway's settings and ``max_lag`` on a learner's Pull.
* a trajectory is as stale as its oldest token: its lag is that of its minimum policy
  version (one stale token makes it stale); an empty one has lag 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from rollout_proto.staleness import is_stale, lag, stale_mask

__all__ = ["StalePolicy", "TrajectoryStaleness", "is_stale", "lag", "stale_mask",
           "trajectory_staleness"]


class StalePolicy(StrEnum):
    """What happens to a trajectory whose lag exceeds the bound."""

    DROP = "drop"  # discard it (counted)
    MASK = "mask"  # deliver it with its stale tokens masked out of the loss
    RECYCLE = "recycle"  # discard the response, re-queue its prompt for fresh generation


@dataclass(frozen=True, slots=True)
class TrajectoryStaleness:
    intra: int  # max - min policy_version within the trajectory
    inter: int  # lag of its newest token: learner_version - max policy_version
    max_lag: int  # the trajectory's lag, its oldest token's: learner_version - min policy_version


def trajectory_staleness(learner_version: int, policy_version: np.ndarray) -> TrajectoryStaleness:
    if policy_version.size == 0:
        return TrajectoryStaleness(0, 0, 0)
    lo = int(policy_version.min())
    hi = int(policy_version.max())
    return TrajectoryStaleness(intra=hi - lo, inter=lag(learner_version, hi),
                               max_lag=lag(learner_version, lo))
