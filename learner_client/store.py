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
``XRANGE`` and ``EXISTS`` on ``<prefix>:stream`` is enough (docs/gateway.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from learner_client.buffers import BufferPool
from learner_client.errors import TrajectoryClientError
from learner_client.wire import StoreRef
from rollout_proto import codec
from rollout_proto.resp import Replies, RespError

#: the gateway's own store URL options (rollout_gateway.store.factory: prefix and the
#: StoreConfig fields); redis-py would refuse them
_GATEWAY_OPTIONS = frozenset({"prefix", "max_backlog", "lease_seconds", "max_deliveries",
                              "retention_seconds", "dedup_seconds"})


def redis_url(url: str) -> str:
    """``url`` without the gateway's own store options (``prefix``, ``max_backlog``, ...):
    the learner may be given the very URL the gateway's ``--store`` has."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"store_url must be a redis://, rediss:// or unix:// URL, got {url!r}")
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
        self._r = redis.Redis.from_url(
            self.url, decode_responses=False, socket_timeout=timeout,
            socket_connect_timeout=min(timeout, 5.0),
            retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), 3))
        self.pool = pool or SHARED
        self._conn = None
        self._keys_seen: set[str] = set()

    def fetch(self, refs: Sequence[StoreRef]) -> list[memoryview | None]:
        """The stored bytes of each reference, in order (read-only views into pooled
        buffers); None for an entry no longer in the store (trimmed or deleted).
        TrajectoryClientError: FAILED_PRECONDITION when this Redis does not hold the
        referenced stream (store_url points elsewhere) or the kind is unknown,
        PERMISSION_DENIED when the Redis user may not read it, UNAVAILABLE when Redis
        cannot be read."""
        try:
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
        except RespError as exc:
            self._drop()
            code = "PERMISSION_DENIED" if str(exc).startswith("NOPERM") else "UNAVAILABLE"
            raise TrajectoryClientError(code, f"reading trajectories from the store: "
                                        f"{exc}") from None
        except (redis.RedisError, OSError, ValueError) as exc:
            self._drop()
            raise TrajectoryClientError("UNAVAILABLE", f"reading trajectories from the "
                                        f"store failed: {exc}") from None

    def _pipeline(self, refs: Sequence[StoreRef]) -> list[memoryview | None]:
        if self._conn is None:
            self._conn = self._r.connection_pool.get_connection()
            self._conn.connect()
            self._replies = Replies(self._conn._sock, self.pool.get)
        conn = self._conn
        conn.send_packed_command(conn.pack_commands(
            [("XRANGE", r.key, r.entry_id, r.entry_id, "COUNT", "1") for r in refs]),
            check_health=False)
        out, error = [], None
        for _ in refs:  # read every reply (the connection stays in sync), then raise
            try:
                res = self._replies.read()
            except RespError as exc:
                error = error or exc
                continue
            out.append(_payload(res))
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
        if self._conn is not None:
            self._conn.disconnect()
            self._conn = None

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
