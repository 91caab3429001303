"""Version registry: learner version, engine versions, swap history, swap-leadership lease."""

from __future__ import annotations

from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

from rollout_gateway.errors import InvalidArgument
from rollout_gateway.registry.base import (
    EngineSwapOutcome,
    Lease,
    SwapRecord,
    SwapStatus,
    VersionEvent,
    VersionRegistry,
    Watch,
)
from rollout_gateway.registry.memory import InMemoryRegistry
from rollout_proto.redis_url import CLUSTER_SCHEMES, parse_cluster_url

__all__ = ["EngineSwapOutcome", "InMemoryRegistry", "Lease", "SwapRecord", "SwapStatus",
           "VersionEvent", "VersionRegistry", "Watch", "create_registry"]


def create_registry(url: str | None = None, *, prefix: str = "rollout",
                    max_history: int = 1000, max_connections: int | None = None,
                    pool_wait_s: float | None = None,
                    version_cache_s: float = 0.25) -> VersionRegistry:
    """Build a registry from a URL, in the trajectory store's URL style.

    ``None``/``""``/``memory://`` -> in-process. ``redis://host:port/db?prefix=rollout``
    (also ``rediss://``, ``unix://``) -> Redis, keys under ``{prefix}:reg:``;
    ``redis+cluster://host:port[,host:port...]/?prefix=rollout`` -> a Redis Cluster, keys
    under ``{prefix}:{{{prefix}}}:reg:`` (one slot: ``store.keys``). A ``prefix`` query
    parameter overrides the argument, so the store's URL can be reused.
    Redis: a bounded connection pool that waits for a free connection (``max_connections``,
    ``pool_wait_s``), and the learner version cached for ``version_cache_s``.
    """
    if not url or url.startswith("memory://"):
        return InMemoryRegistry(max_history=max_history)
    parts = urlsplit(url)
    if parts.scheme in CLUSTER_SCHEMES:
        from rollout_gateway.registry.redis_registry import RedisRegistry

        try:
            target = parse_cluster_url(url)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        return RedisRegistry.from_url(url, prefix=target.query.get("prefix", prefix),
                                      max_history=max_history,
                                      max_connections=max_connections,
                                      pool_wait_s=pool_wait_s, version_cache_s=version_cache_s)
    if parts.scheme in ("redis", "rediss", "unix"):
        from rollout_gateway.registry.redis_registry import RedisRegistry

        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        prefix = query.pop("prefix", prefix)
        for k in [k for k in query if k not in _REDIS_URL_OPTIONS]:
            query.pop(k)  # store options (max_backlog, ...) do not concern the registry
        rest = urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query), ""))
        return RedisRegistry.from_url(rest, prefix=prefix, max_history=max_history,
                                      max_connections=max_connections,
                                      pool_wait_s=pool_wait_s, version_cache_s=version_cache_s)
    raise InvalidArgument(f"registry URL must be memory://, redis://... or "
                          f"redis+cluster://..., got {url!r}")


_REDIS_URL_OPTIONS = {"db", "password", "username", "socket_timeout", "socket_connect_timeout",
                      "socket_keepalive", "retry_on_timeout", "max_connections",
                      "health_check_interval", "ssl_cert_reqs", "client_name"}
