"""The real ControlPlane behind the learner gRPC service: registry + swap orchestrator."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import orjson
from pydantic import ValidationError

from rollout_gateway.core.swap_mode import SwapMode
from rollout_gateway.engines.pool import EnginePool
from rollout_gateway.errors import InvalidArgument
from rollout_gateway.registry.base import SwapStatus, VersionRegistry
from rollout_gateway.swap.models import DiskSource, DistributedSource, SwapRequest
from rollout_gateway.swap.orchestrator import SwapOrchestrator
from rollout_gateway.transport.control_plane import (
    AnnounceResult,
    ControlStatus,
    EngineVersion,
    VersionEvent,
    WeightSource,
    WeightSourceKind,
    validate_announce,
)


def swap_request_from(version: int, source: WeightSource, mode: SwapMode,
                      rolling: bool) -> SwapRequest:
    """Map the wire's WeightSource onto a SwapRequest (InvalidArgument when it cannot)."""
    validate_announce(version, source)
    if source.kind is WeightSourceKind.PATH:
        src: DiskSource | DistributedSource = DiskSource(path=source.uri,
                                                          load_format=source.options.get("load_format"))
    elif source.kind is WeightSourceKind.DISTRIBUTED:
        o = source.options
        try:  # ValidationError is a ValueError
            host, _, port = source.uri.rpartition(":")
            src = DistributedSource(
                master_address=o.get("master_address", host), master_port=int(o.get("master_port", port)),
                group_name=o.get("group_name", "weight_update"), backend=o.get("backend", "nccl"),
                world_size=int(o["world_size"]), names=orjson.loads(o["names"]),
                dtypes=orjson.loads(o["dtypes"]), shapes=orjson.loads(o["shapes"]),
                rank_offsets=orjson.loads(o["rank_offsets"]) if "rank_offsets" in o else None,
                init_group=o.get("init_group", "true").lower() != "false")
        except (KeyError, ValueError, orjson.JSONDecodeError) as exc:
            raise InvalidArgument(
                "distributed source needs uri 'host:port' and options world_size, names, dtypes, "
                f"shapes (JSON lists): {exc}") from exc
    else:
        raise InvalidArgument(f"weight source kind {source.kind!r} is not supported by this "
                              "gateway; use 'path' (shared storage) or 'distributed'")
    try:
        return SwapRequest(version=version, source=src, mode=mode, rolling=rolling)
    except ValidationError as exc:
        msgs = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise InvalidArgument(f"invalid announce: {msgs}") from None


class GatewayControlPlane:
    """Implements rollout_gateway.transport.control_plane.ControlPlane."""

    def __init__(self, pool: EnginePool, registry: VersionRegistry, swaps: SwapOrchestrator) -> None:
        self.pool = pool
        self.registry = registry
        self.swaps = swaps

    async def status(self) -> ControlStatus:
        engines = [EngineVersion(e.id, e.version if e.version is not None else -1, e.routable)
                   for e in self.pool.list()]
        return ControlStatus(learner_version=await self.registry.learner_version(),
                             engines=engines, swap_in_progress=self.swaps.in_progress is not None)

    async def announce(self, version: int, source: WeightSource, mode: SwapMode,
                       rolling: bool = False) -> AnnounceResult:
        req = swap_request_from(version, source, mode, rolling)
        t0 = time.monotonic()
        rec = await self.swaps.swap(req)
        windows = [(b or time.time()) - a for _e, a, b in rec.pause_windows()]
        return AnnounceResult(accepted=rec.status is not SwapStatus.FAILED, version=version,
                              message=f"{rec.status}: {rec.message}",
                              pause_seconds=max(windows, default=time.monotonic() - t0))

    async def watch(self) -> AsyncIterator[VersionEvent]:
        async with self.registry.watch() as feed:
            async for ev in feed:
                kind = {"learner": "announced", "engine": "engine_updated"}.get(ev.kind, ev.kind)
                yield VersionEvent(version=ev.version if ev.version is not None else -1,
                                   kind=kind, engine_id=ev.engine_id or "", at=ev.at)
