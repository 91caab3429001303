"""Redis Streams trajectory store (the production default; shared by gateway replicas).

Keys (named by ``rollout_gateway.store.keys``, per shard): ``stream`` (entries: tid, d =
serialized rollout.v1.Trajectory, n = prompt+output tokens, lo/hi = min/max
policy_version), ``id:<tid>`` (idempotency marker holding the entry id, TTL dedup_seconds),
``groups`` (group -> offset for backlog accounting), ``acked`` (group -> acked count),
``counters``, ``facts`` (a stream with the entries' ids and n, lo, vt = output tokens per
version: dashboards scan it without the payloads; trimmed with the stream); and
``recycled`` (a list, in the prefix's home slot).
Consumer groups are Redis consumer groups: XREADGROUP for new entries, XAUTOCLAIM for
entries whose lease (idle time) expired, XACK on ack. A nack re-marks the entry as idle
past the lease so the next read re-claims it at once. Publish, group creation and ack are
Lua scripts so the backlog bound and counters stay exact across replicas.

Shards (``shards`` > 1, and Redis Cluster): a trajectory goes to the shard its id hashes to
(``KeyLayout.shard_of``); every key a script touches is that shard's, so each script stays
in one cluster slot, and shards on different masters publish and read in parallel. A
consumer group exists on every shard; a read leases from the shards in turn (expired
leases first, then new entries), and an entry id names its shard (``<shard>/<ms>-<seq>``).
A group's bound is ``max_backlog`` split evenly over the shards.
On a Redis Cluster (``redis+cluster://``) the client follows the slot map (MOVED, a
failover) and retries a command across a failover (``redis_client.CLUSTER_RETRIES``).

Bulk reads of new entries (XREADGROUP without BLOCK) run on a small thread pool with a
blocking redis-py client: its reply parsing (hiredis, recv_into a reused buffer) costs
about half the CPU of the asyncio connection for multi-MB replies, and the socket wait
runs without the GIL. For by-reference Pull streams (``payload=False``) the same read
skips the payloads as they arrive (``rollout_proto.resp``: only their sizes are kept);
XREADGROUP cannot lease an entry without sending it. Only when nothing is ready does a read
wait with BLOCK, on the asyncio connection (several shards: all at once, in slices of
:data:`_BLOCK_SLICE_MS`). A read abandoned by cancellation releases what it leased at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager

import redis
import redis.asyncio as aioredis
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import (
    AskError,
    MovedError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.retry import Retry as SyncRetry

from rollout_gateway.core import trajectory_codec
from rollout_gateway.core.trajectory import Trajectory
from rollout_gateway.errors import NotFound, StoreError
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
    entry_numbers,
    version_tokens,
)
from rollout_gateway.store.keys import KeyLayout
from rollout_gateway.store.redis_client import (
    blocking_client,
    cluster_client,
    is_cluster,
    LazySyncCluster,
    redis_failures,
    through_failover,
)
from rollout_proto.resp import Replies, RespError, Skipped

_PUBLISH = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HINCRBY', KEYS[3], 'duplicates', 1)
  return 0
end
local published = tonumber(redis.call('HGET', KEYS[3], 'published') or '0')
local groups = redis.call('HGETALL', KEYS[4])
local bound = tonumber(ARGV[2])
if #groups == 0 then
  if redis.call('XLEN', KEYS[2]) >= bound then return -1 end
else
  for i = 1, #groups, 2 do
    local g = groups[i]
    local b = published - tonumber(groups[i + 1]) - tonumber(redis.call('HGET', KEYS[5], g) or '0')
    if b >= bound then
      -- a full group loses its oldest entry (oldest pending, else the next undelivered)
      local p = redis.call('XPENDING', KEYS[2], g, '-', '+', 1)
      if #p > 0 then
        redis.call('XACK', KEYS[2], g, p[1][1])
      else
        local last = nil
        for _, info in ipairs(redis.call('XINFO', 'GROUPS', KEYS[2])) do
          local f = {}
          for j = 1, #info, 2 do f[info[j]] = info[j + 1] end
          if f['name'] == g then last = f['last-delivered-id'] end
        end
        if last then
          local nxt = redis.call('XRANGE', KEYS[2], '(' .. last, '+', 'COUNT', 1)
          if #nxt > 0 then redis.call('XGROUP', 'SETID', KEYS[2], g, nxt[1][1]) end
        end
      end
      redis.call('HINCRBY', KEYS[4], g, 1)
      redis.call('HINCRBY', KEYS[3], 'overflow_dropped', 1)
      redis.call('HINCRBY', KEYS[3], 'overflow_dropped:' .. g, 1)
    end
  end
end
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

#: one shard's groups, acked counts, published count and length, read at one instant (a
#: script, not MULTI: redis-py's asyncio cluster client runs a MULTI's commands one by one
#: on a thread of its own, blocking the event loop)
_BACKLOG_FACTS = """
return {redis.call('HGETALL', KEYS[1]), redis.call('HGETALL', KEYS[2]),
        redis.call('HGET', KEYS[3], 'published'), redis.call('XLEN', KEYS[4])}
