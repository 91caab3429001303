"""The gateway's live state: pool, store, registry, rollouts, swaps. One per process."""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from rollout_gateway.engines.pool import EnginePool
from rollout_gateway.errors import GatewayError
from rollout_gateway.rollouts.gatekeeper import Gatekeeper
from rollout_gateway.rollouts.service import RolloutService
from rollout_gateway.settings import GatewaySettings
from rollout_gateway.store.base import TrajectoryStore
from rollout_gateway.swap.orchestrator import SwapOrchestrator

log = logging.getLogger(__name__)


class Gateway:
    """Owns everything the HTTP routes and the gRPC control plane act on."""

    def __init__(self, settings: GatewaySettings, *, store: TrajectoryStore | None = None,
                 registry: Any = None) -> None:
        self.settings = settings
        self._own_store = store is None
        self._own_registry = registry is None
        if store is None:
            from rollout_gateway.store.factory import store_from_url

            store = store_from_url(settings.store_url)
        if registry is None:
            from rollout_gateway.registry import create_registry

            registry = create_registry(settings.registry_url)
        self.store = store
        self.registry = registry
        self.pool = EnginePool(settings)
        self.gatekeeper = Gatekeeper(settings.admission, store, registry)
        self.rollouts = RolloutService(self.pool, store, settings, gatekeeper=self.gatekeeper)
        holder = f"{socket.gethostname()}:{os.getpid()}"
        self.swaps = SwapOrchestrator(self.pool, registry, settings, holder=holder)
        from rollout_gateway.swap.control import GatewayControlPlane

        self.control = GatewayControlPlane(self.pool, registry, self.swaps)
        self.started_at = time.time()
        self.serving = False

    async def start(self) -> None:
        for spec in self.settings.engines:
            try:
                eng = await self.pool.register(spec.id, spec.url, spec.api_key)
                await self._sync_engine_version(eng.id, eng.version)
            except GatewayError as exc:
                # a configured engine that is not up yet is retried by the health loop
                log.error("engine %s at %s is not reachable at start-up: %s", spec.id, spec.url,
                          exc.message)
                await self.pool.register_offline(spec.id, spec.url, spec.api_key, exc.message)
        self.pool.start()
        self.serving = True

    async def _sync_engine_version(self, engine_id: str, version: int | None) -> None:
        if version is None:
            return
        try:
            await self.registry.set_engine_version(engine_id, version)
        except GatewayError as exc:
            log.warning("registry: %s", exc.message)

    async def stop(self) -> None:
        self.serving = False
        await self.pool.close()
        if self._own_store:
            await self.store.close()
        if self._own_registry:
            await self.registry.close()
