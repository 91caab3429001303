"""Redis store specifics: bulk reads on the thread pool (real Redis server)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from _redis_support import delete_prefix
from rollout_gateway.store.base import StoreConfig
from rollout_gateway.store.redis_streams import RedisStore
from doubles.trajectories import make_trajectory

pytestmark = pytest.mark.integration


@pytest.fixture
async def store():
    prefix = f"test-{uuid.uuid4().hex[:10]}"
    s = RedisStore("redis://127.0.0.1:6379/0", prefix=prefix,
                   config=StoreConfig(lease_seconds=60))
    yield s
    await s.close()
    await delete_prefix(prefix)


async def test_cancelled_bulk_read_releases_its_leases_at_once(store):
    await store.create_group("job")
    for i in range(20):
        await store.publish(make_trajectory(f"t{i}", num_tokens=64, num_layers=8, seed=i))
    task = asyncio.create_task(store._read_new("job", "a", 20))
    await asyncio.sleep(0)  # the read is on its thread now; cancel the waiting coroutine
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    got: list = []
    for _ in range(50):  # far less than the 60 s lease
        got += await store.read("job", "b", 20 - len(got))
        if len(got) == 20:
            break
        await asyncio.sleep(0.05)
    assert sorted(e.trajectory_id for e in got) == sorted(f"t{i}" for i in range(20))
    assert all(e.delivery_count == 1 for e in got)  # released, not counted as delivered


async def test_bulk_and_blocking_reads_deliver_each_entry_once(store):
    await store.create_group("job")
    waiter = asyncio.create_task(store.read("job", "a", 8, block_ms=2000))
    await asyncio.sleep(0.2)  # nothing ready: the read waits with BLOCK
    for i in range(8):
        await store.publish(make_trajectory(f"t{i}", seed=i))
    first = await waiter
    rest = await store.read("job", "a", 8)
    ids = [e.trajectory_id for e in first + rest]
    assert first and sorted(ids) == sorted(f"t{i}" for i in range(8)) and len(set(ids)) == 8
