"""An in-memory ControlPlane for transport tests: versions in a dict, an announce "swaps"
every engine at once and emits the events the real one emits."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from rollout_gateway.core.swap_mode import SwapMode
from rollout_gateway.errors import FailedPrecondition
from rollout_gateway.transport.control_plane import (
    AnnounceResult,
    ControlStatus,
    EngineVersion,
    VersionEvent,
    WeightSource,
    validate_announce,
)


class InProcessControlPlane:
    """Versions in memory; an announce 'swaps' every engine at once and emits events."""

    def __init__(self, engine_ids: list[str] | None = None, version: int = 0):
        self.learner_version = version
        self.engines = {e: version for e in (engine_ids or ["engine-0"])}
        self._subscribers: set[asyncio.Queue[VersionEvent]] = set()

    @property
    def watchers(self) -> int:
        """Open ``watch`` streams (a test waits for its watcher before announcing)."""
        return len(self._subscribers)

    async def status(self) -> ControlStatus:
        return ControlStatus(self.learner_version,
                             [EngineVersion(e, v) for e, v in self.engines.items()])

    async def announce(self, version: int, source: WeightSource, mode: SwapMode,
                       rolling: bool = False) -> AnnounceResult:
        validate_announce(version, source)
        if version <= self.learner_version:
            raise FailedPrecondition(f"version {version} does not move forward from "
                                     f"{self.learner_version}")
        t0 = time.monotonic()
        self.learner_version = version
        self._emit(VersionEvent(version, "announced", message=f"{source.kind}:{source.uri}"))
        for e in self.engines:
            self.engines[e] = version
            self._emit(VersionEvent(version, "engine_updated", engine_id=e))
        self._emit(VersionEvent(version, "swap_done"))
        return AnnounceResult(True, version, f"{len(self.engines)} engine(s) at {version}",
                              pause_seconds=time.monotonic() - t0)

    def _emit(self, ev: VersionEvent) -> None:
        for q in self._subscribers:
            q.put_nowait(ev)

    async def watch(self) -> AsyncIterator[VersionEvent]:
        q: asyncio.Queue[VersionEvent] = asyncio.Queue()
        self._subscribers.add(q)
        try:
            while True:
                yield await q.get()
        finally:
            self._subscribers.discard(q)
