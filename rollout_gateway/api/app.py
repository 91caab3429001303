"""FastAPI app factory: the HTTP front door of one gateway. The lifespan starts and stops
it (unless the caller does); each route gets the components it uses (:mod:`api.deps`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI

from rollout_gateway import __version__
from rollout_gateway.api.deps import Backend
from rollout_gateway.api.errors import install_error_handlers
from rollout_gateway.observe.metrics import GatewayMetrics


def create_app(gateway: Backend, *, manage_gateway: bool = True) -> FastAPI:
    """The app in front of ``gateway``. With ``manage_gateway`` the app's lifespan starts
    and stops it; pass False when it is shared with the gRPC server (the caller runs it)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_gateway:
            await gateway.start()
        try:
            yield
        finally:
            if manage_gateway:
                await gateway.stop()

    app = FastAPI(title="rollout-gateway", version=__version__, lifespan=lifespan)
    app.state.gateway = gateway
    install_error_handlers(app)
    from rollout_gateway.api.security import RequestGuard

    s = gateway.settings
    app.add_middleware(RequestGuard, max_body_bytes=s.max_body_bytes,
                       max_pending=s.max_pending_requests, retry_after_s=s.retry_after_s)
    from rollout_gateway.api import ops, routes
    from rollout_gateway.api.generate import router as generate_router
    from rollout_gateway.api.openai import router as openai_router

    for r in (routes.rollouts, routes.weights, routes.engines, routes.ops, generate_router,
              ops.router, openai_router):
        app.include_router(r)
    from rollout_gateway.api.schemas import apply_limits

    make_schema = app.openapi
    app.openapi = lambda: apply_limits(make_schema(), s)  # the schema states the limits
    from rollout_gateway.api.version_policy import VersionPolicyHeader

    app.add_middleware(VersionPolicyHeader)  # x-version-policy, on every route
    app.add_middleware(HTTPMetricsMiddleware, metrics=gateway.metrics)
    return app


class HTTPMetricsMiddleware:
    """Pure ASGI: observes each HTTP request's latency until its last body byte, labelled by
    method, route template (``unmatched`` for 404s) and status."""

    def __init__(self, app, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = {"code": 500}

        async def wrapped(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                observe()

        done = {"v": False}

        def observe() -> None:
            if done["v"]:
                return
            done["v"] = True
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.http_latency.labels(scope["method"], path,
                                             str(status["code"])).observe(
                time.perf_counter() - t0)

        try:
            await self.app(scope, receive, wrapped)
        finally:
            observe()
