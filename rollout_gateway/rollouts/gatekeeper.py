"""Admission control and the staleness policy, wired to the store and the registry.

Pure rules live in :mod:`rollout_gateway.core.admission`; this adapter feeds them the
live numbers (store backlog, samples in flight, learner version) and counts outcomes.
"""

from __future__ import annotations

from typing import Any

from rollout_gateway.core.staleness import StalePolicy, within_bound
from rollout_gateway.core.trajectory import Trajectory
from rollout_gateway.errors import GatewayError, ResourceExhausted
from rollout_gateway.settings import GatewaySettings
from rollout_gateway.store.base import TrajectoryStore


class Gatekeeper:
    def __init__(self, settings: GatewaySettings, store: TrajectoryStore, registry: Any) -> None:
        self.settings = settings
        self.store = store
        self.registry = registry
        self.counters: dict[str, int] = {"dropped": 0, "masked": 0, "recycled": 0,
                                         "refused_admission": 0}

    async def _learner_version(self) -> int | None:
        try:
            return await self.registry.learner_version()
        except GatewayError:
            return None

    async def admit(self, n: int, inflight_samples: int) -> None:
        """Refuse new work when finished-but-unconsumed + in-flight work would exceed what
        the learner can consume within the staleness bound (AReaL-style)."""
        backlog = await self.store.backlog()
        cap = self.settings.max_inflight_samples * (self.settings.max_staleness + 1)
        if backlog + inflight_samples + n > cap:
            self.counters["refused_admission"] += 1
            raise ResourceExhausted(
                f"admission refused: {backlog} unconsumed + {inflight_samples} in flight + {n} "
                f"new samples exceed {cap} (max_inflight_samples x (max_staleness + 1))",
                details={"backlog": backlog, "inflight": inflight_samples})

    async def on_finished(self, traj: Trajectory) -> bool:
        """Apply the stale policy. True: publish (maybe masked). False: not published."""
        v = await self._learner_version()
        if v is None or traj.num_tokens == 0:
            return True
        if within_bound(v, traj.tokens.policy_version, self.settings.max_staleness):
            return True
        policy = self.settings.stale_policy
        if policy is StalePolicy.MASK:
            self.counters["masked"] += 1
            traj.metadata["stale_masked"] = "1"
            return True
        self.counters["dropped" if policy is StalePolicy.DROP else "recycled"] += 1
        return False
