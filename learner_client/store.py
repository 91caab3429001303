"""The learner's own read of trajectory bytes from the store (by-reference Pull streams).

The gateway leases entries, decides staleness and sends each delivery's *reference* (the
Redis stream key and entry id) over gRPC; :class:`StoreReader` fetches the bytes itself,
``XRANGE key id id`` per entry, pipelined (one round trip per ``pipeline_bytes`` of
payload), on the client's fetch thread (socket waits run without the GIL).

The connection (URL, AUTH, TLS, db) is redis-py's; the replies are read here: each payload
is received straight into a buffer of a small pool (``recv_into``: the kernel's copy and no
other), and a buffer is reused once nothing refers to it any more (every Rollout column
decoded from it is a read-only view that keeps it alive). A parser that allocates every
multi-MB payload afresh pays for its pages again each time (page faults, zeroing) and for
two more copies (hiredis' buffer, then a bytes object): ~3x this reader's CPU per byte.

The learner then needs read access to the gateway's Redis: a Redis user limited to
``XRANGE`` and ``EXISTS`` on ``<prefix>:stream`` is enough (docs/gateway.md); a store of
several shards has one stream per shard (``<prefix>:{<tag>}:stream``, a pattern
``<prefix>:*stream``). A Redis Cluster (``redis+cluster://host:port[,...]``): each
reference is read from the master of its stream's slot, one pipeline per master; a
reply that says the slot moved (a failover) refreshes the slot map and the fetch is tried
again.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry
from redis.exceptions import RedisClusterException

from learner_client.buffers import BufferPool
from learner_client.errors import TrajectoryClientError
from learner_client.wire import StoreRef
from rollout_proto import codec
from rollout_proto.redis_url import CLUSTER_SCHEMES, parse_cluster_url
from rollout_proto.resp import Replies, RespError

#: the gateway's own store URL options (rollout_gateway.store.factory: prefix, shards and
#: the StoreConfig fields); redis-py would refuse them
_GATEWAY_OPTIONS = frozenset({"prefix", "shards", "replica_acks", "replica_wait_ms",
                              "max_backlog", "lease_seconds", "max_deliveries",
                              "retention_seconds", "dedup_seconds"})
#: error replies after which a cluster's slot map is read again (a failover, a resharding)
_MOVED = ("MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN", "READONLY")
_CLUSTER_TRIES = 5


def redis_url(url: str) -> str:
    """``url`` without the gateway's own store options (``prefix``, ``max_backlog``, ...):
    the learner may be given the very URL the gateway's ``--store`` has."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix", *CLUSTER_SCHEMES):
        raise ValueError(f"store_url must be a redis://, rediss://, unix:// or "
                         f"redis+cluster:// URL, got {url!r}")
    query = [(k, v) for k, v in parse_qsl(parts.query) if k not in _GATEWAY_OPTIONS]
    return urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query), ""))


#: the process' payload buffers (StoreReader's default pool)
SHARED = BufferPool(256 << 20)


