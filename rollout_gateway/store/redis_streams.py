"""Redis Streams trajectory store (the production default; shared by gateway replicas).

Keys under ``prefix``: ``{p}:stream`` (entries: tid, d = serialized rollout.v1.Trajectory,
n = prompt+output tokens, lo/hi = min/max policy_version), ``{p}:id:<tid>`` (idempotency
marker holding the entry id, TTL dedup_seconds), ``{p}:groups`` (group -> offset for backlog accounting),
``{p}:acked`` (group -> acked count), ``{p}:counters``, ``{p}:recycled`` (list),
``{p}:facts`` (a stream with the entries' ids and n, lo, vt = output tokens per version:
dashboards scan it without the payloads; trimmed with the stream).
Consumer groups are Redis consumer groups: XREADGROUP for new entries, XAUTOCLAIM for
entries whose lease (idle time) expired, XACK on ack. A nack re-marks the entry as idle
past the lease so the next read re-claims it at once. Publish, group creation and ack are
Lua scripts so the backlog bound and counters stay exact across replicas.

Bulk reads of new entries (XREADGROUP without BLOCK) run on a small thread pool with a
blocking redis-py client: its reply parsing (hiredis, recv_into a reused buffer) costs
about half the CPU of the asyncio connection for multi-MB replies, and the socket wait
runs without the GIL. For by-reference Pull streams (``payload=False``) the same read
skips the payloads as they arrive (``rollout_proto.resp``: only their sizes are kept);
XREADGROUP cannot lease an entry without sending it. Only when nothing is ready does a read wait with BLOCK, on the
asyncio connection. A read abandoned by cancellation releases what it leased at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager

import redis
import redis.asyncio as aioredis
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import RedisError, ResponseError
from redis.retry import Retry as SyncRetry

from rollout_gateway.core import trajectory_codec
from rollout_gateway.core.trajectory import Trajectory
from rollout_gateway.errors import InvalidArgument, NotFound, StoreError
from rollout_gateway.store.base import (
    GroupStats,
    StoreConfig,
    StoredEntry,
    StoreStats,
    TrajectoryStore,
    UnconsumedTokens,
    backlog_full,
    check_name,
    count_unconsumed,
    entry_facts,
    version_tokens,
)
from rollout_gateway.store.redis_client import blocking_client
from rollout_proto.resp import Replies, RespError, Skipped

_PUBLISH = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HINCRBY', KEYS[3], 'duplicates', 1)
  return 0
end
local published = tonumber(redis.call('HGET', KEYS[3], 'published') or '0')
local groups = redis.call('HGETALL', KEYS[4])
local backlog = 0
if #groups == 0 then
  backlog = redis.call('XLEN', KEYS[2])
else
  for i = 1, #groups, 2 do
    local b = published - tonumber(groups[i + 1]) - tonumber(redis.call('HGET', KEYS[5], groups[i]) or '0')
    if b > backlog then backlog = b end
  end
end
if backlog >= tonumber(ARGV[2]) then return -1 end
local eid = redis.call('XADD', KEYS[2], '*', 'tid', ARGV[3], 'd', ARGV[4], 'n', ARGV[5], 'lo', ARGV[6], 'hi', ARGV[7], 'vt', ARGV[8])
redis.call('SET', KEYS[1], eid, 'PX', ARGV[1])
redis.call('XADD', KEYS[6], eid, 'n', ARGV[5], 'lo', ARGV[6], 'vt', ARGV[8])
redis.call('HINCRBY', KEYS[3], 'published', 1)
return 1
"""

_CREATE_GROUP = """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 0 end
redis.pcall('XGROUP', 'CREATE', KEYS[1], ARGV[1], ARGV[2], 'MKSTREAM')
local published = tonumber(redis.call('HGET', KEYS[3], 'published') or '0')
local undelivered = 0
if ARGV[2] == '0' then undelivered = redis.call('XLEN', KEYS[1]) end
redis.call('HSET', KEYS[2], ARGV[1], published - undelivered)
return 1
"""

_ACK = """
local n = redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 2))
if n > 0 then redis.call('HINCRBY', KEYS[2], ARGV[1], n) end
return n
"""

_EXTEND = """
local out = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if #p > 0 then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    out[#out + 1] = ARGV[i]
  end
end
return out
"""

_CHUNK = 1000
_BULK_THREADS = 4  # concurrent bulk reads (one per Pull stream in flight)

log = logging.getLogger(__name__)


