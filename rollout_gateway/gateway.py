"""The composition root: one :class:`Gateway` per process builds every component, wires
every hook between them, and starts and stops them in order. Read top to bottom, its
constructor is the gateway (docs/architecture.md). ``commands/serve.py`` puts the two front
doors in front of one: ``api.app.create_app`` (HTTP) and ``transport.server.GrpcServer``
(learners)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

from rollout_gateway import native
from rollout_gateway.aio import cancel_and_wait
from rollout_gateway.auth import Authenticator
from rollout_gateway.engines.discovery import DnsDiscovery, Resolver
from rollout_gateway.engines.pool import Engine, EnginePool
from rollout_gateway.errors import GatewayError
from rollout_gateway.heaptrim import HeapTrimmer
from rollout_gateway.observe.history import HistorySampler
from rollout_gateway.observe.metrics import GatewayMetrics
from rollout_gateway.observe.tracker import LagTracker
from rollout_gateway.observe.view import GatewayView
from rollout_gateway.old_logits import OldLogitService
from rollout_gateway.registry import create_registry
from rollout_gateway.registry.base import VersionRegistry
from rollout_gateway.rollouts.gatekeeper import Gatekeeper
from rollout_gateway.rollouts.rollout import RolloutService
from rollout_gateway.sessions.manager import SessionManager
from rollout_gateway.sessions.factory import session_store_for
from rollout_gateway.settings import GatewaySettings, OldLogitsMode
from rollout_gateway.store.base import TrajectoryStore
from rollout_gateway.store.factory import store_from_url
from rollout_gateway.swap.orchestrator import SwapOrchestrator
from rollout_gateway.transport.learner_control import GatewayControlPlane

log = logging.getLogger(__name__)


class Gateway:
    """Everything the HTTP routes and the learner gRPC service act on, built here.

    ``store`` / ``registry``: shared state to use instead of the ones ``settings`` name (the
    caller then closes them); ``resolver``: the DNS resolver of engine discovery (None: the
    system's)."""

    def __init__(self, settings: GatewaySettings, *, store: TrajectoryStore | None = None,
                 registry: VersionRegistry | None = None,
                 resolver: Resolver | None = None) -> None:
        s = self.settings = settings
        native.select(s.data_plane)  # the engine-answer parsers (raises if native is missing)
        self.auth = Authenticator.from_settings(s)
        # ---- state shared by every replica: trajectories, versions ----
        self._own_store, self._own_registry = store is None, registry is None
        if store is None:
            store = store_from_url(s.store_url, max_connections=s.redis.max_connections,
                                   pool_wait_s=s.redis.wait_s, shards=s.store_shards)
        if registry is None:
            registry = create_registry(s.registry_url, max_connections=s.redis.max_connections,
                                       pool_wait_s=s.redis.wait_s,
                                       version_cache_s=s.redis.version_cache_s)
        self.store, self.registry = store, registry
        # ---- engines ----
        self.pool = EnginePool(s)
        # ---- rollouts: admission, exact old logits (optional), samples ----
        self.gatekeeper = Gatekeeper(s.admission, self.store, self.registry)
        self.old_logits = None
        if s.old_logits.mode is not OldLogitsMode.OFF:
            self.old_logits = OldLogitService(s, self.registry)
        self.rollouts = RolloutService(self.pool, self.store, s, gatekeeper=self.gatekeeper,
                                       oldlogits=self.old_logits)
        # ---- weight swaps, and the learner's control plane over them ----
        self.swaps = SwapOrchestrator(self.pool, self.registry, s,
                                      holder=f"{socket.gethostname()}:{os.getpid()}",
                                      oldlogits=self.old_logits)
        self.control = GatewayControlPlane(self.pool, self.registry, self.swaps)
        # ---- agent sessions (the OpenAI routes) over rollouts ----
        self.sessions = SessionManager(s, self.rollouts,
                                       learner_version=self.registry.learner_version,
                                       engines=self.pool.list, publish=self.store.publish,
                                       store=session_store_for(self.store),
                                       replica_id=self.gatekeeper.replica_id)
        if self.sessions.store.shared:  # one run of a request_id across the replicas
            self.rollouts.claims = self.sessions.store
        # ---- engine discovery through DNS (settings.engine_discovery.dns_name) ----
        self.discovery = None
        if s.engine_discovery.dns_name:
            self.discovery = DnsDiscovery(s.engine_discovery, add=self.add_engine,
                                          deregister=self.pool.deregister,
                                          forget=self.registry.remove_engine,
                                          resolver=resolver)
        # ---- observers: what /metrics, /v1/lag and the dashboard read ----
        self.tracker = LagTracker()
        self.metrics = GatewayMetrics()
        self.view = GatewayView(registry=self.registry, store=self.store,
                                engines=self.pool.list, running=self.rollouts.runner.active.values,
                                rollouts=self.rollouts, gatekeeper=self.gatekeeper,
                                sessions=self.sessions, old_logits=self.old_logits,
                                tracker=self.tracker, refits=self.swaps.tally)
        self.history = HistorySampler(self.view, s.lag_history_interval_s)
        # ---- hooks: what each component reports, and to whom ----
        self.pool.on_recovered = self.swaps.catch_up  # back from UNHEALTHY: its weights
        self.pool.swapped_elsewhere = self.swaps.swapped_elsewhere  # another replica's swap
        self.rollouts.on_finished = self.tracker.on_finished
        self.rollouts.on_admission_wait = self.metrics.observe_admission
        self.rollouts.runner.on_first_token = self.metrics.ttft.observe
        self.swaps.on_pause_window = self.metrics.observe_pause
        # ---- the process: freed heap given back to the OS; run state ----
        self.heap = HeapTrimmer(s.heap_trim_s)
        self.started_at = time.time()
        self.serving = False  # /health and gRPC health: True between start() and draining
        self.draining = False  # SIGTERM: new generation requests are refused (503)
        self._watch_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.old_logits is not None:  # the scorer must answer before rollouts need it
            await self.old_logits.start()
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

    async def register_engine(self, engine_id: str, url: str,
                              api_key: str | None = None) -> Engine:
        """``POST /v1/engines``: register an engine and catch it up to the pool's weights
        before it serves; a failure goes back to the caller."""
        eng = await self.pool.register(engine_id, url, api_key, fenced=True)
        await self._catch_up_fenced(eng)
        await self.sync_engine_version(eng.id, eng.version)
        return eng

    async def add_engine(self, engine_id: str, url: str, api_key: str | None = None) -> None:
        """Register an engine found at run time (discovery): caught up to the pool's weights
        before it serves; one that does not answer yet is registered offline (the health
        loop brings it in and catches it up)."""
        try:
            eng = await self.pool.register(engine_id, url, api_key, fenced=True)
        except GatewayError as exc:
            if engine_id in {e.id for e in self.pool.list()}:
                return
            await self.pool.register_offline(engine_id, url, api_key, exc.message)
            return
        try:
            await self._catch_up_fenced(eng)
        except GatewayError as exc:
            log.warning("engine %s could not catch up: %s", engine_id, exc.message)
        await self.sync_engine_version(eng.id, eng.version)

    async def _catch_up_fenced(self, eng: Engine) -> None:
        self.pool.close_gate(eng)  # no traffic before it runs the pool's current weights
        try:
            await self.swaps.catch_up(eng)
        finally:
            await self.pool.open_gate(eng)

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
        await self.sessions.stop()  # embedded store: open sessions are published (shutdown)
        await self.history.stop()
        if self.discovery is not None:
            await self.discovery.stop()
        task, self._watch_task = self._watch_task, None
        await cancel_and_wait(task)
        await self.gatekeeper.stop()
        await self.pool.close()
        if self.old_logits is not None:
            await self.old_logits.close()
        if self._own_store:
            await self.store.close()
        if self._own_registry:
            await self.registry.close()