class StoreReader:
    """Fetches referenced trajectory bytes from Redis. Not thread-safe: one fetch thread."""

    def __init__(self, url: str, *, pipeline_bytes: int = 4 << 20, timeout: float = 30.0,
                 pool: BufferPool | None = None):
        if pipeline_bytes < 1:
            raise ValueError("pipeline_bytes must be >= 1")
        self.url = redis_url(url)
        self.pipeline_bytes = pipeline_bytes
        retry = Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), 3)
        self.cluster = urlsplit(self.url).scheme in CLUSTER_SCHEMES
        if self.cluster:
            from redis.cluster import ClusterNode, RedisCluster

            t = parse_cluster_url(self.url)
            self._r = RedisCluster(
                startup_nodes=[ClusterNode(h, p) for h, p in t.nodes], decode_responses=False,
                socket_timeout=timeout, socket_connect_timeout=min(timeout, 5.0), retry=retry,
                **t.client_kwargs())
        else:
            self._r = redis.Redis.from_url(
                self.url, decode_responses=False, socket_timeout=timeout,
                socket_connect_timeout=min(timeout, 5.0), retry=retry)
        self.pool = pool or SHARED
        #: a connection and its reply reader per Redis (one, or each cluster master)
        self._conns: dict[str, tuple[object, object, Replies]] = {}
        self._keys_seen: set[str] = set()

    def fetch(self, refs: Sequence[StoreRef]) -> list[memoryview | None]:
        """The stored bytes of each reference, in order (read-only views into pooled
        buffers); None for an entry no longer in the store (trimmed or deleted).
        TrajectoryClientError: FAILED_PRECONDITION when this Redis does not hold the
        referenced stream (store_url points elsewhere) or the kind is unknown,
        PERMISSION_DENIED when the Redis user may not read it, UNAVAILABLE when Redis
        cannot be read."""
        for attempt in range(_CLUSTER_TRIES if self.cluster else 1):
            try:
                return self._fetch(refs)
            except (RespError, redis.RedisError, RedisClusterException, OSError,
                    ValueError) as exc:
                moved = isinstance(exc, RespError) and str(exc).startswith(_MOVED)
                broken = isinstance(exc, (redis.ConnectionError, OSError, ConnectionError))
                if not self.cluster or not (moved or broken) or attempt == _CLUSTER_TRIES - 1:
                    self._raise(exc)
                self._drop()
                try:  # the slot map again (a failover promoted a replica)
                    self._r.nodes_manager.initialize()
                except (redis.RedisError, RedisClusterException):
                    pass
        raise AssertionError("unreachable")

    def _fetch(self, refs: Sequence[StoreRef]) -> list[memoryview | None]:
        self._check_keys(refs)
        out: list[memoryview | None] = []
        i = 0
        while i < len(refs):
            size, j = 0, i
            while j < len(refs) and (j == i or size + refs[j].size <= self.pipeline_bytes):
                size += refs[j].size
                j += 1
            out += self._pipeline(refs[i:j])
            i = j
        return out

    def _raise(self, exc: BaseException):
        """The TrajectoryClientError for a failed fetch."""
        try:
            raise exc
        except RespError as exc:
            self._drop()
            code = "PERMISSION_DENIED" if str(exc).startswith("NOPERM") else "UNAVAILABLE"
            raise TrajectoryClientError(code, f"reading trajectories from the store: "
                                        f"{exc}") from None
        except (redis.RedisError, RedisClusterException, OSError, ValueError) as exc:
            self._drop()
            raise TrajectoryClientError("UNAVAILABLE", f"reading trajectories from the "
                                        f"store failed: {exc}") from None

    def _connection(self, key: str) -> tuple[object, Replies]:
        """The connection (and its reply reader) of the Redis holding ``key``."""
        if self.cluster:
            node = self._r.get_node_from_key(key)
            name, pool = node.name, node.redis_connection.connection_pool
        else:
            name, pool = "", self._r.connection_pool
        if name not in self._conns:
            conn = pool.get_connection()
            conn.connect()
            self._conns[name] = (pool, conn, Replies(conn._sock, self.pool.get))
        _pool, conn, replies = self._conns[name]
        return conn, replies

    def _pipeline(self, refs: Sequence[StoreRef]) -> list[memoryview | None]:
        """One pipeline per Redis (cluster: per master), every reply read in order."""
        by_conn: dict[int, tuple[object, Replies, list[int]]] = {}
        for i, r in enumerate(refs):
            conn, replies = self._connection(r.key)
            by_conn.setdefault(id(conn), (conn, replies, []))[2].append(i)
        out: list[memoryview | None] = [None] * len(refs)
        error = None
        for conn, replies, idx in by_conn.values():
            conn.send_packed_command(conn.pack_commands(
                [("XRANGE", refs[i].key, codec.stream_entry_id(refs[i].entry_id),
                  codec.stream_entry_id(refs[i].entry_id), "COUNT", "1") for i in idx]),
                check_health=False)
        for conn, replies, idx in by_conn.values():
            for i in idx:  # read every reply (the connection stays in sync), then raise
                try:
                    out[i] = _payload(replies.read())
                except RespError as exc:
                    error = error or exc
        if error is not None:
            raise error
        return out

    def _check_keys(self, refs: Sequence[StoreRef]) -> None:
        for key in {r.key for r in refs} - self._keys_seen:
            kinds = {r.kind for r in refs if r.key == key}
            if kinds != {codec.REDIS_STREAM}:
                raise TrajectoryClientError("FAILED_PRECONDITION", f"cannot read store "
                                            f"references of kind {sorted(kinds)}")
            if not self._r.exists(key):
                raise TrajectoryClientError(
                    "FAILED_PRECONDITION", f"the learner's store_url has no stream {key!r}: "
                    "it must name the gateway's Redis (same host and db)")
            self._keys_seen.add(key)

    def _drop(self) -> None:
        for pool, conn, _replies in self._conns.values():
            conn.disconnect()
            pool.release(conn)
        self._conns.clear()

    def close(self) -> None:
        self._drop()
        self._r.close()


def _payload(res) -> memoryview | None:
    """The ``d`` field of an XRANGE reply for one id ([] when the entry is gone)."""
    if not res:
        return None
    fields = res[0][1] or []
    if isinstance(fields, dict):  # RESP3
        return fields.get(b"d")
    for k in range(0, len(fields) - 1, 2):
        if fields[k] == b"d":
            return fields[k + 1]
    return None
