"""Staleness is derived, never stored: lags relative to a learner version."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np


class StalePolicy(StrEnum):
    """What happens to a trajectory whose lag exceeds the bound."""

    DROP = "drop"  # discard it (counted)
    MASK = "mask"  # deliver it with its stale tokens masked out of the loss
    RECYCLE = "recycle"  # discard the response, re-queue its prompt for fresh generation


def token_lag(learner_version: int, policy_version: np.ndarray) -> np.ndarray:
    """Per-token lag = learner_version - policy_version (int32)."""
    return (np.int32(learner_version) - policy_version).astype(np.int32, copy=False)


@dataclass(frozen=True, slots=True)
class TrajectoryStaleness:
    intra: int  # max - min policy_version within the trajectory
    inter: int  # learner_version - max policy_version
    max_lag: int  # learner_version - min policy_version


def trajectory_staleness(learner_version: int, policy_version: np.ndarray) -> TrajectoryStaleness:
    if policy_version.size == 0:
        return TrajectoryStaleness(0, 0, 0)
    lo = int(policy_version.min())
    hi = int(policy_version.max())
    return TrajectoryStaleness(intra=hi - lo, inter=learner_version - hi,
                               max_lag=learner_version - lo)


def within_bound(learner_version: int, policy_version: np.ndarray, max_lag: int) -> bool:
    """True when every token's lag is <= max_lag."""
    return trajectory_staleness(learner_version, policy_version).max_lag <= max_lag
