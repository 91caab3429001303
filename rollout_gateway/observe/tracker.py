"""In-process accumulators behind ``/v1/lag`` and ``/metrics``: lag of delivered tokens,
intra-trajectory staleness of finished samples, and a short history for the dashboard
(filled by :class:`rollout_gateway.observe.history.HistorySampler`).

Each replica keeps its own (it counts what it generated and delivered); figures that live
in the shared store/registry are read at request time instead.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rollout_gateway.core.staleness import lag

if TYPE_CHECKING:
    from rollout_gateway.core.trajectory import Trajectory
    from rollout_gateway.store.base import StoredEntry


@dataclass(slots=True)
class FinishedStats:
    """Finished samples of this replica (any verdict)."""

    trajectories: int = 0
    tokens: int = 0
    spanning_versions: int = 0  # trajectories whose tokens come from more than one version
    max_intra_lag: int = 0  # max over trajectories of max - min policy_version
    tokens_on_stale_kv: int = 0  # tokens whose kv_version < policy_version (in_place swaps)
    tokens_after_switch: int = 0  # tokens newer than their trajectory's first version


def add_counts(into: dict[int, int], keys: np.ndarray, counts: np.ndarray) -> None:
    for k, c in zip(keys.tolist(), counts.tolist()):
        if c:
            into[k] = into.get(k, 0) + c


class LagTracker:
    """Accumulators fed by hooks in the rollout service and the gRPC servicer."""

    def __init__(self, history_points: int = 900) -> None:
        self.delivered: dict[int, int] = {}  # lag at delivery -> tokens
        self.delivered_trajectories = 0
        self.finished = FinishedStats()
        self.history: deque[dict[str, Any]] = deque(maxlen=history_points)

    def on_delivered(self, entries: list[StoredEntry], learner_version: int) -> None:
        """Tokens of a batch sent to a learner that reported ``learner_version``."""
        for e in entries:
            for v, c in e.tokens_by_version().items():
                k = lag(learner_version, v)
                self.delivered[k] = self.delivered.get(k, 0) + c
        self.delivered_trajectories += len(entries)

    def on_finished(self, traj: Trajectory) -> None:
        f = self.finished
        pv, kv = traj.tokens.policy_version, traj.tokens.kv_version
        f.trajectories += 1
        f.tokens += len(pv)
        if len(pv):
            lo, hi = int(pv.min()), int(pv.max())
            if hi != lo:
                f.spanning_versions += 1
                f.max_intra_lag = max(f.max_intra_lag, hi - lo)
                f.tokens_after_switch += int(np.count_nonzero(pv != pv[0]))
            f.tokens_on_stale_kv += int(np.count_nonzero(kv < pv))


def in_flight_tokens(states) -> tuple[dict[int, int], int]:
    """Tokens generated so far by running samples, per policy version (finished engine
    requests exactly; the request in flight as its incremental stream arrives, at the
    version the engine reported with each chunk); and the count of samples."""
    cols = [p.cols.policy_version for s in states for p in s.pieces]
    out: dict[int, int] = {}
    if cols:
        pv = np.concatenate(cols)
        if len(pv):
            keys, counts = np.unique(pv, return_counts=True)
            add_counts(out, keys, counts)
    for s in states:
        for v, c in list(s.live.items()):
            out[v] = out.get(v, 0) + c
    return out, len(states)
