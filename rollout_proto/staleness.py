"""The staleness rule, one copy for both sides (the gateway's ``core/staleness.py`` and the
learner's ``learner_client/staleness.py`` re-export it; ``tests/unit/test_staleness_rules.py``
runs its cases through both names).

A token's lag is ``learner_version - policy_version``; it is stale when ``lag > max_lag``
(a lag of exactly ``max_lag`` is within the bound; no bound, None, is never stale). The
gateway flags a delivery ``masked`` when its oldest token is stale under the ``max_lag``
the learner pulled with; :func:`stale_mask` then names the tokens that get no loss.
"""

from __future__ import annotations

import numpy as np


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
