"""The gateway's live state: pool, store, registry, rollouts, swaps. One per process."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from typing import Any

from rollout_gateway.aio import cancel_and_wait
from rollout_gateway.auth import Authenticator
from rollout_gateway.engines.discovery import DnsDiscovery, Resolver
from rollout_gateway.engines.pool import EnginePool
from rollout_gateway.errors import GatewayError
from rollout_gateway.rollouts.gatekeeper import Gatekeeper
from rollout_gateway.rollouts.rollout import RolloutService
from rollout_gateway.settings import GatewaySettings
from rollout_gateway.store.base import TrajectoryStore
from rollout_gateway.swap.orchestrator import SwapOrchestrator

log = logging.getLogger(__name__)


class Gateway:
    """Owns everything the HTTP routes and the gRPC control plane act on."""

    def __init__(self, settings: GatewaySettings, *, store: TrajectoryStore | None = None,
                 registry: Any = None, resolver: Resolver | None = None) -> None:
        """``resolver``: the DNS resolver of engine discovery (None: the system's)."""
        self.settings = settings
        self.auth = Authenticator.from_settings(settings)
        self._own_store = store is None
        self._own_registry = registry is None
        if store is None:
            from rollout_gateway.store.factory import store_from_url

            store = store_from_url(settings.store_url,
                                   max_connections=settings.redis.max_connections,
                                   pool_wait_s=settings.redis.wait_s)
        if registry is None:
            from rollout_gateway.registry import create_registry

            registry = create_registry(settings.registry_url,
                                       max_connections=settings.redis.max_connections,
                                       pool_wait_s=settings.redis.wait_s,
                                       version_cache_s=settings.redis.version_cache_s)
        self.store = store
        self.registry = registry
        self.pool = EnginePool(settings)
        self.gatekeeper = Gatekeeper(settings.admission, store, registry)
        self.oldlogits = None
        if settings.old_logits.mode != "off":
            from rollout_gateway.old_logits import OldLogitService

            self.oldlogits = OldLogitService(settings, registry)
        self.rollouts = RolloutService(self.pool, store, settings, gatekeeper=self.gatekeeper,
                                       oldlogits=self.oldlogits)
        holder = f"{socket.gethostname()}:{os.getpid()}"
        self.swaps = SwapOrchestrator(self.pool, registry, settings, holder=holder,
                                      oldlogits=self.oldlogits)
        from rollout_gateway.transport.learner_control import GatewayControlPlane

        self.control = GatewayControlPlane(self.pool, registry, self.swaps)
        from rollout_gateway.observe.tracker import install

        install(self)  # lag tracker, Prometheus histograms, dashboard history
        from rollout_gateway.sessions.manager import SessionManager

        self.sessions = SessionManager(settings, self.rollouts,
                                       learner_version=registry.learner_version,
                                       engines=self.pool.list, publish=store.publish)
        self.discovery = None  # engine discovery through DNS, when configured
        if settings.engine_discovery.dns_name:
            self.discovery = DnsDiscovery(settings.engine_discovery, add=self.add_engine,
                                          deregister=self.pool.deregister,
                                          forget=registry.remove_engine, resolver=resolver)
        self.started_at = time.time()
        self.serving = False
        self._watch_task: asyncio.Task[None] | None = None
        from rollout_gateway.heaptrim import HeapTrimmer

        self.heap = HeapTrimmer(settings.heap_trim_s)

    async def start(self) -> None:
        if self.oldlogits is not None:  # the scorer must answer before rollouts need it
            await self.oldlogits.start()
        for spec in self.settings.engines:
            try:
                eng = await self.pool.register(spec.id, spec.url, spec.api_key)
                await self.sync_engine_version(eng.id, eng.version)
            except GatewayError as exc:
                # a configured engine that is not up yet is retried by the health loop
                log.error("engine %s at %s is not reachable at start-up: %s", spec.id, spec.url,
                          exc.message)
                await self.pool.register_offline(spec.id, spec.url, spec.api_key, exc.message)
        for eng in self.pool.list():  # a restarted gateway may face engines left behind
            if eng.routable:
                try:
                    await self.swaps.catch_up(eng)
                except GatewayError as exc:
                    log.warning("engine %s could not catch up: %s", eng.id, exc.message)
        self.pool.on_recovered = self.swaps.catch_up
        self.pool.start()
        self._watch_task = asyncio.get_running_loop().create_task(self._follow_registry())
        if self.discovery is not None:
            await self.discovery.sync_once()
            self.discovery.start()
        self.gatekeeper.start()
        self.history.start()
        self.sessions.start()
        self.heap.start()
        self.serving = True

    async def _follow_registry(self) -> None:
        """Engine versions set by another replica's swap (shared Redis registry)."""
        while True:
            try:
                async with self.registry.watch() as feed:
                    async for ev in feed:
                        if ev.kind == "engine" and ev.engine_id and ev.version is not None:
                            try:
                                eng = self.pool.get(ev.engine_id)
                            except GatewayError:
                                continue
                            if eng.version is None or ev.version > eng.version:
                                eng.version = ev.version
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep following after a registry blip
                log.warning("registry watch failed (%s); retrying", exc)
                await asyncio.sleep(1.0)

    async def add_engine(self, engine_id: str, url: str, api_key: str | None = None) -> None:
        """Register an engine found at run time (discovery): caught up to the pool's weights
        before it serves; one that does not answer yet is registered offline (the health
        loop brings it in and catches it up)."""
        try:
            eng = await self.pool.register(engine_id, url, api_key)
        except GatewayError as exc:
            if engine_id in {e.id for e in self.pool.list()}:
                return
            await self.pool.register_offline(engine_id, url, api_key, exc.message)
            return
        self.pool.close_gate(eng)
        try:
            await self.swaps.catch_up(eng)
        except GatewayError as exc:
            log.warning("engine %s could not catch up: %s", engine_id, exc.message)
        finally:
            await self.pool.open_gate(eng)
        await self.sync_engine_version(eng.id, eng.version)

    async def sync_engine_version(self, engine_id: str, version: int | None) -> None:
        if version is None:
            return
        try:
            await self.registry.set_engine_version(engine_id, version)
        except GatewayError as exc:
            log.warning("registry: %s", exc.message)

    async def stop(self) -> None:
        self.serving = False
        await self.heap.stop()
        await self.sessions.stop()  # open sessions are published (ended_by=shutdown)
        await self.history.stop()
        if self.discovery is not None:
            await self.discovery.stop()
        task, self._watch_task = self._watch_task, None
        await cancel_and_wait(task)
        await self.gatekeeper.stop()
        await self.pool.close()
        if self.oldlogits is not None:
            await self.oldlogits.close()
        if self._own_store:
            await self.store.close()
        if self._own_registry:
            await self.registry.close()
