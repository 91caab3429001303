"""HTTP routes: rollouts, weights/versions, engines admin, health, metrics."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from rollout_gateway.api.deps import (
    Metrics,
    Pool,
    Register,
    Registry,
    Rollouts,
    Serving,
    Swaps,
    View,
)
from rollout_gateway.api.errors import ORJSONResponse
from rollout_gateway.api.security import (
    caller,
    is_admin,
    keep_pending,
    public_view,
    require_admin,
    require_client,
)
from rollout_gateway.api.serialize import dumps, trajectory_to_json
from rollout_gateway.api.version_policy import apply_body_policy, versions_header
from rollout_gateway.errors import (HTTP_STATUS, EngineError, ErrorCode, GatewayError,
                                     InvalidArgument)
from rollout_gateway.observe.metrics import CONTENT_TYPE, render
from rollout_gateway.redact import clean
from rollout_gateway.registry.base import SwapStatus
from rollout_gateway.rollouts.models import RolloutRequest
from rollout_gateway.settings import EngineSpec
from rollout_gateway.swap.models import SwapRequest


log = logging.getLogger(__name__)


def _client_status(err: Any) -> int | None:
    """The HTTP status of an error event's client error (4xx), else None."""
    try:
        status = HTTP_STATUS[ErrorCode(err.get("code"))] if isinstance(err, dict) else None
    except ValueError:
        return None
    return status if status is not None and 400 <= status < 500 else None


async def sse(events: AsyncIterator[dict[str, Any]]) -> Response:
    """An SSE answer of ``events`` then ``[DONE]``. The first event is awaited before the
    response starts: when it is a client error (a 4xx: the request is bad, e.g. a prompt
    the engine refuses, which SGLang reports inside its 200 stream) or the stream raises
    before it, the answer is that error with its HTTP status, as for a request that does
    not stream (nothing was sent yet). Errors after the first event are events."""
    it = aiter(events)
    try:
        first: dict[str, Any] | None = await anext(it)
    except StopAsyncIteration:
        first = None
    if first is not None and "error" in first:
        status = _client_status(first["error"])
        if status is not None:
            close = getattr(it, "aclose", None)
            if close is not None:
                await close()  # the other samples of the request stop
            return ORJSONResponse({"error": clean(first["error"])}, status_code=status)

    async def body() -> AsyncIterator[bytes]:
        try:
            ev = first
            while ev is not None:
                if "error" in ev:  # a failed sample: shown as a client may see it
                    ev = {**ev, "error": clean(ev["error"])}
                yield b"data: " + dumps(ev) + b"\n\n"
                ev = await anext(it, None)
        except GatewayError as exc:
            err = {"type": "error", "error": clean(exc.to_dict())}
            yield b"data: " + orjson.dumps(err) + b"\n\n"
        except Exception:  # noqa: BLE001 - headers are sent: end the stream with an error event
            log.exception("unexpected error in an event stream")
            yield b"data: " + orjson.dumps({"type": "error", "error": {
                "code": "INTERNAL", "message": "internal error"}}) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


rollouts = APIRouter(tags=["rollouts"], dependencies=[Depends(require_client)])


@rollouts.post("/v1/rollouts")
async def create_rollout(req: RolloutRequest, request: Request, rollouts: Rollouts,
                         registry: Registry) -> Response:
    """n samples of one prompt, stamped per token and published to the store."""
    apply_body_policy(req.version_policy)
    tenant = caller(request).owner
    if req.stream:
        # admission errors: plain 4xx; the samples count as pending until they end, even
        # when the client goes away first
        free = keep_pending(request)
        try:
            events = await rollouts.open_stream(req, tenant=tenant, on_done=free)
        except BaseException:
            free()
            raise

        async def rendered() -> AsyncIterator[dict[str, Any]]:
            async for ev in events:
                if ev["type"] == "trajectory":
                    ev = {"type": "trajectory", "sample_index": ev["sample_index"],
                          "trajectory": trajectory_to_json(ev["trajectory"])}
                yield ev
        return await sse(rendered())
    trajs = await rollouts.run(req, tenant)
    return ORJSONResponse({"trajectories": [trajectory_to_json(t) for t in trajs],
                           "learner_version": await registry.learner_version()},
                          headers=versions_header(trajs))


