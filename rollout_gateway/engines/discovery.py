"""Engine discovery through DNS: a Kubernetes headless Service answers one A/AAAA record per
engine pod (``publishNotReadyAddresses: true`` lists pods that are still loading, which the
health loop then brings into rotation). Every ``interval_s`` the gateway resolves the name,
registers engines that appeared (as ``<prefix>-<ip>``, at ``scheme://ip:port``, caught up
to the pool's weights before they serve) and deregisters those that disappeared (their
in-flight samples fail over). A failed lookup changes nothing (a DNS blip must not empty
the pool). Settings: ``ROLLOUT_GATEWAY_ENGINE_DISCOVERY__*``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from rollout_gateway.aio import Periodic
from rollout_gateway.errors import GatewayError

if TYPE_CHECKING:
    from rollout_gateway.settings import EngineDiscovery

log = logging.getLogger(__name__)

Resolver = Callable[[str], Awaitable[list[str]]]
#: (engine id, url, api key): register an engine that appeared, caught up before it serves
AddEngine = Callable[[str, str, str | None], Awaitable[None]]
#: (engine id): forget an engine that disappeared (pool, then registry)
DropEngine = Callable[[str], Awaitable[Any]]


async def resolve_addresses(name: str) -> list[str]:
    """Every address ``name`` resolves to (the system resolver, as pods use it)."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
    return sorted({i[4][0] for i in infos})


class DnsDiscovery:
    """Keeps the pool equal to what ``cfg.dns_name`` resolves to, through ``add`` (an
    engine that appeared) and ``deregister`` / ``forget`` (one that disappeared: out of
    the pool, then out of the registry)."""

    def __init__(self, cfg: EngineDiscovery, *, add: AddEngine, deregister: DropEngine,
                 forget: DropEngine, resolver: Resolver | None = None):
        self.cfg = cfg
        self.add, self.deregister, self.forget = add, deregister, forget
        self.resolver = resolver or resolve_addresses
        self.discovered: set[str] = set()  # engine ids this loop registered
        self._loop = Periodic(self.sync_once, cfg.interval_s, what="engine discovery", log=log)

    def engine_id(self, addr: str) -> str:
        return f"{self.cfg.id_prefix}-" + addr.replace(".", "-").replace(":", "-")

    def url(self, addr: str) -> str:
        host = f"[{addr}]" if ipaddress.ip_address(addr).version == 6 else addr
        return f"{self.cfg.scheme}://{host}:{self.cfg.port}"

    async def sync_once(self) -> tuple[list[str], list[str]]:
        """One lookup; returns (added, removed) engine ids."""
        try:
            addrs = await self.resolver(self.cfg.dns_name)
        except (OSError, UnicodeError) as exc:
            log.warning("engine discovery: cannot resolve %s (%s); keeping %d engine(s)",
                        self.cfg.dns_name, exc, len(self.discovered))
            return [], []
        want = {self.engine_id(a): self.url(a) for a in addrs}
        added = [i for i in sorted(want) if i not in self.discovered]
        removed = sorted(self.discovered - set(want))
        for eid in added:
            await self.add(eid, want[eid], self.cfg.api_key)
            self.discovered.add(eid)
        for eid in removed:
            with contextlib.suppress(GatewayError):
                await self.deregister(eid)
            with contextlib.suppress(GatewayError):
                await self.forget(eid)
            self.discovered.discard(eid)
        if added or removed:
            log.info("engine discovery (%s): added %s, removed %s", self.cfg.dns_name,
                     added, removed)
        return added, removed

    def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()
