"""What the observers (``/metrics``, ``/v1/lag``, the dashboard's history) read of a running
gateway: each component's read-only face, typed by the few members they use. The
composition root (``rollout_gateway.gateway``) builds one :class:`GatewayView`; nothing in
observe/ sees the gateway itself or acts on a component."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from rollout_gateway.engines.pool import Engine
from rollout_gateway.observe.tracker import LagTracker
from rollout_gateway.registry.base import SwapRecord
from rollout_gateway.rollouts.sample import SampleState
from rollout_gateway.store.base import GroupStats, StoreStats, UnconsumedTokens


class Versions(Protocol):
    """The version registry's figures (shared across replicas)."""

    async def learner_version(self) -> int: ...
    async def swaps(self, limit: int = 20) -> list[SwapRecord]: ...


class StoreFigures(Protocol):
    """The trajectory store's figures (shared across replicas)."""

    async def stats(self) -> StoreStats: ...
    async def group_stats(self) -> list[GroupStats]: ...
    async def unconsumed_tokens(self, limit: int = 10_000) -> UnconsumedTokens: ...


class RolloutFigures(Protocol):
    counters: dict[str, int]  # rollouts, samples, tokens, published, failovers, ...

    @property
    def inflight_samples(self) -> int: ...


class AdmissionFigures(Protocol):
    replica_id: str
    lag_counts: dict[int, int]  # finished trajectories by max lag (8: 8 or more)

    def counters(self) -> dict[str, int]: ...


class SessionFigures(Protocol):
    counters: dict[str, int]
    sessions: dict[Any, Any]  # open sessions by (tenant, session id)
    open_by_tenant: dict[str, int]  # how many of them each tenant has


class RefitFigures(Protocol):
    """What the refits this replica led came to (``swap.orchestrator.RefitTally``)."""

    transactions: dict[tuple[str, str], int]  # (kind, status) -> refits
    engine_results: dict[tuple[str, str], int]  # (engine id, result) -> outcomes
    stale_dropped: int
    kv_refused: int


class OldLogitFigures(Protocol):
    mode: str

    def metrics(self) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class GatewayView:
    registry: Versions
    store: StoreFigures
    engines: Callable[[], list[Engine]]
    #: the samples generating now (their pieces and live stream counts: tokens in flight)
    running: Callable[[], Iterable[SampleState]]
    rollouts: RolloutFigures
    gatekeeper: AdmissionFigures
    sessions: SessionFigures
    old_logits: OldLogitFigures | None
    #: this replica's accumulators (delivered and finished tokens, the dashboard history)
    tracker: LagTracker
    #: the refit transactions this replica led
    refits: RefitFigures