weights = APIRouter(tags=["weights"])


@weights.post("/v1/weights", dependencies=[Depends(require_admin)])
async def swap_weights(req: SwapRequest, swaps: Swaps) -> Response:
    """Announce a new version; with a source, hot-swap the engines to it."""
    rec = await swaps.swap(req)
    body = rec.to_dict()
    body["ok"] = rec.status is SwapStatus.SUCCEEDED
    body["results"] = rec.results()
    # a partial refit is 207 (Multi-Status) with each engine's result; only "no engine
    # took the version" is an error status: 400 when every engine refused the source and
    # kept its weights (the source is what to fix; a retry as is fails again), else 503
    if rec.status is SwapStatus.FAILED:
        if rec.engines and all(o.kept_version for o in rec.engines.values()):
            raise InvalidArgument(f"no engine took version {rec.version}: every engine "
                                  f"refused the weight source and kept its weights: "
                                  f"{rec.message}", details={"swap": body})
        raise EngineError(f"no engine took version {rec.version}: {rec.message}",
                          details={"swap": body})
    return ORJSONResponse(body, status_code=207 if rec.status is SwapStatus.PARTIAL else 200)


@weights.get("/v1/versions")
async def versions(request: Request, registry: Registry, pool: Pool) -> Response:
    """Learner and engine versions, recent swaps. Weight sources (checkpoint paths), the
    swap leader's host and engine URLs are shown to the admin only."""
    snap = await registry.snapshot()
    snap = dict(snap)
    snap["engines_live"] = {e.id: {"weight_version": e.version, "state": e.state.value}
                            for e in pool.list()}
    return ORJSONResponse(snap if is_admin(request) else public_view(snap))


engines = APIRouter(tags=["engines"])


class RegisterEngine(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    url: str = Field(min_length=8, max_length=2048, pattern=r"^https?://[^\s]+$",
                     description="Base URL of the engine (http:// or https://).")
    api_key: str | None = Field(default=None, max_length=4096)


def _engine_view(request: Request, eng) -> dict[str, Any]:
    d = eng.to_dict()
    return d if is_admin(request) else public_view(d)


@engines.get("/v1/engines")
async def list_engines(request: Request, pool: Pool) -> Response:
    """Engines and their state (URLs and raw errors: admin only)."""
    return ORJSONResponse({"engines": [_engine_view(request, e) for e in pool.list()]})


@engines.post("/v1/engines", dependencies=[Depends(require_admin)], status_code=201)
async def register_engine(body: RegisterEngine, register: Register) -> Response:
    spec = EngineSpec(id=body.id, url=body.url, api_key=body.api_key)
    eng = await register(spec.id, spec.url, spec.api_key)
    return ORJSONResponse(eng.to_dict(), status_code=201)


@engines.get("/v1/engines/{engine_id}")
async def get_engine(engine_id: str, request: Request, pool: Pool) -> Response:
    return ORJSONResponse(_engine_view(request, pool.get(engine_id)))


@engines.delete("/v1/engines/{engine_id}", dependencies=[Depends(require_admin)])
async def deregister_engine(engine_id: str, pool: Pool, registry: Registry) -> Response:
    eng = await pool.deregister(engine_id)
    await registry.remove_engine(engine_id)
    return ORJSONResponse(eng.to_dict())


ops = APIRouter(tags=["ops"])


@ops.get("/health")
async def health(request: Request, pool: Pool, serving: Serving) -> Response:
    routable = [e.id for e in pool.list() if e.routable]
    ok = serving and bool(routable)
    body = {"status": "ok" if ok else "unavailable", "serving": serving,
            "engines_routable": routable}
    worker = getattr(request.app.state, "worker", None)
    if worker is not None:  # serve --workers N: which process answered (0..N-1)
        body["worker"] = worker
    return ORJSONResponse(body, status_code=200 if ok else 503)


@ops.get("/metrics")
async def metrics(view: View, replica_metrics: Metrics) -> Response:
    return Response(await render(view, replica_metrics), media_type=CONTENT_TYPE)
