"""Redis version registry: the state several gateway replicas share.

Keys under ``{prefix}:reg:`` (named by ``store.keys.KeyLayout.key``: on a Redis Cluster
``{prefix}:{{prefix}}:reg:``, all in one slot): ``learner`` (int), ``engines`` (hash
engine -> version), ``swaps`` (hash swap_id -> JSON), ``swap_order`` (zset by start time),
``lease`` (the leader's token, with a PX expiry), ``running`` / ``running_expiry``.
Changes are published on ``reg:events`` (named like a key, so a script's PUBLISH names
a key of its own slot; on a cluster PUBLISH reaches every node).
Check-and-set steps run as Lua scripts, so concurrent replicas cannot interleave them.
Pub/sub is at-most-once: a watcher that reconnects should re-read ``snapshot()``. On a
cluster the watch subscribes on one node and moves to another when that node is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisClusterException, RedisError

from rollout_gateway.errors import FailedPrecondition, StoreError
from rollout_gateway.store.keys import KeyLayout
from rollout_gateway.store.redis_client import redis_failures
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

T = TypeVar("T")

_SET_LEARNER = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local new = tonumber(ARGV[1])
if new < cur then return {0, cur} end
if new ~= cur then
  redis.call('SET', KEYS[1], ARGV[1])
  redis.call('PUBLISH', KEYS[2], ARGV[2])
end
return {1, cur}
"""
_SET_ENGINE = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('PUBLISH', KEYS[2], ARGV[3])
end
return 1
"""
_REMOVE_ENGINE = """
local n = redis.call('HDEL', KEYS[1], ARGV[1])
if n == 1 then redis.call('PUBLISH', KEYS[2], ARGV[2]) end
return n
"""
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


_RUNNING_SUM = """
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1])
if #expired > 0 then
  redis.call('HDEL', KEYS[1], unpack(expired))
  redis.call('ZREM', KEYS[2], unpack(expired))
end
local total = 0
local flat = redis.call('HGETALL', KEYS[1])
for i = 1, #flat, 2 do
  if flat[i] ~= ARGV[2] then total = total + tonumber(flat[i + 1]) end
