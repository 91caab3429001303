"""Staleness is derived, never stored: how far versions lag behind the learner.

The one rule, used wherever the gateway decides staleness (admission at finish, the
store's filter at delivery, an agent session's choice of engine) and mirrored for
learners in ``learner_client/staleness.py`` (``tests/unit/test_staleness_rules.py`` runs
the same cases against both):

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


class StalePolicy(StrEnum):
    """What happens to a trajectory whose lag exceeds the bound."""

    DROP = "drop"  # discard it (counted)
    MASK = "mask"  # deliver it with its stale tokens masked out of the loss
    RECYCLE = "recycle"  # discard the response, re-queue its prompt for fresh generation


def lag(learner_version: int, version: int | np.ndarray) -> int | np.ndarray:
    """``learner_version - version``: an int for one version, int64 per token for a column."""
    if isinstance(version, np.ndarray):
        return np.int64(learner_version) - version.astype(np.int64)
    return learner_version - version


def is_stale(lag: int | np.ndarray, max_lag: int | None) -> bool | np.ndarray:
    """``lag > max_lag`` (elementwise for a column); never stale without a bound."""
    if max_lag is None:
        return np.zeros(np.shape(lag), bool) if np.ndim(lag) else False
    return lag > max_lag


def stale_mask(learner_version: int, policy_version: np.ndarray, max_lag: int | None
               ) -> np.ndarray:
    """bool [T]: True on the tokens past the bound."""
    return is_stale(lag(learner_version, policy_version), max_lag)


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
