"""Admission control and the staleness policy, wired to the store and the registry.

The rules are pure (:mod:`rollout_gateway.core.admission`); this adapter feeds them the
live numbers (store backlog, learner version) and applies verdicts to trajectories.
"""

from __future__ import annotations

import numpy as np

from rollout_gateway.core.admission import AdmissionConfig, AdmissionController, Judgement, Verdict
from rollout_gateway.core.trajectory import Trajectory
from rollout_gateway.registry.base import VersionRegistry
from rollout_gateway.store.base import TrajectoryStore


class Gatekeeper:
    """Every admitted sample is released exactly once: by :meth:`judge` or
    :meth:`release_failed`."""

    def __init__(self, config: AdmissionConfig, store: TrajectoryStore,
                 registry: VersionRegistry) -> None:
        self.ctl = AdmissionController(config)
        self.store = store
        self.registry = registry
        #: finished trajectories by max lag (learner version - oldest token version) at finish;
        #: lags above 8 are counted under 8
        self.lag_counts: dict[int, int] = {}

    @property
    def running(self) -> int:
        return self.ctl.running

    async def admit(self, n: int) -> None:
        """All n samples or ResourceExhausted (429)."""
        self.ctl.admit(n, learner_version=await self.registry.learner_version(),
                       backlog=await self.store.backlog())

    async def judge(self, traj: Trajectory, recycles: int) -> Judgement:
        """Release one finished sample; record the verdict on the trajectory's metadata."""
        j = self.ctl.judge(traj.tokens.policy_version,
                           learner_version=await self.registry.learner_version(),
                           recycles=recycles)
        lag = min(max(j.max_lag, 0), 8)
        self.lag_counts[lag] = self.lag_counts.get(lag, 0) + 1
        if j.verdict is not Verdict.ACCEPT:
            traj.metadata["stale_verdict"] = j.verdict.value
            traj.metadata["stale_max_lag"] = str(j.max_lag)
        if j.verdict is Verdict.MASK and j.mask is not None:
            # token indices to leave out of the loss, as ranges "a-b,c-d" (end exclusive)
            bad = np.flatnonzero(~j.mask)
            traj.metadata["stale_masked_tokens"] = _ranges(bad)
        return j

    def release_failed(self, n: int = 1) -> None:
        self.ctl.release_failed(n)

    def counters(self) -> dict[str, int]:
        return self.ctl.stats.to_dict()


def _ranges(idx: np.ndarray) -> str:
    if idx.size == 0:
        return ""
    breaks = np.flatnonzero(np.diff(idx) != 1)
    starts = np.concatenate([[idx[0]], idx[breaks + 1]])
    ends = np.concatenate([idx[breaks], [idx[-1]]]) + 1
    return ",".join(f"{a}-{b}" for a, b in zip(starts.tolist(), ends.tolist()))