end
return total
"""


# multi-key writes are scripts, not MULTI/EXEC: atomic on one Redis and within one slot of
# a cluster (redis-py's asyncio cluster client runs a MULTI's commands one by one on a
# thread of its own, blocking the event loop)
_RECORD_SWAP = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
local extra = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[4])
if extra > 0 then
  local old = redis.call('ZRANGE', KEYS[2], 0, extra - 1)
  redis.call('HDEL', KEYS[1], unpack(old))
  redis.call('ZREM', KEYS[2], unpack(old))
end
return 1
"""
_REPORT_RUNNING = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
return 1
"""


def _event(kind: str, version: int | None, engine_id: str | None = None) -> bytes:
    return orjson.dumps({"kind": kind, "version": version, "engine_id": engine_id,
                         "at": time.time()})


class RedisRegistry(VersionRegistry):
    def __init__(self, client: aioredis.Redis, *, prefix: str = "rg",
                 max_history: int = 1000, version_cache_s: float = 0.0) -> None:
        from redis.asyncio.cluster import RedisCluster

        self._r = client
        self.cluster = isinstance(client, RedisCluster)
        keys = KeyLayout(prefix, cluster=self.cluster)
        #: the learner version is read on every admission and judgement: cache it briefly
        #: (this replica's own writes update it at once) and share one read among callers
        self._cache_s = version_cache_s
        self._cached: tuple[float, int] | None = None  # (monotonic read time, version)
        self._reading: asyncio.Task[int] | None = None
        k = lambda name: keys.key(f"reg:{name}")  # noqa: E731
        self._k_learner, self._k_engines = k("learner"), k("engines")
        self._k_swaps, self._k_order, self._k_lease = k("swaps"), k("swap_order"), k("lease")
        self._k_running, self._k_running_exp = k("running"), k("running_expiry")
        self.channel = k("events")
        self._max_history = max_history
        self._set_learner = client.register_script(_SET_LEARNER)
        self._set_engine = client.register_script(_SET_ENGINE)
        self._remove_engine = client.register_script(_REMOVE_ENGINE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._running_sum = client.register_script(_RUNNING_SUM)
        self._record_swap = client.register_script(_RECORD_SWAP)
        self._report_running = client.register_script(_REPORT_RUNNING)

    @classmethod
    def from_url(cls, url: str, *, max_connections: int | None = None,
                 pool_wait_s: float | None = None, **kw: Any) -> RedisRegistry:
        from rollout_gateway.store.redis_client import blocking_client, cluster_client, is_cluster

        if is_cluster(url):
            return cls(cluster_client(url, max_connections=max_connections), **kw)
        return cls(blocking_client(url, max_connections=max_connections, wait_s=pool_wait_s),
                   **kw)

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        async with redis_failures(f"version registry (Redis) failed to {what}"):
            return await fn()

    async def learner_version(self) -> int:
        loop = asyncio.get_running_loop()
        c = self._cached
        if c is not None and loop.time() - c[0] < self._cache_s:
            return c[1]
        # one read at a time, shared by every caller; a caller cancelled meanwhile does
        # not cancel the others' read
        if self._reading is None or self._reading.done():
            self._reading = loop.create_task(self._read_learner())
            self._reading.add_done_callback(lambda t: t.cancelled() or t.exception())
        return await asyncio.shield(self._reading)

    async def _read_learner(self) -> int:
        at = asyncio.get_running_loop().time()
        v = await self._call("read the learner version", lambda: self._r.get(self._k_learner))
        version = int(v) if v is not None else 0
        self._remember(version, at)
        return version

    def _remember(self, version: int, at: float) -> None:
        if self._cache_s > 0 and (self._cached is None or at >= self._cached[0]):
            self._cached = (at, version)

    async def set_learner_version(self, version: int) -> int:
        check_version(version, "learner version")
        ok, cur = await self._call("set the learner version", lambda: self._set_learner(
            keys=[self._k_learner, self.channel],
            args=[version, _event("learner", version)]))
        if not ok:
            self._cached = None
            refuse_backwards(int(cur), version)
        self._remember(version, asyncio.get_running_loop().time())
        return int(cur)

    async def engine_versions(self) -> dict[str, int]:
        h = await self._call("read engine versions", lambda: self._r.hgetall(self._k_engines))
        return {k.decode(): int(v) for k, v in h.items()}

    async def set_engine_version(self, engine_id: str, version: int) -> None:
        check_version(version, "engine version")
        await self._call("set an engine version", lambda: self._set_engine(
            keys=[self._k_engines, self.channel],
            args=[engine_id, version, _event("engine", version, engine_id)]))

    async def remove_engine(self, engine_id: str) -> bool:
        n = await self._call("remove an engine", lambda: self._remove_engine(
            keys=[self._k_engines, self.channel],
            args=[engine_id, _event("engine_removed", None, engine_id)]))
        return bool(n)

    async def record_swap(self, record: SwapRecord) -> None:
        data = orjson.dumps(record.to_dict())

        async def write() -> None:
            await self._record_swap(keys=[self._k_swaps, self._k_order],
                                    args=[record.swap_id, data, record.started_at,
                                          self._max_history])

        await self._call("record a swap", write)

    async def get_swap(self, swap_id: str) -> SwapRecord | None:
        raw = await self._call("read a swap", lambda: self._r.hget(self._k_swaps, swap_id))
        return None if raw is None else SwapRecord.from_dict(orjson.loads(raw))

    async def swaps(self, limit: int = 20) -> list[SwapRecord]:
        if limit <= 0:
            return []

        async def read() -> list[Any]:
            ids = await self._r.zrevrange(self._k_order, 0, limit - 1)
            return await self._r.hmget(self._k_swaps, ids) if ids else []

        raws = await self._call("read swaps", read)
        return [SwapRecord.from_dict(orjson.loads(r)) for r in raws if r is not None]

    async def acquire_lease(self, owner: str, ttl: float) -> Lease:
        token = f"{owner}:{uuid.uuid4().hex}"
        ms = max(1, int(ttl * 1000))
        now = time.time()
        got = await self._call("acquire the swap lease", lambda: self._r.set(
            self._k_lease, token, nx=True, px=ms))
        if not got:
            holder = await self.lease_holder()
            raise FailedPrecondition(f"a swap is being led by {holder!r}",
                                     details={"leader": holder})
        return Lease(owner=owner, token=token, ttl=ttl, expires_at=now + ttl)

    async def renew_lease(self, lease: Lease) -> bool:
        now = time.time()
        ok = await self._call("renew the swap lease", lambda: self._renew(
            keys=[self._k_lease], args=[lease.token, max(1, int(lease.ttl * 1000))]))
        if ok:
            lease.expires_at = now + lease.ttl
            return True
        lease.lost = True
        return False

    async def release_lease(self, lease: Lease) -> bool:
        n = await self._call("release the swap lease", lambda: self._release(
            keys=[self._k_lease], args=[lease.token]))
        return bool(n)

    async def lease_holder(self) -> str | None:
        raw = await self._call("read the swap lease", lambda: self._r.get(self._k_lease))
        return None if raw is None else raw.decode().rsplit(":", 1)[0]

    async def report_running(self, replica: str, running: int, ttl: float = 15.0) -> None:
        check_running(replica, running, ttl)

        await self._call("report in-flight work", lambda: self._report_running(
            keys=[self._k_running, self._k_running_exp],
            args=[replica, running, time.time() + ttl]))

    async def running_elsewhere(self, replica: str) -> int:
        n = await self._call("read in-flight work", lambda: self._running_sum(
            keys=[self._k_running, self._k_running_exp], args=[time.time(), replica]))
        return int(n)

    def watch(self) -> Watch:
        return _RedisWatch(self._r, self.channel)

    async def close(self) -> None:
        with contextlib.suppress(RedisError):
            await self._r.aclose()


class _RedisWatch(Watch):
    """Pub/sub feed that resubscribes after a dropped connection (events published
    while it was down are lost: pub/sub is at-most-once; re-read snapshot() if needed)."""

    def __init__(self, client: aioredis.Redis, channel: str) -> None:
        self._client = client
        self._channel = channel
        self._ps: Any = None
        self.reconnects = 0

    async def start(self) -> None:
        from redis.asyncio.cluster import RedisCluster

        if isinstance(self._client, RedisCluster):
            try:  # its pub/sub picks the node of the channel's slot from the slot map
                await self._client.initialize()
            except (RedisError, RedisClusterException) as exc:
                raise StoreError(f"version registry (Redis) failed to subscribe: {exc}") \
                    from exc
        ps = self._client.pubsub(ignore_subscribe_messages=True)
        try:
            await ps.subscribe(self._channel)
        except (RedisError, RedisClusterException) as exc:
            with contextlib.suppress(RedisError):
                await ps.aclose()
            raise StoreError(f"version registry (Redis) failed to subscribe: {exc}") from exc
        self._ps = ps

    async def stop(self) -> None:
        if self._ps is not None:
            ps, self._ps = self._ps, None
            with contextlib.suppress(RedisError):
                await ps.unsubscribe(self._channel)
            with contextlib.suppress(RedisError):
                await ps.aclose()

    async def next(self, timeout: float | None = None) -> VersionEvent:
        if self._ps is None:
            raise StoreError("watch() must be entered before reading events")
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            wait = 1.0 if deadline is None else max(0.0, min(1.0, deadline - loop.time()))
            try:
                msg = await self._ps.get_message(timeout=wait)
            except (RedisError, RedisClusterException) as exc:
                await self._resubscribe(exc, deadline)
                continue
            if msg is not None and msg.get("type") == "message":
                d = orjson.loads(msg["data"])
                return VersionEvent(d["kind"], d["version"], d["engine_id"], d["at"])
            if deadline is not None and loop.time() >= deadline:
                raise TimeoutError("no version change within the timeout")

    async def _resubscribe(self, cause: Exception, deadline: float | None) -> None:
        """Reconnect with backoff; StoreError once the caller's deadline (or ~10 s) passes."""
        loop = asyncio.get_running_loop()
        give_up = deadline if deadline is not None else loop.time() + 10.0
        await self.stop()
        delay = 0.05
        while True:
            try:
                await self.start()
                self.reconnects += 1
                return
            except StoreError:
                if loop.time() + delay > give_up:
                    raise StoreError(f"version registry (Redis) watch lost its connection: "
                                     f"{cause}") from cause
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
