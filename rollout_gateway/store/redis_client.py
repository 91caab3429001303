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

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import RedisClusterException, RedisError

from rollout_gateway.errors import StoreError

log = logging.getLogger(__name__)

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


#: retries of a cluster command that met a broken connection or a cluster in failover (the
#: client refreshes its slot map between tries, without waiting)
CLUSTER_RETRIES = 3
#: how long an idempotent write (publish, ack) keeps trying through a failover: a master's
#: death is noticed after the cluster's node timeout, then a replica is promoted
FAILOVER_WAIT_S = 20.0


def closed_transport(exc: BaseException) -> bool:
    """A write to a connection its peer closed (a Redis node that died) under uvloop:
    redis-py's asyncio connection calls ``writelines`` on the closed transport and uvloop
    raises ``RuntimeError("unable to perform operation on <TCPTransport closed=True ...>;
    the handler is closed")`` where asyncio's own loop would give a ConnectionError. It is
    a lost connection (seen as a 500 in the Redis Cluster master-kill test)."""
    return isinstance(exc, RuntimeError) and "the handler is closed" in str(exc)


_REDIS_PACKAGE = os.path.dirname(os.path.abspath(redis.__file__)) + os.sep
#: what redis-py's own code raises when its cluster topology is inconsistent mid-failover
_CLIENT_INTERNAL = (AttributeError, KeyError, IndexError, TypeError)


def client_internal(exc: BaseException) -> bool:
    """An error raised inside redis-py itself (its innermost frame in the package), of a
    kind its cluster client raises while the topology it holds is inconsistent during a
    failover (``AttributeError: 'NoneType' object has no attribute 'name'`` for a node it
    dropped, a ``KeyError`` for a slot: redis-py issues 3815, 3835, 3997, 2437) instead of
    a ``RedisError``. Redis is unavailable for that call, as with a ``ConnectionError``;
    the same error from the gateway's own code is a bug and is not this."""
    if not isinstance(exc, _CLIENT_INTERNAL) or exc.__traceback__ is None:
        return False
    tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_REDIS_PACKAGE)


@asynccontextmanager
async def redis_failures(failed: str) -> AsyncIterator[None]:
    """Redis failing under the block becomes ``StoreError(f"{failed}: ...")`` (503,
    retryable): a ``RedisError``, a ``RedisClusterException`` (not a RedisError: e.g. a slot
    no node serves while a dead master's replica is not yet promoted), a write on a
    connection a dead node closed (:func:`closed_transport`) or redis-py's own code failing
    on its view of a cluster in failover (:func:`client_internal`, logged with its
    traceback). Any other error passes."""
    try:
        yield
    except (RedisError, RedisClusterException) as exc:
        raise StoreError(f"{failed}: {exc}") from exc
    except RuntimeError as exc:
        if not closed_transport(exc):
            raise
        raise StoreError(f"{failed}: connection lost ({exc})") from exc
    except _CLIENT_INTERNAL as exc:
        if not client_internal(exc):
            raise
        log.warning("%s: the Redis client failed inside (%s: %s), taken as Redis "
                    "unavailable", failed, type(exc).__name__, exc, exc_info=True)
        raise StoreError(f"{failed}: Redis client error ({type(exc).__name__})") from exc


async def through_failover(call, *, wait_s: float = FAILOVER_WAIT_S):
    """``await call()``, tried again (jittered backoff, 50 ms doubling up to 1 s) while
    the cluster answers that a node is unreachable or a slot has no master (or the client
    trips over its own view of the failover: :func:`client_internal`), for up to
    ``wait_s``. Only for idempotent calls: a try whose reply was lost may have applied."""
    import asyncio
    import random

    from redis.exceptions import (ClusterDownError, ConnectionError, SlotNotCoveredError,
                                  TimeoutError, TryAgainError)

    transient = (ClusterDownError, ConnectionError, SlotNotCoveredError, TimeoutError,
                 TryAgainError)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    delay = 0.05
    while True:
        try:
            return await call()
        except Exception as exc:
            if not (isinstance(exc, transient) or closed_transport(exc)
                    or client_internal(exc)):
                raise
            if loop.time() + delay > deadline:
                raise
            await asyncio.sleep(delay * (0.5 + random.random() / 2))
            delay = min(delay * 2, 1.0)


def is_cluster(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster (``redis+cluster://`` / ``rediss+cluster://``)."""
    from rollout_proto.redis_url import is_cluster_url

    return is_cluster_url(url)


def cluster_client(url: str, *, max_connections: int | None = None):
    """An asyncio Redis Cluster client from a ``redis+cluster://h:p[,h:p...]`` URL (query
    ignored): ``max_connections`` per node (a call finding a node's all busy fails:
    StoreError, 503), commands retried across a failover (:data:`CLUSTER_RETRIES`)."""
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    from rollout_proto.redis_url import parse_cluster_url

    t = parse_cluster_url(url)
    return RedisCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in t.nodes], decode_responses=False,
        max_connections=max_connections or MAX_CONNECTIONS,
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), CLUSTER_RETRIES),
        **t.client_kwargs())


def sync_cluster_client(url: str, *, socket_timeout: float = 30.0):
    """The blocking counterpart (bulk reads on a thread pool). It does not retry by itself
    (a call fails fast; the store reads the slot map again and tries once more): retrying
    with backoff inside the pool's few threads through a failover queued every read behind
    them, and a learner's Pull stalled for tens of seconds after the failover."""
    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.retry import Retry as SyncRetry

    from rollout_proto.redis_url import parse_cluster_url

    t = parse_cluster_url(url)
    return RedisCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in t.nodes], decode_responses=False,
        socket_timeout=socket_timeout, socket_connect_timeout=5.0,
        retry=SyncRetry(NoBackoff(), 0), **t.client_kwargs())


class LazySyncCluster:
    """:func:`sync_cluster_client`, made on first use: its constructor reads the slot map
    (connects), which must happen neither at start-up (a cluster not up yet) nor on the
    event loop (it blocks). Attribute access forwards to the client."""

    def __init__(self, url: str) -> None:
        import threading

        self._url = url
        self._client = None
        self._lock = threading.Lock()

    def get(self):
        with self._lock:
            if self._client is None:
                self._client = sync_cluster_client(self._url)
            return self._client

    def __getattr__(self, name: str):
        return getattr(self.get(), name)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
