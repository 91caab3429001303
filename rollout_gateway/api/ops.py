"""Ops routes: ``GET /v1/lag`` (version-lag report), ``GET /dashboard`` (live page, assets
vendored in the package: works offline) and ``GET /livez`` (liveness)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, Response

from rollout_gateway.api.deps import View
from rollout_gateway.api.errors import ORJSONResponse
from rollout_gateway.api.security import is_admin
from rollout_gateway.errors import NotFound
from rollout_gateway.observe.lag import LagReport, lag_report

router = APIRouter(tags=["ops"])
ASSETS = Path(__file__).with_name("dashboard")
#: the files /dashboard serves (nothing else under the folder is reachable)
ASSET_TYPES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}


@router.get("/v1/lag", response_model=LagReport)
async def lag(request: Request, view: View,
              history: bool = Query(False, description="include the dashboard time series"),
              recent_swaps: int = Query(10, ge=1, le=100,
                                        description="swaps whose pause windows are listed"),
              ) -> Response:
    """Learner version, each engine's version/state/lag, the lag distributions of tokens in
    flight, finished-but-unconsumed and delivered, intra-trajectory staleness, recent pause
    windows, staleness handling and per-group backlog. ``replica`` (host:pid) is shown to
    the admin only."""
    rep = await lag_report(view, recent_swaps=recent_swaps, history=history)
    if not is_admin(request):
        rep.replica = None
    return ORJSONResponse(rep.model_dump())


@router.get("/livez")
async def livez() -> Response:
    """Liveness: the event loop answers. (Readiness is /health or gRPC health.)"""
    return ORJSONResponse({"status": "alive"})


@router.get("/dashboard", include_in_schema=False)
async def dashboard() -> Response:
    return FileResponse(ASSETS / "index.html", media_type="text/html")


@router.get("/dashboard/{name}", include_in_schema=False)
async def dashboard_asset(name: str) -> Response:
    if name not in ASSET_TYPES:
        raise NotFound(f"no dashboard asset {name!r}")
    return FileResponse(ASSETS / name, media_type=ASSET_TYPES[name])