"""

_CHUNK = 1000
#: how long a master whose replicas did not acknowledge a publish in time is not waited for
_ALONE_S = 5.0
_BULK_THREADS = 4  # concurrent bulk reads (one per Pull stream in flight)
#: several shards: a read with nothing ready waits on every shard at once, BLOCK this long
#: at a time (all replies in before the next slice: nothing leased is left unread)
_BLOCK_SLICE_MS = 50

log = logging.getLogger(__name__)


def _parse_id(eid: str) -> tuple[int, int]:
    ms, seq = entry_numbers(eid, dashed=True)
    return ms, seq


def _pairs(flat: list) -> dict:
    """A flat [k1, v1, k2, v2, ...] (HGETALL inside a script) as a dict."""
    return dict(zip(flat[::2], flat[1::2]))


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


@dataclass(slots=True, frozen=True)
class _Shard:
    """One trajectory shard's keys (all in one cluster slot)."""

    index: int
    layout: KeyLayout
    stream: str
    groups: str
    acked: str
    counters: str
    facts: str

    @classmethod
    def of(cls, layout: KeyLayout, k: int) -> _Shard:
        return cls(k, layout, *(layout.shard_key(k, n)
                                for n in ("stream", "groups", "acked", "counters", "facts")))

    def id_key(self, tid: str) -> str:
        return self.layout.shard_key(self.index, f"id:{tid}")


