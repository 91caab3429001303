"""The dashboard's time series: one point every ``interval_s`` into ``tracker.history``."""

from __future__ import annotations

import logging
import time

from rollout_gateway.aio import Periodic
from rollout_gateway.errors import GatewayError
from rollout_gateway.observe.view import GatewayView

log = logging.getLogger(__name__)


class HistorySampler:
    """Every ``interval_s`` appends one point (learner version, engine versions and states,
    token and sample counters) to ``view.tracker.history`` for the dashboard's time series."""

    def __init__(self, view: GatewayView, interval_s: float) -> None:
        self.view = view
        self.interval_s = interval_s
        self._loop = Periodic(self.sample, interval_s, what="lag history sample", log=log,
                              now=True)

    def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    async def sample(self) -> None:
        v = self.view
        try:
            lv: int | None = await v.registry.learner_version()
        except GatewayError:
            lv = None
        c = v.rollouts.counters
        v.tracker.history.append({
            "t": time.time(), "learner_version": lv,
            "engines": {e.id: {"version": e.version, "state": e.state.value}
                        for e in v.engines()},
            "tokens": c["tokens"], "samples": c["samples"],
            "in_flight_samples": v.rollouts.inflight_samples,
        })
