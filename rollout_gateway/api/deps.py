"""What the routes act on, as FastAPI dependencies: a route names the components it uses
(``pool: Pool``, ``rollouts: Rollouts``) and is given those, never the gateway.

:func:`rollout_gateway.api.app.create_app` keeps the :class:`Backend` it is given (the
:class:`rollout_gateway.gateway.Gateway` is one) on ``app.state.gateway``; only these
dependencies and the guards (``api.security``, ``api.errors``: ``auth`` and
``settings.retry_after_s``) read it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Protocol

from fastapi import Depends, Request

from rollout_gateway.auth import Authenticator
from rollout_gateway.engines.pool import Engine, EnginePool
from rollout_gateway.observe.metrics import GatewayMetrics
from rollout_gateway.observe.view import GatewayView
from rollout_gateway.registry.base import VersionRegistry
from rollout_gateway.rollouts.rollout import RolloutService
from rollout_gateway.sessions.manager import SessionManager
from rollout_gateway.settings import GatewaySettings
from rollout_gateway.swap.orchestrator import SwapOrchestrator


class Backend(Protocol):
    """What the HTTP app needs of the gateway behind it."""

    settings: GatewaySettings
    auth: Authenticator
    pool: EnginePool
    registry: VersionRegistry
    rollouts: RolloutService
    swaps: SwapOrchestrator
    sessions: SessionManager
    view: GatewayView  # what /metrics and /v1/lag read
    metrics: GatewayMetrics  # this replica's histograms (HTTP latency among them)
    serving: bool  # False while starting and draining: /health answers 503
    started_at: float

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def register_engine(self, engine_id: str, url: str,
                              api_key: str | None = None) -> Engine: ...


def _part(name: str) -> Any:
    """Depends on ``name`` of the app's backend, read per request (``serving`` changes)."""

    async def part(request: Request) -> Any:  # async: a plain def costs a thread-pool hop
        return getattr(request.app.state.gateway, name)

    part.__name__ = name
    return Depends(part)


Settings = Annotated[GatewaySettings, _part("settings")]
Pool = Annotated[EnginePool, _part("pool")]
Registry = Annotated[VersionRegistry, _part("registry")]
Rollouts = Annotated[RolloutService, _part("rollouts")]
Swaps = Annotated[SwapOrchestrator, _part("swaps")]
Sessions = Annotated[SessionManager, _part("sessions")]
View = Annotated[GatewayView, _part("view")]
Metrics = Annotated[GatewayMetrics, _part("metrics")]
Serving = Annotated[bool, _part("serving")]
StartedAt = Annotated[float, _part("started_at")]
#: register an engine and catch it up to the pool's weights before it serves
Register = Annotated[Callable[[str, str, str | None], Awaitable[Engine]],
                     _part("register_engine")]