class RedisStore(TrajectoryStore):
    """``url``: ``redis://``, ``rediss://``, ``unix://`` (one Redis) or ``redis+cluster://``
    / ``rediss+cluster://`` (a Redis Cluster; any node as a seed). ``shards``: trajectory
    streams (see the module docstring); one keeps single-node Redis' key names."""

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", prefix: str = "rollout",
                 config: StoreConfig | None = None, client: aioredis.Redis | None = None, *,
                 shards: int = 1, replica_acks: int = 0, replica_wait_ms: int = 100,
                 max_connections: int | None = None, pool_wait_s: float | None = None):
        self.config = config or StoreConfig()
        #: publish waits (WAIT, on the publishing connection) until this many replicas of
        #: the shard's master have the entry, up to replica_wait_ms; 0: it does not wait
        self.replica_acks, self.replica_wait_ms = replica_acks, replica_wait_ms
        #: master -> monotonic time until which it is known to lack the replicas (a WAIT
        #: timed out): publishes there do not wait, so a master left alone after a failover
        #: is not slowed by replica_wait_ms on every publish
        self._alone_until: dict[str, float] = {}
        self.prefix = prefix
        self.cluster = is_cluster(url)
        self.layout = KeyLayout(prefix, shards=shards, cluster=self.cluster)
        # a bounded pool that waits for a free connection (see redis_client); on a cluster,
        # a bounded pool per node
        if client is not None:
            self._r = client
        elif self.cluster:
            self._r = cluster_client(url, max_connections=max_connections)
        else:
            self._r = blocking_client(url, max_connections=max_connections,
                                      wait_s=pool_wait_s)
        self._shards = [_Shard.of(self.layout, k) for k in range(shards)]
        self._k_stream = self._shards[0].stream  # one shard: the stream (tests, tools)
        self._k_recycled = self.layout.key("recycled")
        self._publish = self._r.register_script(_PUBLISH)
        self._create = self._r.register_script(_CREATE_GROUP)
        self._ack = self._r.register_script(_ACK)
        self._extend = self._r.register_script(_EXTEND)
        self._backlog_facts = self._r.register_script(_BACKLOG_FACTS)
        self._claim_cursor: dict[tuple[str, int], str] = {}
        self._turn = itertools.count()  # which shard a read starts at
        self._last_trim = 0.0
        self._closed = False
        # blocking client for bulk reads (None when the caller supplied its own client)
        if client is not None:
            self._bulk = None
        elif self.cluster:
            self._bulk = LazySyncCluster(url)
        else:
            self._bulk = redis.Redis.from_url(
                url, decode_responses=False, socket_timeout=30.0, socket_connect_timeout=5.0,
                retry=SyncRetry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), 3))
        self._pool = ThreadPoolExecutor(_BULK_THREADS, thread_name_prefix="redis-bulk")

    @property
    def shards(self) -> int:
        return len(self._shards)

    # ---- entry ids: "<ms>-<seq>" with one shard, "<shard>/<ms>-<seq>" with several ----

    def _eid(self, shard: _Shard, raw: bytes | str) -> str:
        raw = _s(raw)
        return raw if len(self._shards) == 1 else f"{shard.index}/{raw}"

    def _split(self, eid: str) -> tuple[_Shard, str]:
        """The shard and stream id of an entry id (InvalidArgument when malformed)."""
        if len(self._shards) == 1:
            _parse_id(eid)
            return self._shards[0], eid
        head, sep, raw = eid.partition("/") if isinstance(eid, str) else ("", "", "")
        if not sep or not head.isascii() or not head.isdigit() \
                or int(head) >= len(self._shards):
            from rollout_gateway.errors import InvalidArgument

            shown = eid[:40] if isinstance(eid, str) else type(eid).__name__
            raise InvalidArgument(f"malformed entry id {shown!r} (expected <shard>/<ms>-<seq>"
                                  f" with shard < {len(self._shards)})")
        _parse_id(raw)
        return self._shards[int(head)], raw

    def _by_shard(self, entry_ids: list[str]) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for e in entry_ids:
            sh, raw = self._split(e)
            out.setdefault(sh.index, []).append(raw)
        return out

    @asynccontextmanager
    async def _io(self, what: str):
        if self._closed:
            raise StoreError("store is closed")
        async with redis_failures(f"redis {what} failed"):
            try:
                yield
            except ResponseError as exc:
                if "NOGROUP" in str(exc):
                    raise NotFound(f"consumer group does not exist ({what}); "
                                   "create it first") from None
                raise

    async def _idempotent(self, call):
        """A write that is safe to apply twice (publish: by trajectory id; ack): on a
        cluster, tried again through a failover (``redis_client.through_failover``)."""
        return await (through_failover(call) if self.cluster else call())

    # ---- producer side ----

    def _bound(self) -> int:
        """Each shard's share of ``max_backlog`` (rounded up)."""
        return -(-self.config.max_backlog // len(self._shards))

    async def publish(self, trajectory: Trajectory) -> bool:
        n, lo, hi = entry_facts(trajectory)
        tid = trajectory.trajectory_id
        data = trajectory_codec.encode(trajectory)
        sh = self._shards[self.layout.shard_of(tid)]
        keys = [sh.id_key(tid), sh.stream, sh.counters, sh.groups, sh.acked, sh.facts]
        args = [int(self.config.dedup_seconds * 1000), self._bound(), tid, data, n, lo, hi,
                version_tokens(trajectory)]
        async with self._io("publish"):
            if self.replica_acks:
                res = await self._idempotent(lambda: self._publish_replicated(sh, keys, args))
            else:
                res = await self._idempotent(lambda: self._publish(keys=keys, args=args))
        if res == -1:
            raise backlog_full(self.config.max_backlog)
        return res == 1

    async def _publish_replicated(self, sh: _Shard, keys: list, args: list):
        """The publish script, then ``WAIT replica_acks replica_wait_ms`` on the same
        connection (WAIT counts that connection's writes): the entry is on the replicas
        before the trajectory is acknowledged, so a master's death cannot lose it. Fewer
        replicas in time (none left after a failover): counted ``unreplicated``, logged, and
        accepted - the master no longer waits for a while."""
        for _try in range(3):
            if self.cluster:
                from redis.asyncio.cluster import PipelineCommand

                await self._r.initialize()
                node = self._r.get_node_from_key(sh.stream)
                wait = self._alone_until.get(node.name, 0.0) <= time.monotonic()
                cmds = [PipelineCommand(0, "EVALSHA", self._publish.sha, len(keys),
                                        *keys, *args)]
                if wait:
                    cmds.append(PipelineCommand(1, "WAIT", self.replica_acks,
                                                self.replica_wait_ms))
                try:
                    await node.execute_pipeline(cmds)
                except (redis.ConnectionError, redis.TimeoutError):
                    self._r._initialize = True  # read the slot map again, then try again
                    raise
                res = cmds[0].result
                acked = cmds[1].result if wait else None
                name = node.name
            else:
                name = ""
                wait = self._alone_until.get(name, 0.0) <= time.monotonic()
                pipe = self._r.pipeline(transaction=False)
                pipe.evalsha(self._publish.sha, len(keys), *keys, *args)
                if wait:
                    pipe.execute_command("WAIT", self.replica_acks, self.replica_wait_ms)
                got = await pipe.execute(raise_on_error=False)
                res, acked = got[0], (got[1] if wait else None)
            if isinstance(res, NoScriptError):  # first publish on this master
                if self.cluster:
                    await node.execute_command("SCRIPT", "LOAD", _PUBLISH)
                else:
                    await self._r.script_load(_PUBLISH)
                continue
            if isinstance(res, (MovedError, AskError)):  # a failover moved the slot
                self._r._initialize = True
                continue
            if isinstance(res, Exception):
                raise res
            if isinstance(acked, Exception):
                raise acked
            if acked is not None and int(acked) < self.replica_acks:
                self._alone_until[name] = time.monotonic() + _ALONE_S
                log.warning("publish: %d of %d replicas acknowledged within %d ms on %s; "
                            "not waiting there for %.0f s", int(acked), self.replica_acks,
                            self.replica_wait_ms, name or "the Redis", _ALONE_S)
                await self._count_on(sh, unreplicated=1)
            return res
        raise StoreError("redis publish failed: the shard's slot kept moving")

    async def _count_on(self, sh: _Shard, **counters: int) -> None:
        for k, v in counters.items():
            await self._r.hincrby(sh.counters, k, v)

    async def lookup(self, trajectory_ids: list[str]) -> dict[str, bytes | None]:
        if not trajectory_ids:
            return {}
        out: dict[str, bytes | None] = {}
        shards = [self._shards[self.layout.shard_of(t)] for t in trajectory_ids]
        async with self._io("lookup"):
            pipe = self._r.pipeline(transaction=False)
            for tid, sh in zip(trajectory_ids, shards):
                pipe.get(sh.id_key(tid))
            marks = await pipe.execute()
            want = []
            pipe = self._r.pipeline(transaction=False)
            for tid, sh, mark in zip(trajectory_ids, shards, marks):
                if mark is None:
                    continue
                out[tid] = None
                if mark != b"1":  # "1": a marker written before markers held the entry id
                    want.append(tid)
                    pipe.xrange(sh.stream, mark, mark, count=1)
            if want:
                for tid, res in zip(want, await pipe.execute()):
                    if res and res[0][1]:
                        out[tid] = res[0][1][b"d"]
        return out

    async def _shard_backlogs(self, sh: _Shard) -> tuple[dict[str, int], int]:
        """(group -> backlog, stored entries) of one shard."""
        groups, acked, published, xlen = await self._backlog_facts(
            keys=[sh.groups, sh.acked, sh.counters, sh.stream])
        groups, acked = _pairs(groups), _pairs(acked)
        published = int(published or 0)
        return ({g.decode(): published - int(base) - int(acked.get(g, 0))
                 for g, base in groups.items()}, int(xlen))

    async def _backlogs(self) -> dict[str, int]:
        async with self._io("backlog"):
            per = await asyncio.gather(*(self._shard_backlogs(sh) for sh in self._shards))
        out: dict[str, int] = {}
        for groups, _ in per:
            for g, b in groups.items():
                out[g] = out.get(g, 0) + b
        if not out:
            return {"": sum(x for _, x in per)}
        return out

    async def backlog(self) -> int:
        return min((await self._backlogs()).values())

    async def _counters(self) -> dict[str, int]:
        """Every shard's counters, summed."""
        pipe = self._r.pipeline(transaction=False)
        for sh in self._shards:
            pipe.hgetall(sh.counters)
        c: dict[str, int] = {}
        for h in await pipe.execute():
            for k, v in h.items():
                c[k.decode()] = c.get(k.decode(), 0) + int(v)
        return c

    async def stats(self) -> StoreStats:
        async with self._io("stats"):
            c = await self._counters()
        # dashboards: the worst group's backlog (admission reads backlog(): the best's)
        return StoreStats.of(c, max((await self._backlogs()).values()), self.config.max_backlog)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._r.aclose()
            self._pool.shutdown(wait=False)
            if self._bulk is not None:
                self._bulk.close()

    # ---- learner side ----

    async def create_group(self, group: str, *, from_latest: bool = False) -> bool:
        """On every shard, the first shard last: a group the first shard has exists on all
        (``has_group`` reads the first shard); creating it again completes a creation that
        failed half-way."""
        check_name("group", group)
        created = False
        async with self._io("create_group"):
            for sh in reversed(self._shards):
                res = await self._create(keys=[sh.stream, sh.groups, sh.counters],
                                         args=[group, "$" if from_latest else "0"])
                created = created or res == 1
        return created

    async def has_group(self, group: str) -> bool:
        check_name("group", group)
        async with self._io("has_group"):
            return bool(await self._r.hexists(self._shards[0].groups, group))

    def _entry(self, sh: _Shard, eid: bytes, fields: dict[bytes, bytes],
               deliveries: int) -> StoredEntry:
        d = fields[b"d"]
        skipped = isinstance(d, Skipped)
        return StoredEntry(entry_id=self._eid(sh, eid), trajectory_id=fields[b"tid"].decode(),
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
        n = len(self._shards)
        start = next(self._turn) % n
        order = self._shards[start:] + self._shards[:start]
        async with self._io("read"):
            for sh in order:  # expired leases (and nacked entries) first, shard by shard
                if len(out) < count:
                    out += await self._claim(sh, group, consumer, count - len(out))
            for sh in order:  # then new entries
                if len(out) < count:
                    res = await self._read_new(group, consumer, count - len(out), payload,
                                               shard=sh.index)
                    out += self._new_entries(sh, res)
            if not out and block_ms > 0:  # nothing ready: wait for new entries
                out = await self._wait_new(group, consumer, count, block_ms)
        return out

    def _new_entries(self, sh: _Shard, res) -> list[StoredEntry]:
        return [self._entry(sh, eid, f, 1) for _stream, entries in res or []
                for eid, f in entries if f]

    async def _claim(self, sh: _Shard, group: str, consumer: str,
                     count: int) -> list[StoredEntry]:
        lease_ms = int(self.config.lease_seconds * 1000)
        cursor = self._claim_cursor.get((group, sh.index), "0-0")
        nxt, claimed, *rest = await self._r.xautoclaim(sh.stream, group, consumer,
                                                       lease_ms, cursor, count=count)
        self._claim_cursor[(group, sh.index)] = _s(nxt) if isinstance(nxt, bytes) else str(nxt)
        if rest and rest[0]:  # deleted while pending: Redis dropped them from the group
            await self._lost(sh, group, [_s(i) for i in rest[0]])
        claimed = [(eid, f) for eid, f in claimed if f]
        if not claimed:
            return []
        ids = [eid for eid, _ in claimed]
        pend = await self._r.xpending_range(sh.stream, group, min=ids[0],
                                            max=ids[-1], count=len(ids) * 4 + 16,
                                            consumername=consumer)
        counts = {p["message_id"]: int(p["times_delivered"]) for p in pend}
        return [self._entry(sh, eid, f, counts.get(eid, 2)) for eid, f in claimed]

    async def _wait_new(self, group: str, consumer: str, count: int,
                        block_ms: int) -> list[StoredEntry]:
        """XREADGROUP BLOCK: on the one stream; with several shards, on all of them at once
        in slices of _BLOCK_SLICE_MS, every reply read before the next slice (a lease is
        never dropped with a cancelled reply)."""
        if len(self._shards) == 1:
            sh = self._shards[0]
            res = await self._r.xreadgroup(group, consumer, {sh.stream: ">"}, count=count,
                                           block=block_ms)
            return self._new_entries(sh, res)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + block_ms / 1000
        while True:
            left = int((deadline - loop.time()) * 1000)
            if left <= 0:
                return []
            wait = max(1, min(_BLOCK_SLICE_MS, left))
            got = await asyncio.gather(*(
                self._r.xreadgroup(group, consumer, {sh.stream: ">"}, count=count, block=wait)
                for sh in self._shards))
            out = [e for sh, res in zip(self._shards, got) for e in self._new_entries(sh, res)]
            if out:
                return out

    def reference_key(self, entry_id: str | None = None) -> str:
        if entry_id is None:
            return self._shards[0].stream
        return self._split(entry_id)[0].stream

    async def _lost(self, sh: _Shard, group: str, ids: list[str]) -> None:
        """Entries deleted from the stream (XDEL, a trim by hand) while leased: Redis has
        removed them from the group's pending list; count them as acknowledged so the
        group's backlog stays exact, and say so."""
        await self._r.hincrby(sh.acked, group, len(ids))
        log.error("group %s: %d leased entries were deleted from the stream before they "
                  "were acknowledged (counted as acked): %s", group, len(ids), ", ".join(ids))

    async def _read_new(self, group: str, consumer: str, count: int, payload: bool = True,
                        *, shard: int = 0):
        """XREADGROUP > without BLOCK on one shard, on the bulk thread pool."""
        sh = self._shards[shard]
        if self._bulk is None:
            return await self._r.xreadgroup(group, consumer, {sh.stream: ">"}, count=count)
        if payload:
            fut = asyncio.get_running_loop().run_in_executor(
                self._pool, self._bulk_call, self._bulk_xreadgroup, sh, group, consumer,
                count)
        else:
            fut = asyncio.get_running_loop().run_in_executor(
                self._pool, self._bulk_call, self._xreadgroup_sizes, sh, group, consumer,
                count)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            # the read goes on in its thread; whatever it leases must not wait out a lease
            fut.add_done_callback(lambda f: self._release_abandoned(f, sh, group))
            raise

    def _bulk_xreadgroup(self, sh: _Shard, group: str, consumer: str, count: int):
        return self._bulk.xreadgroup(group, consumer, {sh.stream: ">"}, count)

    def _bulk_call(self, fn, *args):
        """A call on the blocking client; on a cluster, a node lost or a slot moved makes it
        read the slot map again (it would keep asking the dead master) and try once more."""
        if not self.cluster:
            return fn(*args)
        try:
            return fn(*args)
        except (redis.ConnectionError, redis.TimeoutError, ResponseError) as exc:
            # MOVED / CLUSTERDOWN / TRYAGAIN come as ResponseError subclasses
            if isinstance(exc, ResponseError) and "NOGROUP" in str(exc):
                raise
            try:
                self._bulk.nodes_manager.initialize()
            except (RedisError, RedisClusterException) as exc:
                log.warning("could not read the cluster's slot map: %s", exc)
            return fn(*args)

    def _bulk_pool(self, sh: _Shard):
        """The blocking client's connection pool that serves ``sh`` (a cluster: the pool of
        the master of the shard's slot)."""
        if not self.cluster:
            return self._bulk.connection_pool
        node = self._bulk.get_node_from_key(sh.stream)
        if node.redis_connection is None:
            self._bulk.nodes_manager.initialize()
            node = self._bulk.get_node_from_key(sh.stream)
        return node.redis_connection.connection_pool

    def _xreadgroup_sizes(self, sh: _Shard, group: str, consumer: str, count: int):
        """XREADGROUP > COUNT n on the blocking client, payloads skipped (their sizes kept,
        ``Skipped``); the reply shaped like redis-py's."""
        pool = self._bulk_pool(sh)
        conn = pool.get_connection()
        try:
            conn.send_command("XREADGROUP", "GROUP", group, consumer, "COUNT", count,
                              "STREAMS", sh.stream, ">")
            res = Replies(conn._sock).read()
        except RespError as exc:  # in sync: the connection stays usable
            pool.release(conn)
            if self.cluster and str(exc).startswith(("MOVED", "CLUSTERDOWN")):
                self._bulk.nodes_manager.initialize()  # a failover: the next read goes right
            raise ResponseError(str(exc)) from None
        except BaseException:
            conn.disconnect()
            pool.release(conn)
            if self.cluster:
                self._bulk.nodes_manager.initialize()
            raise
        pool.release(conn)
        streams = res.items() if isinstance(res, dict) else res or []  # RESP3: a map
        return [(stream, [(eid, dict(zip(f[::2], f[1::2])) if isinstance(f, list) else f)
                          for eid, f in entries]) for stream, entries in streams]

    def _release_abandoned(self, fut: Future, sh: _Shard, group: str) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        ids = [eid for _stream, entries in fut.result() or [] for eid, _f in entries]
        if ids and not self._closed:
            self._pool.submit(self._release_sync, sh, group, ids)

    def _release_sync(self, sh: _Shard, group: str, ids: list[bytes]) -> None:
        """Like nack(delivered=False) for fresh reads: idle past the lease, count 0."""
        try:
            self._bulk.xclaim(sh.stream, group, "__nacked__", 0, ids,
                              idle=int(self.config.lease_seconds * 1000) + 1, retrycount=0,
                              justid=True)
            self._claim_cursor[(group, sh.index)] = "0-0"
        except (RedisError, RedisClusterException) as exc:  # the lease still expires
            log.warning("could not release %d abandoned reads: %s", len(ids), exc)

    async def _require_group(self, group: str) -> None:
        if not await self.has_group(group):
            raise NotFound(f"consumer group {group!r} does not exist; create it first")

    async def ack(self, group: str, entry_ids: list[str]) -> int:
        check_name("group", group)
        by_shard = self._by_shard(entry_ids)
        await self._require_group(group)
        n = 0
        async with self._io("ack"):
            for k, ids in by_shard.items():
                sh = self._shards[k]
                for i in range(0, len(ids), _CHUNK):
                    chunk = ids[i:i + _CHUNK]
                    n += int(await self._idempotent(lambda: self._ack(
                        keys=[sh.stream, sh.acked], args=[group, *chunk])))
        await self._maybe_trim()
        return n

    async def extend(self, group: str, consumer: str, entry_ids: list[str]) -> list[str]:
        """XCLAIM to the same consumer with JUSTID resets the idle time (the lease) and
        leaves the delivery count alone; only entries still pending on ``consumer``."""
        check_name("group", group)
        check_name("consumer", consumer)
        by_shard = self._by_shard(entry_ids)
        await self._require_group(group)
        out: list[str] = []
        async with self._io("extend"):
            for k, ids in by_shard.items():
                sh = self._shards[k]
                for i in range(0, len(ids), _CHUNK):
                    got = await self._extend(keys=[sh.stream],
                                             args=[group, consumer, *ids[i:i + _CHUNK]])
                    out += [self._eid(sh, g if isinstance(g, bytes) else str(g)) for g in got]
        return out

    async def nack(self, group: str, entry_ids: list[str], *,
                   delivered: bool = True) -> tuple[int, int]:
        check_name("group", group)
        await self._require_group(group)
        parsed = [self._split(e) for e in entry_ids]
        requeued = dead_total = 0
        async with self._io("nack"):
            for sh in self._shards:
                ids = [raw for s, raw in parsed if s is sh]
                if ids:
                    r, d = await self._nack_shard(sh, group, ids, delivered)
                    requeued, dead_total = requeued + r, dead_total + d
        return requeued, dead_total

    async def _nack_shard(self, sh: _Shard, group: str, ids: list[str],
                          delivered: bool) -> tuple[int, int]:
        requeue, dead = [], []
        for eid in ids:
            p = await self._r.xpending_range(sh.stream, group, min=eid, max=eid, count=1)
            if not p:
                continue
            times = int(p[0]["times_delivered"])
            if not delivered:
                requeue.append((eid, max(times - 1, 0)))
            else:
                (dead if times >= self.config.max_deliveries else requeue).append((eid, times))
        lost = []
        for eid, times in requeue:
            if not await self._r.xclaim(sh.stream, group, "__nacked__", 0, [eid],
                                        idle=int(self.config.lease_seconds * 1000) + 1,
                                        retrycount=times, justid=True):
                lost.append(eid)  # deleted from the stream: Redis dropped it
        if lost:
            await self._lost(sh, group, lost)
            requeue = [(e, t) for e, t in requeue if e not in lost]
        if dead:
            await self._ack(keys=[sh.stream, sh.acked], args=[group, *[e for e, _ in dead]])
            await self._r.hincrby(sh.counters, "dead_lettered", len(dead))
        if requeue:
            self._claim_cursor[(group, sh.index)] = "0-0"
        return len(requeue), len(dead)

    async def group_backlog(self, group: str) -> int:
        check_name("group", group)
        b = await self._backlogs()
        if group not in b:
            raise NotFound(f"consumer group {group!r} does not exist; create it first")
        return b[group]

    async def group_stats(self) -> list[GroupStats]:
        backlogs = await self._backlogs()
        pending: dict[str, int] = {}
        async with self._io("group_stats"):
            counters = await self._counters()
            if backlogs.get("") is None:
                for sh in self._shards:
                    for g in await self._r.xinfo_groups(sh.stream):
                        name = _s(g["name"])
                        pending[name] = pending.get(name, 0) + int(g["pending"])
        return [GroupStats(group=g, backlog=b, pending=pending.get(g, 0),
                           redelivered=counters.get(f"redelivered:{g}", 0),
                           overflow_dropped=counters.get(f"overflow_dropped:{g}", 0))
                for g, b in sorted(backlogs.items()) if g]

    async def unconsumed_tokens(self, limit: int = 10_000) -> UnconsumedTokens:
        """Entries after a group's last delivered id, or pending in a group (every entry
        when there is no group), read from the facts streams (never the payloads); with
        several shards, up to ``limit`` over all of them, shard by shard."""
        facts_all: list[tuple[str, int, int]] = []
        truncated = False
        async with self._io("unconsumed"):
            for sh in self._shards:
                got = await self._unconsumed_shard(sh, limit - len(facts_all) + 1)
                facts_all += got
                if len(facts_all) > limit:
                    truncated = True
                    break
        res = count_unconsumed(iter(facts_all), limit)
        if truncated:
            res.truncated = True
        return res

    async def _unconsumed_shard(self, sh: _Shard, limit: int) -> list[tuple[str, int, int]]:
        infos = await self._r.xinfo_groups(sh.stream) if await self._r.exists(sh.stream) else []
        groups = []  # (last delivered id, pending ids)
        start = "-"
        for g in infos:
            last = _parse_id(_s(g["last-delivered-id"]))
            ids: set[tuple[int, int]] = set()
            if int(g["pending"]):
                pend = await self._r.xpending_range(sh.stream, g["name"], min="-",
                                                    max="+", count=limit)
                ids = {_parse_id(_s(p["message_id"])) for p in pend}
            groups.append((last, ids))
        if groups:
            low = min(min(ids, default=(last[0], last[1] + 1)) for last, ids in groups)
            start = f"{low[0]}-{low[1]}"
        facts = await self._r.xrange(sh.facts, min=start, max="+", count=limit)
        out = []
        for fid, f in facts:
            eid = _parse_id(_s(fid))
            if not groups or any(eid > last or eid in ids for last, ids in groups):
                out.append((_s(f.get(b"vt", b"")), int(f[b"lo"]), int(f[b"n"])))
        return out

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
                    sh, raw = self._split(entries[i].entry_id)
                    pipe.xrange(sh.stream, raw, raw, count=1)
                for i, res in zip(unread, await pipe.execute()):
                    data[i] = res[0][1][b"d"] if res and res[0][1] else b""
            data = [d for d in data if d]  # an entry deleted meanwhile left no prompt
            if data:
                await self._r.rpush(self._k_recycled, *data)

    async def _count(self, **counters: int) -> None:
        """Into the first shard's counters (stats sums every shard's)."""
        async with self._io("count"):
            pipe = self._r.pipeline(transaction=False)
            for k, v in counters.items():
                pipe.hincrby(self._shards[0].counters, k, v)
            await pipe.execute()

    async def _maybe_trim(self) -> None:
        """XTRIM MINID below the oldest entry some group still needs and the retention
        horizon, shard by shard (at most once a second per store object)."""
        now = time.time()
        if now - self._last_trim < 1.0:
            return
        self._last_trim = now
        async with self._io("trim"):
            for sh in self._shards:
                await self._trim_shard(sh, now)

    async def _trim_shard(self, sh: _Shard, now: float) -> None:
        groups = await self._r.xinfo_groups(sh.stream)
        if not groups:
            return
        low = (int((now - self.config.retention_seconds) * 1000), 0)
        for g in groups:
            ms, seq = _parse_id(g["last-delivered-id"].decode())
            keep = (ms, seq + 1)
            if int(g["pending"]):
                summary = await self._r.xpending(sh.stream, g["name"])
                keep = min(keep, _parse_id(summary["min"].decode()))
            low = min(low, keep)
        if low[0] > 0:
            await self._r.xtrim(sh.stream, minid=f"{low[0]}-{low[1]}", approximate=False)
            await self._r.xtrim(sh.facts, minid=f"{low[0]}-{low[1]}", approximate=False)
