"""The learner's own read of trajectory bytes from the store (by-reference Pull streams).

The gateway leases entries, decides staleness and sends each delivery's *reference* (the
Redis stream key and entry id) over gRPC; :class:`StoreReader` fetches the bytes itself,
``XRANGE key id id`` per entry, pipelined (one round trip per ``pipeline_bytes`` of
payload; small pipelines parse cheapest with hiredis), with a blocking redis-py client
(its socket waits run without the GIL, on the client's fetch thread).

The learner then needs read access to the gateway's Redis: a Redis user limited to
``XRANGE`` and ``EXISTS`` on ``<prefix>:stream`` is enough (docs/learner.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from learner_client.errors import TrajectoryClientError
from learner_client.wire import StoreRef
from rollout_proto import codec

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


class StoreReader:
    """Fetches referenced trajectory bytes from Redis. Not thread-safe: one fetch thread."""

    def __init__(self, url: str, *, pipeline_bytes: int = 4 << 20, timeout: float = 30.0):
        if pipeline_bytes < 1:
            raise ValueError("pipeline_bytes must be >= 1")
        self.url = redis_url(url)
        self.pipeline_bytes = pipeline_bytes
        self._r = redis.Redis.from_url(
            self.url, decode_responses=False, socket_timeout=timeout,
            socket_connect_timeout=min(timeout, 5.0),
            retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), 3))
        self._keys_seen: set[str] = set()

    def fetch(self, refs: Sequence[StoreRef]) -> list[bytes | None]:
        """The stored bytes of each reference, in order; None for an entry that is no
        longer in the store (trimmed or deleted). TrajectoryClientError: FAILED_PRECONDITION
        when this Redis does not hold the referenced stream (store_url points elsewhere)
        or the kind is unknown, UNAVAILABLE when Redis cannot be read."""
        out: list[bytes | None] = []
        try:
            self._check_keys(refs)
            i = 0
            while i < len(refs):
                pipe = self._r.pipeline(transaction=False)
                size, j = 0, i
                while j < len(refs) and (j == i or size + refs[j].size <= self.pipeline_bytes):
                    pipe.xrange(refs[j].key, refs[j].entry_id, refs[j].entry_id, count=1)
                    size += refs[j].size
                    j += 1
                for res in pipe.execute():
                    out.append(res[0][1].get(b"d") if res and res[0][1] else None)
                i = j
        except redis.RedisError as exc:
            raise TrajectoryClientError("UNAVAILABLE", f"reading trajectories from the "
                                        f"store failed: {exc}") from None
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

    def close(self) -> None:
        self._r.close()