def _parse_id(eid: str) -> tuple[int, int]:
    try:
        ms, seq = eid.split("-")
        return int(ms), int(seq)
    except ValueError:
        raise InvalidArgument(f"malformed entry id {eid!r}") from None


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


class RedisStore(TrajectoryStore):
    def __init__(self, url: str = "redis://127.0.0.1:6379/0", prefix: str = "rollout",
                 config: StoreConfig | None = None, client: aioredis.Redis | None = None, *,
                 max_connections: int | None = None, pool_wait_s: float | None = None):
        self.config = config or StoreConfig()
        self.prefix = prefix
        # a bounded pool that waits for a free connection (see redis_client)
        self._r = client or blocking_client(url, max_connections=max_connections,
                                            wait_s=pool_wait_s)
        p = prefix
        self._k_stream, self._k_groups = f"{p}:stream", f"{p}:groups"
        self._k_acked, self._k_counters = f"{p}:acked", f"{p}:counters"
        self._k_recycled = f"{p}:recycled"
        # the entries' small facts (n, lo, vt) under the same ids, trimmed with the stream:
        # dashboards scan it without reading payloads
        self._k_facts = f"{p}:facts"
        self._publish = self._r.register_script(_PUBLISH)
        self._create = self._r.register_script(_CREATE_GROUP)
        self._ack = self._r.register_script(_ACK)
        self._extend = self._r.register_script(_EXTEND)
        self._claim_cursor: dict[str, str] = {}
        self._last_trim = 0.0
        self._closed = False
        # blocking client for bulk reads (None when the caller supplied its own client)
        self._bulk = None if client is not None else redis.Redis.from_url(
            url, decode_responses=False, socket_timeout=30.0, socket_connect_timeout=5.0,
            retry=SyncRetry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), 3))
        self._pool = ThreadPoolExecutor(_BULK_THREADS, thread_name_prefix="redis-bulk")

    @asynccontextmanager
    async def _io(self, what: str):
        if self._closed:
            raise StoreError("store is closed")
        try:
            yield
        except ResponseError as exc:
            if "NOGROUP" in str(exc):
                raise NotFound(f"consumer group does not exist ({what}); create it first") from None
            raise StoreError(f"redis {what} failed: {exc}") from exc
        except RedisError as exc:
            raise StoreError(f"redis {what} failed: {exc}") from exc

    # ---- producer side ----

    async def publish(self, trajectory: Trajectory) -> bool:
        n, lo, hi = entry_facts(trajectory)
        tid = trajectory.trajectory_id
        data = trajectory_codec.encode(trajectory)
        async with self._io("publish"):
            res = await self._publish(
                keys=[f"{self.prefix}:id:{tid}", self._k_stream, self._k_counters,
                      self._k_groups, self._k_acked, self._k_facts],
                args=[int(self.config.dedup_seconds * 1000), self.config.max_backlog, tid, data,
                      n, lo, hi, version_tokens(trajectory)])
        if res == -1:
            raise backlog_full(self.config.max_backlog)
        return res == 1

    async def lookup(self, trajectory_ids: list[str]) -> dict[str, bytes | None]:
        if not trajectory_ids:
            return {}
        out: dict[str, bytes | None] = {}
        async with self._io("lookup"):
            marks = await self._r.mget([f"{self.prefix}:id:{t}" for t in trajectory_ids])
            want = []
            pipe = self._r.pipeline(transaction=False)
            for tid, mark in zip(trajectory_ids, marks):
                if mark is None:
                    continue
                out[tid] = None
                if mark != b"1":  # "1": a marker written before markers held the entry id
                    want.append(tid)
                    pipe.xrange(self._k_stream, mark, mark, count=1)
            if want:
                for tid, res in zip(want, await pipe.execute()):
                    if res and res[0][1]:
                        out[tid] = res[0][1][b"d"]
        return out

    async def _backlogs(self) -> dict[str, int]:
        async with self._io("backlog"):
            pipe = self._r.pipeline(transaction=True)
            pipe.hgetall(self._k_groups).hgetall(self._k_acked).hget(self._k_counters, "published")
            pipe.xlen(self._k_stream)
            groups, acked, published, xlen = await pipe.execute()
        published = int(published or 0)
        if not groups:
            return {"": int(xlen)}
        return {g.decode(): published - int(base) - int(acked.get(g, 0))
                for g, base in groups.items()}

    async def backlog(self) -> int:
        return max((await self._backlogs()).values())

    async def stats(self) -> StoreStats:
        async with self._io("stats"):
            c = {k.decode(): int(v) for k, v in (await self._r.hgetall(self._k_counters)).items()}
        return StoreStats.of(c, await self.backlog(), self.config.max_backlog)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._r.aclose()
            self._pool.shutdown(wait=False)
            if self._bulk is not None:
                self._bulk.close()

    # ---- learner side ----

    async def create_group(self, group: str, *, from_latest: bool = False) -> bool:
        check_name("group", group)
        async with self._io("create_group"):
            res = await self._create(keys=[self._k_stream, self._k_groups, self._k_counters],
                                     args=[group, "$" if from_latest else "0"])
        return res == 1

    async def has_group(self, group: str) -> bool:
        check_name("group", group)
        async with self._io("has_group"):
            return bool(await self._r.hexists(self._k_groups, group))

    @staticmethod
    def _entry(eid: bytes, fields: dict[bytes, bytes], deliveries: int) -> StoredEntry:
        d = fields[b"d"]
        skipped = isinstance(d, Skipped)
        return StoredEntry(entry_id=eid.decode(), trajectory_id=fields[b"tid"].decode(),
                           data=b"" if skipped else d, nbytes=int(d) if skipped else -1,
                           num_tokens=int(fields[b"n"]),
                           min_version=int(fields[b"lo"]), max_version=int(fields[b"hi"]),
                           delivery_count=deliveries,
                           version_tokens=fields.get(b"vt", b"").decode())

    async def read(self, group: str, consumer: str, count: int, *,
                   block_ms: int = 0, payload: bool = True) -> list[StoredEntry]:
        check_name("group", group)
        check_name("consumer", consumer)
        if count <= 0:
            return []
        out: list[StoredEntry] = []
        lease_ms = int(self.config.lease_seconds * 1000)
        async with self._io("read"):
            cursor = self._claim_cursor.get(group, "0-0")
            nxt, claimed, *rest = await self._r.xautoclaim(self._k_stream, group, consumer,
                                                           lease_ms, cursor, count=count)
            self._claim_cursor[group] = nxt.decode() if isinstance(nxt, bytes) else str(nxt)
            if rest and rest[0]:  # deleted while pending: Redis dropped them from the group
                await self._lost(group, [_s(i) for i in rest[0]])
            claimed = [(eid, f) for eid, f in claimed if f]
            if claimed:
                ids = [eid for eid, _ in claimed]
                pend = await self._r.xpending_range(self._k_stream, group, min=ids[0],
                                                    max=ids[-1], count=len(ids) * 4 + 16,
                                                    consumername=consumer)
                counts = {p["message_id"]: int(p["times_delivered"]) for p in pend}
                out = [self._entry(eid, f, counts.get(eid, 2)) for eid, f in claimed]
            want = count - len(out)
            if want > 0:
                res = await self._read_new(group, consumer, want, payload)
                if not res and block_ms > 0 and not out:  # nothing ready: wait for new entries
                    res = await self._r.xreadgroup(group, consumer, {self._k_stream: ">"},
                                                   count=want, block=block_ms)
                for _stream, entries in res or []:
                    out.extend(self._entry(eid, f, 1) for eid, f in entries if f)
        return out

    def reference_key(self) -> str:
        return self._k_stream

    async def _lost(self, group: str, ids: list[str]) -> None:
        """Entries deleted from the stream (XDEL, a trim by hand) while leased: Redis has
        removed them from the group's pending list; count them as acknowledged so the
        group's backlog stays exact, and say so."""
        await self._r.hincrby(self._k_acked, group, len(ids))
        log.error("group %s: %d leased entries were deleted from the stream before they "
                  "were acknowledged (counted as acked): %s", group, len(ids), ", ".join(ids))

    async def _read_new(self, group: str, consumer: str, count: int, payload: bool = True):
        """XREADGROUP > without BLOCK, on the bulk thread pool."""
        if self._bulk is None:
            return await self._r.xreadgroup(group, consumer, {self._k_stream: ">"}, count=count)
        if payload:
            fut = asyncio.get_running_loop().run_in_executor(
                self._pool, self._bulk.xreadgroup, group, consumer, {self._k_stream: ">"},
                count)
        else:
            fut = asyncio.get_running_loop().run_in_executor(
                self._pool, self._xreadgroup_sizes, group, consumer, count)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            # the read goes on in its thread; whatever it leases must not wait out a lease
            fut.add_done_callback(lambda f: self._release_abandoned(f, group))
            raise

    def _xreadgroup_sizes(self, group: str, consumer: str, count: int):
        """XREADGROUP > COUNT n on the blocking client, payloads skipped (their sizes kept,
        ``Skipped``); the reply shaped like redis-py's."""
        pool = self._bulk.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_command("XREADGROUP", "GROUP", group, consumer, "COUNT", count,
                              "STREAMS", self._k_stream, ">")
            res = Replies(conn._sock).read()
        except RespError as exc:  # in sync: the connection stays usable
            pool.release(conn)
            raise ResponseError(str(exc)) from None
        except BaseException:
            conn.disconnect()
            pool.release(conn)
            raise
        pool.release(conn)
        streams = res.items() if isinstance(res, dict) else res or []  # RESP3: a map
        return [(stream, [(eid, dict(zip(f[::2], f[1::2])) if isinstance(f, list) else f)
                          for eid, f in entries]) for stream, entries in streams]

    def _release_abandoned(self, fut: Future, group: str) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        ids = [eid for _stream, entries in fut.result() or [] for eid, _f in entries]
        if ids and not self._closed:
            self._pool.submit(self._release_sync, group, ids)

    def _release_sync(self, group: str, ids: list[bytes]) -> None:
        """Like nack(delivered=False) for fresh reads: idle past the lease, count 0."""
        try:
            self._bulk.xclaim(self._k_stream, group, "__nacked__", 0, ids,
                              idle=int(self.config.lease_seconds * 1000) + 1, retrycount=0,
                              justid=True)
            self._claim_cursor[group] = "0-0"
        except RedisError as exc:  # the lease still expires
            log.warning("could not release %d abandoned reads: %s", len(ids), exc)

    async def ack(self, group: str, entry_ids: list[str]) -> int:
        check_name("group", group)
        for e in entry_ids:
            _parse_id(e)
        if not await self.has_group(group):
            raise NotFound(f"consumer group {group!r} does not exist; create it first")
        n = 0
        async with self._io("ack"):
            for i in range(0, len(entry_ids), _CHUNK):
                n += int(await self._ack(keys=[self._k_stream, self._k_acked],
                                         args=[group, *entry_ids[i:i + _CHUNK]]))
        await self._maybe_trim()
        return n

    async def extend(self, group: str, consumer: str, entry_ids: list[str]) -> list[str]:
        """XCLAIM to the same consumer with JUSTID resets the idle time (the lease) and
        leaves the delivery count alone; only entries still pending on ``consumer``."""
        check_name("group", group)
        check_name("consumer", consumer)
        for e in entry_ids:
            _parse_id(e)
        if not await self.has_group(group):
            raise NotFound(f"consumer group {group!r} does not exist; create it first")
        out: list[str] = []
        async with self._io("extend"):
            for i in range(0, len(entry_ids), _CHUNK):
                got = await self._extend(keys=[self._k_stream],
                                         args=[group, consumer, *entry_ids[i:i + _CHUNK]])
                out += [g.decode() if isinstance(g, bytes) else str(g) for g in got]
        return out

    async def nack(self, group: str, entry_ids: list[str], *,
                   delivered: bool = True) -> tuple[int, int]:
        check_name("group", group)
        if not await self.has_group(group):
            raise NotFound(f"consumer group {group!r} does not exist; create it first")
        requeue, dead = [], []
        async with self._io("nack"):
            for eid in entry_ids:
                _parse_id(eid)
                p = await self._r.xpending_range(self._k_stream, group, min=eid, max=eid, count=1)
                if not p:
                    continue
                times = int(p[0]["times_delivered"])
                if not delivered:
                    requeue.append((eid, max(times - 1, 0)))
                else:
                    (dead if times >= self.config.max_deliveries else requeue).append((eid, times))
            lost = []
            for eid, times in requeue:
                if not await self._r.xclaim(self._k_stream, group, "__nacked__", 0, [eid],
                                            idle=int(self.config.lease_seconds * 1000) + 1,
                                            retrycount=times, justid=True):
                    lost.append(eid)  # deleted from the stream: Redis dropped it
            if lost:
                await self._lost(group, lost)
                requeue = [(e, t) for e, t in requeue if e not in lost]
            if dead:
                await self._ack(keys=[self._k_stream, self._k_acked],
                                args=[group, *[e for e, _ in dead]])
                await self._r.hincrby(self._k_counters, "dead_lettered", len(dead))
        if requeue:
            self._claim_cursor[group] = "0-0"
        return len(requeue), len(dead)

    async def group_backlog(self, group: str) -> int:
        check_name("group", group)
        b = await self._backlogs()
        if group not in b:
            raise NotFound(f"consumer group {group!r} does not exist; create it first")
        return b[group]

    async def group_stats(self) -> list[GroupStats]:
        backlogs = await self._backlogs()
        async with self._io("group_stats"):
            counters = await self._r.hgetall(self._k_counters)
            infos = await self._r.xinfo_groups(self._k_stream) if backlogs.get("") is None \
                else []
        pending = {_s(g["name"]): int(g["pending"]) for g in infos}
        return [GroupStats(group=g, backlog=b, pending=pending.get(g, 0),
                           redelivered=int(counters.get(f"redelivered:{g}".encode(), 0)))
                for g, b in sorted(backlogs.items()) if g]

    async def unconsumed_tokens(self, limit: int = 10_000) -> UnconsumedTokens:
        """Entries after a group's last delivered id, or pending in a group (every entry
        when there is no group), read from the facts stream (never the payloads)."""
        async with self._io("unconsumed"):
            infos = await self._r.xinfo_groups(self._k_stream) \
                if await self._r.exists(self._k_stream) else []
            groups = []  # (last delivered id, pending ids)
            start = "-"
            for g in infos:
                last = _parse_id(_s(g["last-delivered-id"]))
                ids: set[tuple[int, int]] = set()
                if int(g["pending"]):
                    pend = await self._r.xpending_range(self._k_stream, g["name"], min="-",
                                                        max="+", count=limit)
                    ids = {_parse_id(_s(p["message_id"])) for p in pend}
                groups.append((last, ids))
            if groups:
                low = min(min(ids, default=(last[0], last[1] + 1)) for last, ids in groups)
                start = f"{low[0]}-{low[1]}"
            facts = await self._r.xrange(self._k_facts, min=start, max="+", count=limit + 1)

        def unconsumed():
            for fid, f in facts:
                eid = _parse_id(_s(fid))
                if not groups or any(eid > last or eid in ids for last, ids in groups):
                    yield _s(f.get(b"vt", b"")), int(f[b"lo"]), int(f[b"n"])

        return count_unconsumed(unconsumed(), limit)

    async def take_recycled(self, max_n: int) -> list[Trajectory]:
        async with self._io("take_recycled"):
            got = await self._r.lpop(self._k_recycled, max_n) if max_n > 0 else None
        return [trajectory_codec.decode(d) for d in got or []]

    async def _push_recycled(self, entries: list[StoredEntry]) -> None:
        async with self._io("recycle"):
            data = [e.data for e in entries]
            unread = [i for i, e in enumerate(entries) if e.nbytes >= 0]
            if unread:  # read without the payload (a by-reference stream): read it now
                pipe = self._r.pipeline(transaction=False)
                for i in unread:
                    pipe.xrange(self._k_stream, entries[i].entry_id, entries[i].entry_id,
                                count=1)
                for i, res in zip(unread, await pipe.execute()):
                    data[i] = res[0][1][b"d"] if res and res[0][1] else b""
            data = [d for d in data if d]  # an entry deleted meanwhile left no prompt
            if data:
                await self._r.rpush(self._k_recycled, *data)

    async def _count(self, **counters: int) -> None:
        async with self._io("count"):
            pipe = self._r.pipeline(transaction=False)
            for k, v in counters.items():
                pipe.hincrby(self._k_counters, k, v)
            await pipe.execute()

    async def _maybe_trim(self) -> None:
        """XTRIM MINID below the oldest entry some group still needs and the retention
        horizon (at most once a second per store object)."""
        now = time.time()
        if now - self._last_trim < 1.0:
            return
        self._last_trim = now
        async with self._io("trim"):
            groups = await self._r.xinfo_groups(self._k_stream)
            if not groups:
                return
            low = (int((now - self.config.retention_seconds) * 1000), 0)
            for g in groups:
                ms, seq = _parse_id(g["last-delivered-id"].decode())
                keep = (ms, seq + 1)
                if int(g["pending"]):
                    summary = await self._r.xpending(self._k_stream, g["name"])
                    keep = min(keep, _parse_id(summary["min"].decode()))
                low = min(low, keep)
            if low[0] > 0:
                await self._r.xtrim(self._k_stream, minid=f"{low[0]}-{low[1]}", approximate=False)
                await self._r.xtrim(self._k_facts, minid=f"{low[0]}-{low[1]}", approximate=False)
