"""In-process version registry: the zero-setup default for a single gateway."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict

from rollout_gateway.errors import FailedPrecondition
from rollout_gateway.registry.base import (
    Lease,
    SwapRecord,
    VersionEvent,
    VersionRegistry,
    Watch,
    check_running,
    check_version,
    refuse_backwards,
)


class InMemoryRegistry(VersionRegistry):
    def __init__(self, *, max_history: int = 1000) -> None:
        self._learner = 0
        self._engines: dict[str, int] = {}
        self._swaps: OrderedDict[str, dict] = OrderedDict()  # swap_id -> record dict
        self._max_history = max_history
        self._lease: tuple[str, str, float] | None = None  # (owner, token, expires_at)
        self._watchers: set[asyncio.Queue[VersionEvent]] = set()
        self._lock = asyncio.Lock()
        self._running: dict[str, tuple[int, float]] = {}  # replica -> (count, expires_at)

    def _publish(self, ev: VersionEvent) -> None:
        for q in self._watchers:
            q.put_nowait(ev)

    async def learner_version(self) -> int:
        return self._learner

    async def set_learner_version(self, version: int) -> int:
        check_version(version, "learner version")
        async with self._lock:
            prev = self._learner
            refuse_backwards(prev, version)
            if version != prev:
                self._learner = version
                self._publish(VersionEvent("learner", version, at=time.time()))
            return prev

    async def engine_versions(self) -> dict[str, int]:
        return dict(self._engines)

    async def set_engine_version(self, engine_id: str, version: int) -> None:
        check_version(version, "engine version")
        if self._engines.get(engine_id) != version:
            self._engines[engine_id] = version
            self._publish(VersionEvent("engine", version, engine_id, time.time()))

    async def remove_engine(self, engine_id: str) -> bool:
        if self._engines.pop(engine_id, None) is None:
            return False
        self._publish(VersionEvent("engine_removed", None, engine_id, time.time()))
        return True

    async def record_swap(self, record: SwapRecord) -> None:
        self._swaps[record.swap_id] = record.to_dict()  # stored as a copy, like Redis
        while len(self._swaps) > self._max_history:
            self._swaps.popitem(last=False)

    async def get_swap(self, swap_id: str) -> SwapRecord | None:
        d = self._swaps.get(swap_id)
        return None if d is None else SwapRecord.from_dict(d)

    async def swaps(self, limit: int = 20) -> list[SwapRecord]:
        recs = sorted(self._swaps.values(), key=lambda d: d["started_at"], reverse=True)
        return [SwapRecord.from_dict(d) for d in recs[:max(limit, 0)]]

    async def acquire_lease(self, owner: str, ttl: float) -> Lease:
        now = time.time()
        if self._lease is not None and self._lease[2] > now:
            raise FailedPrecondition(f"a swap is being led by {self._lease[0]!r}",
                                     details={"leader": self._lease[0]})
        token = f"{owner}:{uuid.uuid4().hex}"
        self._lease = (owner, token, now + ttl)
        return Lease(owner=owner, token=token, ttl=ttl, expires_at=now + ttl)

    async def renew_lease(self, lease: Lease) -> bool:
        now = time.time()
        if self._lease is None or self._lease[1] != lease.token or self._lease[2] <= now:
            lease.lost = True
            return False
        self._lease = (lease.owner, lease.token, now + lease.ttl)
        lease.expires_at = now + lease.ttl
        return True

    async def release_lease(self, lease: Lease) -> bool:
        if self._lease is None or self._lease[1] != lease.token:
            return False
        self._lease = None
        return True

    async def lease_holder(self) -> str | None:
        if self._lease is None or self._lease[2] <= time.time():
            return None
        return self._lease[0]

    async def report_running(self, replica: str, running: int, ttl: float = 15.0) -> None:
        check_running(replica, running, ttl)
        self._running[replica] = (running, time.time() + ttl)

    async def running_elsewhere(self, replica: str) -> int:
        now = time.time()
        for r in [r for r, (_, exp) in self._running.items() if exp <= now]:
            del self._running[r]
        return sum(n for r, (n, _) in self._running.items() if r != replica)

    def watch(self) -> Watch:
        return _MemoryWatch(self._watchers)

    async def close(self) -> None:
        self._watchers.clear()


class _MemoryWatch(Watch):
    def __init__(self, watchers: set[asyncio.Queue[VersionEvent]]) -> None:
        self._watchers = watchers
        self._q: asyncio.Queue[VersionEvent] = asyncio.Queue()

    async def start(self) -> None:
        self._watchers.add(self._q)

    async def stop(self) -> None:
        self._watchers.discard(self._q)

    async def next(self, timeout: float | None = None) -> VersionEvent:
        return await asyncio.wait_for(self._q.get(), timeout)
