"""Cleanup of the per-test Redis key prefixes integration tests use."""

from __future__ import annotations


async def delete_prefix(prefix: str) -> None:
    """Delete every key under ``prefix:`` on the local test Redis."""
    import redis.asyncio as aioredis

    r = aioredis.Redis()
    keys = [k async for k in r.scan_iter(f"{prefix}:*")]
    if keys:
        await r.delete(*keys)
    await r.aclose()


def delete_prefix_sync(prefix: str) -> None:
    """The same, for synchronous fixtures."""
    import redis

    r = redis.Redis()
    keys = list(r.scan_iter(f"{prefix}:*"))
    if keys:
        r.delete(*keys)
    r.close()
