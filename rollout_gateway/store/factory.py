"""Build a trajectory store from a URL.

* ``memory://`` — embedded, in memory only.
* ``memory:///abs/path/journal.db`` or ``memory://?journal=/path`` — embedded with a
  SQLite journal (survives a process restart).
* ``redis://host:port/db?prefix=rollout`` (or ``rediss://``) — Redis Streams.
* ``redis+cluster://host:port[,host:port...]/?prefix=rollout&shards=3`` (or
  ``rediss+cluster://``) — Redis Streams on a Redis Cluster, any listed node as a seed.

``shards`` (Redis URLs, 1-256, default 1; see ``RedisStore``): trajectory streams, each in
its own cluster slot, spread over the masters; set it to a multiple of the masters.

Any URL may add StoreConfig fields as query parameters, e.g.
``?max_backlog=1000&lease_seconds=30&max_deliveries=5&retention_seconds=600``.
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

from pydantic import ValidationError

from rollout_gateway.errors import InvalidArgument
from rollout_gateway.store.base import StoreConfig, TrajectoryStore
from rollout_gateway.store.keys import MAX_SHARDS
from rollout_proto.redis_url import CLUSTER_SCHEMES, parse_cluster_url


def store_from_url(url: str, config: StoreConfig | None = None, *,
                   max_connections: int | None = None,
                   pool_wait_s: float | None = None, shards: int = 1) -> TrajectoryStore:
    """``max_connections`` / ``pool_wait_s``: the Redis connection pool's bound and how
    long a call waits for a free connection (Redis URLs only); ``shards``: trajectory
    streams of a Redis store when the URL has no ``shards`` option."""
    parts = urlsplit(url)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    known = set(StoreConfig.model_fields)
    overrides = {k: query.pop(k) for k in list(query) if k in known}
    try:
        cfg = StoreConfig(**{**(config or StoreConfig()).model_dump(), **overrides})
    except ValidationError as exc:
        raise InvalidArgument(f"bad store option in {url!r}: {exc.errors()[0]['msg']}") from None
    if parts.scheme == "memory":
        from rollout_gateway.store.memory import MemoryStore

        if parts.netloc:
            raise InvalidArgument(f"memory store URL {url!r} has a host part; use "
                                  "memory:///abs/path/journal.db or memory://?journal=PATH")
        journal = query.pop("journal", None) or (parts.path or None)
        _no_extra(url, query)
        return MemoryStore(cfg, journal_path=journal)
    if parts.scheme in ("redis", "rediss", "unix", *CLUSTER_SCHEMES):
        from rollout_gateway.store.redis_streams import RedisStore

        prefix = query.pop("prefix", "rollout")
        shards = _shards(url, query.pop("shards", str(shards)))
        if parts.scheme in CLUSTER_SCHEMES:
            try:
                parse_cluster_url(url)
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
            _no_extra(url, query)
        rest = urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query), ""))
        try:
            return RedisStore(rest, prefix=prefix, config=cfg, shards=shards,
                              max_connections=max_connections, pool_wait_s=pool_wait_s)
        except ValueError as exc:  # a prefix with braces
            raise InvalidArgument(f"bad store URL {url!r}: {exc}") from None
    raise InvalidArgument(f"unknown store URL scheme {parts.scheme!r} in {url!r} "
                          "(use memory://, redis:// or redis+cluster://)")


def _shards(url: str, value: str) -> int:
    if not value.isascii() or not value.isdigit() or not 1 <= int(value) <= MAX_SHARDS:
        raise InvalidArgument(f"bad store option in {url!r}: shards must be 1..{MAX_SHARDS}, "
                              f"got {value!r}")
    return int(value)


def _no_extra(url: str, query: dict[str, str]) -> None:
    if query:
        raise InvalidArgument(f"unknown store option(s) {sorted(query)} in {url!r}")
