"""One way to open an asyncio Redis client for the store and the registry.

The connection pool is a :class:`redis.asyncio.BlockingConnectionPool`: at most
``max_connections`` connections, and a caller that finds them all busy *waits* (up to
``wait_s``) for one to come back instead of failing with "Too many connections" (redis-py's
default pool raises at 100). Past the wait the call fails (``StoreError``, 503).

A command that meets a broken connection (Redis restarted: every pooled connection is
dead) is retried on a fresh one, three times with jittered backoff (50 ms up to 1 s).
Retried writes are safe here: publish is idempotent by trajectory id, acks are
idempotent, and an entry a retried read leased twice is redelivered after its lease."""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff

#: defaults when a caller gives none (the gateway passes its ``redis`` settings)
MAX_CONNECTIONS = 256
WAIT_S = 20.0


def blocking_client(url: str, *, max_connections: int | None = None,
                    wait_s: float | None = None) -> aioredis.Redis:
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections or MAX_CONNECTIONS,
        timeout=wait_s if wait_s is not None else WAIT_S, decode_responses=False,
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), 3))
    return aioredis.Redis(connection_pool=pool)
