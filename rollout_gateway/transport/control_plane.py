"""The control plane the gRPC service talks to for versions and hot-swaps.

The gateway provides the real implementation (version registry + hot-swap orchestrator);
:class:`InProcessControlPlane` is a simple, complete one for tests and standalone use.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from rollout_gateway.errors import FailedPrecondition, InvalidArgument

WEIGHT_SOURCE_KINDS = ("path", "tensor_bucket", "distributed")
SWAP_MODES = ("in_place", "retract", "abort_resume", "drain")


@dataclass(slots=True)
class WeightSource:
    kind: str  # path | tensor_bucket | distributed
    uri: str
    options: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class EngineVersion:
    engine_id: str
    version: int
    healthy: bool = True


@dataclass(slots=True)
class ControlStatus:
    learner_version: int
    engines: list[EngineVersion]
    swap_in_progress: bool = False

    @property
    def max_engine_lag(self) -> int:
        if not self.engines:
            return 0
        return self.learner_version - min(e.version for e in self.engines)


@dataclass(slots=True)
class AnnounceResult:
    accepted: bool
    version: int
    message: str = ""
    pause_seconds: float = 0.0


@dataclass(slots=True)
class VersionEvent:
    version: int
    kind: str  # announced | engine_updated | swap_done | swap_failed
    engine_id: str = ""
    at: float = field(default_factory=time.time)
    message: str = ""


@runtime_checkable
class ControlPlane(Protocol):
    async def status(self) -> ControlStatus:
        """Learner version, engine versions, whether a swap is running."""
        ...

    async def announce(self, version: int, source: WeightSource, mode: str,
                       rolling: bool = False) -> AnnounceResult:
        """The learner published weights ``version``; swap engines to it. Raises
        InvalidArgument for a bad source/mode, FailedPrecondition for a version that
        does not move forward or while another swap runs."""
        ...

    def watch(self) -> AsyncIterator[VersionEvent]:
        """Version changes from now on, until the caller stops iterating."""
        ...


def validate_announce(version: int, source: WeightSource, mode: str) -> None:
    if not 0 <= version <= 2**31 - 1:  # token stamps are int32
        raise InvalidArgument(f"version must be in [0, 2**31 - 1], got {version}")
    if source.kind not in WEIGHT_SOURCE_KINDS:
        raise InvalidArgument(f"weight source kind must be one of {WEIGHT_SOURCE_KINDS}, "
                              f"got {source.kind!r}")
    if not source.uri:
        raise InvalidArgument("weight source uri must be non-empty")
    if mode not in SWAP_MODES:
        raise InvalidArgument(f"mode must be one of {SWAP_MODES}, got {mode!r}")


class InProcessControlPlane:
    """Versions in memory; an announce 'swaps' every engine at once and emits events."""

    def __init__(self, engine_ids: list[str] | None = None, version: int = 0):
        self.learner_version = version
        self.engines = {e: version for e in (engine_ids or ["engine-0"])}
        self._subscribers: set[asyncio.Queue[VersionEvent]] = set()

    async def status(self) -> ControlStatus:
        return ControlStatus(self.learner_version,
                             [EngineVersion(e, v) for e, v in self.engines.items()])

    async def announce(self, version: int, source: WeightSource, mode: str,
                       rolling: bool = False) -> AnnounceResult:
        validate_announce(version, source, mode)
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
