"""One semantics suite for every version registry: in memory, Redis (the real server, unique
prefix) and a real Redis Cluster (3 masters + 3 replicas on loopback)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from _redis_support import delete_prefix
from rollout_gateway.errors import Aborted, FailedPrecondition, InvalidArgument
from rollout_gateway.registry import (
    EngineSwapOutcome,
    InMemoryRegistry,
    SwapRecord,
    create_registry,
)

pytestmark = pytest.mark.integration
REDIS = "redis://127.0.0.1:6379/0"


@pytest.fixture(params=["memory", "redis", "cluster"])
async def replicas(request):
    """factory() -> a registry view; Redis views are separate clients (separate replicas)
    over the same keys, the memory backend has a single shared instance."""
    prefix = f"test-{uuid.uuid4().hex[:10]}"
    made = []
    shared = InMemoryRegistry(max_history=5)

    def factory():
        if request.param == "memory":
            return shared
        url = (f"{request.getfixturevalue('redis_cluster').url}/?prefix={prefix}"
               if request.param == "cluster" else f"{REDIS}?prefix={prefix}")
        reg = create_registry(url, max_history=5)
        made.append(reg)
        return reg

    yield factory
    for reg in made:
        await reg.close()
    if request.param == "redis":
        await delete_prefix(prefix)


async def test_learner_version_never_goes_backwards(replicas):
    a, b = replicas(), replicas()
    assert await a.learner_version() == 0
    assert await a.set_learner_version(3) == 0
    assert await b.learner_version() == 3
    assert await b.set_learner_version(3) == 3  # idempotent
    with pytest.raises(FailedPrecondition, match="backwards") as ei:
        await b.set_learner_version(2)
    assert ei.value.details == {"current_version": 3, "requested_version": 2}
    assert await a.learner_version() == 3
    with pytest.raises(InvalidArgument):
        await a.set_learner_version(-1)


async def test_concurrent_advances_end_at_the_max(replicas):
    regs = [replicas() for _ in range(3)]

    async def bump(reg, v):
        try:
            await reg.set_learner_version(v)
        except FailedPrecondition:
            pass

    await asyncio.gather(*(bump(regs[v % 3], v) for v in range(1, 30)))
    # a fresh view: each replica may serve its own last write from its short read cache
    # (version_cache_s) for a moment, which is not what this test is about
    assert await replicas().learner_version() == 29


async def test_engine_versions_and_snapshot_lag(replicas):
    a, b = replicas(), replicas()
    await a.set_learner_version(5)
    await a.set_engine_version("e0", 5)
    await b.set_engine_version("e1", 3)
    assert await b.engine_versions() == {"e0": 5, "e1": 3}
    snap = await b.snapshot()
    assert snap["learner_version"] == 5
    assert snap["engines"] == {"e0": {"version": 5, "lag": 0}, "e1": {"version": 3, "lag": 2}}
    assert snap["max_lag"] == 2 and snap["swap_leader"] is None
    assert await a.remove_engine("e1") is True
    assert await a.remove_engine("e1") is False
    assert await b.engine_versions() == {"e0": 5}


async def test_swap_history_upsert_order_and_trim(replicas):
    a, b = replicas(), replicas()
    t0 = time.time()
    rec = SwapRecord(version=1, mode="retract", source="/ckpt/1", leader="gw-a",
                     started_at=t0, paused_at=t0 + 0.1)
    rec.engines["e0"] = EngineSwapOutcome("e0", version_before=0, tokens_reprefilled=40)
    await a.record_swap(rec)
    rec.engines["e0"].ok = True
    rec.engines["e0"].version_after = 1
    rec.engines["e1"] = EngineSwapOutcome("e1", ok=False, error="load failed: bad shape",
                                          tokens_reprefilled=2)
    rec.resumed_at, rec.finished_at, rec.status = t0 + 0.5, t0 + 0.6, "partial"
    await a.record_swap(rec)  # upsert, not a second record
    got = await b.get_swap(rec.swap_id)
    assert got is not None and got.status == "partial" and got.tokens_reprefilled == 42
    assert got.engines["e1"].error == "load failed: bad shape" and got.engines["e0"].ok
    assert got.pause_windows() == [("*", t0 + 0.1, t0 + 0.5)]
    for v in range(2, 8):
        await a.record_swap(SwapRecord(version=v, mode="in_place", rolling=True,
                                       started_at=t0 + v))
    recent = await b.swaps(limit=3)
    assert [s.version for s in recent] == [7, 6, 5]
    assert len(await b.swaps(limit=100)) == 5  # max_history=5: the oldest were trimmed
    assert await b.get_swap(rec.swap_id) is None
    snap = await b.snapshot(recent=2)
    assert [s["version"] for s in snap["recent_swaps"]] == [7, 6]
    assert snap["recent_swaps"][0]["rolling"] is True


def test_swap_record_validates_mode():
    with pytest.raises(InvalidArgument, match="mode"):
        SwapRecord(version=1, mode="yolo")


async def test_lease_is_exclusive_and_released(replicas):
    a, b = replicas(), replicas()
    async with a.swap_lease("gw-a", ttl=5.0) as lease:
        assert await b.lease_holder() == "gw-a"
        with pytest.raises(FailedPrecondition, match="gw-a"):
            async with b.swap_lease("gw-b", ttl=5.0):
                pass
        lease.check()
    assert await b.lease_holder() is None
    async with b.swap_lease("gw-b", ttl=5.0):
        assert await a.lease_holder() == "gw-b"


async def test_lease_renews_while_held(replicas):
    a, b = replicas(), replicas()
    async with a.swap_lease("gw-a", ttl=0.3) as lease:
        await asyncio.sleep(0.8)  # well past one ttl: only renewal keeps it
        assert not lease.lost
        with pytest.raises(FailedPrecondition):
            await b.acquire_lease("gw-b", ttl=1.0)


async def test_lease_expires_and_old_holder_cannot_release_or_renew(replicas):
    a, b = replicas(), replicas()
    old = await a.acquire_lease("gw-a", ttl=0.2)
    await asyncio.sleep(0.35)
    assert await b.lease_holder() is None
    new = await b.acquire_lease("gw-b", ttl=5.0)
    assert await a.release_lease(old) is False  # must not free gw-b's lease
    assert await a.renew_lease(old) is False and old.lost
    with pytest.raises(Aborted):
        old.check()
    assert await a.lease_holder() == "gw-b"
    assert await b.release_lease(new) is True


async def test_watch_sees_changes_from_other_replicas(replicas):
    a, b = replicas(), replicas()
    async with a.watch() as feed:
        await b.set_learner_version(4)
        await b.set_engine_version("e0", 4)
        await b.set_engine_version("e0", 4)  # unchanged: no event
        await b.remove_engine("e0")
        evs = [await feed.next(timeout=5.0) for _ in range(3)]
        assert [(e.kind, e.version, e.engine_id) for e in evs] == [
            ("learner", 4, None), ("engine", 4, "e0"), ("engine_removed", None, "e0")]
        with pytest.raises(TimeoutError):
            await feed.next(timeout=0.2)


async def test_redis_errors_become_store_errors():
    from rollout_gateway.errors import StoreError

    reg = create_registry("redis://127.0.0.1:1/0?prefix=nowhere")
    with pytest.raises(StoreError, match="Redis"):
        await reg.learner_version()
    await reg.close()


def test_bad_url_is_invalid_argument():
    with pytest.raises(InvalidArgument):
        create_registry("postgres://x")


async def test_redis_watch_survives_a_killed_connection():
    import redis.asyncio as aioredis

    prefix = f"test-{uuid.uuid4().hex[:10]}"
    name = f"rgwatch{uuid.uuid4().hex[:8]}"
    a = create_registry(f"{REDIS}?prefix={prefix}&client_name={name}")
    b = create_registry(f"{REDIS}?prefix={prefix}")
    admin = aioredis.Redis()
    try:
        async with a.watch() as feed:
            await b.set_learner_version(1)
            assert (await feed.next(timeout=5.0)).version == 1
            clients = await admin.client_list()
            ids = [c["id"] for c in clients if c.get("name") == name and "subscribe" in c["cmd"]]
            assert ids, "the watch connection was not found"
            for cid in ids:
                await admin.client_kill_filter(_id=cid)
            await asyncio.sleep(0.1)
            got = None
            for v in range(2, 40):  # publish until the resubscribed feed hears one
                await b.set_learner_version(v)
                try:
                    got = await feed.next(timeout=0.3)
                    break
                except TimeoutError:
                    continue
            # the feed hears events again (redis-py's retry policy reconnects and resubscribes
            # the pub/sub connection itself; the watch's own resubscribe is the fallback)
            assert got is not None and got.kind == "learner" and got.version >= 2
    finally:
        await a.close()
        await b.close()
        await delete_prefix(prefix)
        await admin.aclose()


async def test_running_counts_are_shared_and_expire(replicas):
    a, b = replicas(), replicas()
    await a.report_running("gw-a", 7, ttl=30.0)
    await b.report_running("gw-b", 5, ttl=30.0)
    assert await a.running_elsewhere("gw-a") == 5
    assert await b.running_elsewhere("gw-b") == 7
    assert await b.running_elsewhere("gw-c") == 12
    await a.report_running("gw-a", 2, ttl=30.0)  # overwrite, not add
    assert await b.running_elsewhere("gw-b") == 2
    t0 = time.monotonic()
    await a.report_running("gw-a", 2, ttl=0.3)  # its last report: then gw-a crashed
    while await b.running_elsewhere("gw-b") != 0:  # it stops counting once its ttl ran out
        assert time.monotonic() - t0 < 10, "a crashed replica's count never expired"
        await asyncio.sleep(0.02)
    assert time.monotonic() - t0 >= 0.3
    assert await a.running_elsewhere("gw-a") == 5
    with pytest.raises(InvalidArgument):
        await a.report_running("gw-a", -1)
