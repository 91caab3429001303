"""Build a trajectory store from a URL.

* ``memory://`` — embedded, in memory only.
* ``memory:///abs/path/journal.db`` or ``memory://?journal=/path`` — embedded with a
  SQLite journal (survives a process restart).
* ``redis://host:port/db?prefix=rollout`` (or ``rediss://``) — Redis Streams.

Any URL may add StoreConfig fields as query parameters, e.g.
``?max_backlog=1000&lease_seconds=30&max_deliveries=5&retention_seconds=600``.
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

from pydantic import ValidationError

from rollout_gateway.errors import InvalidArgument
from rollout_gateway.store.base import StoreConfig, TrajectoryStore


def store_from_url(url: str, config: StoreConfig | None = None, *,
                   max_connections: int | None = None,
                   pool_wait_s: float | None = None) -> TrajectoryStore:
    """``max_connections`` / ``pool_wait_s``: the Redis connection pool's bound and how
    long a call waits for a free connection (Redis URLs only)."""
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
    if parts.scheme in ("redis", "rediss", "unix"):
        from rollout_gateway.store.redis_streams import RedisStore

        prefix = query.pop("prefix", "rollout")
        rest = urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query), ""))
        return RedisStore(rest, prefix=prefix, config=cfg, max_connections=max_connections,
                          pool_wait_s=pool_wait_s)
    raise InvalidArgument(f"unknown store URL scheme {parts.scheme!r} in {url!r} "
                          "(use memory:// or redis://)")


def _no_extra(url: str, query: dict[str, str]) -> None:
    if query:
        raise InvalidArgument(f"unknown store option(s) {sorted(query)} in {url!r}")
