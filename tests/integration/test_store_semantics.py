"""One suite, every store: embedded (memory and journaled), Redis Streams (real server) with
one shard and with three, and Redis Streams on a real Redis Cluster (3 masters + 3
replicas, three shards)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from _redis_support import delete_prefix
from rollout_gateway.core.staleness import StalePolicy
from rollout_gateway.errors import InvalidArgument, NotFound, ResourceExhausted
from rollout_gateway.store.base import StoreConfig
from rollout_gateway.store.factory import store_from_url
from rollout_gateway.core import trajectory_codec
from doubles.trajectories import make_trajectory

pytestmark = pytest.mark.integration

KINDS = ["memory", "journal", "redis", "sharded", "cluster"]
#: stores whose max_backlog bound is split over 3 shards (exact per shard, not in total)
SHARDED = {"sharded", "cluster"}


def _url(kind: str, tmp_path, prefix: str, request) -> str:
    if kind == "memory":
        return "memory://"
    if kind == "journal":
        return f"memory://?journal={tmp_path / 'journal.db'}"
    if kind == "sharded":
        return f"redis://127.0.0.1:6379/0?prefix={prefix}&shards=3"
    if kind == "cluster":
        return f"{request.getfixturevalue('redis_cluster').url}/?prefix={prefix}&shards=3"
    return f"redis://127.0.0.1:6379/0?prefix={prefix}"


@pytest.fixture(params=KINDS)
async def make(request, tmp_path):
    """make(**config) -> a fresh store; calling it again reopens the same backing data."""
    async for f in _factory(request.param, tmp_path, request):
        yield f


@pytest.fixture(params=["journal", "redis", "cluster"])
async def make_durable(request, tmp_path):
    async for f in _factory(request.param, tmp_path, request):
        yield f


async def _factory(kind, tmp_path, request):
    prefix = f"test-{uuid.uuid4().hex[:10]}"
    opened = []
    url = _url(kind, tmp_path, prefix, request)

    def factory(**cfg):
        s = store_from_url(url, StoreConfig(**cfg))
        opened.append(s)
        return s

    factory.kind = kind
    yield factory
    for s in opened:
        await s.close()
    if kind in ("redis", "sharded"):
        await delete_prefix(prefix)


def traj(i: int, **kw):
    return make_trajectory(f"t{i}", seed=i, **kw)


def shards(make) -> int:
    return 3 if make.kind in SHARDED else 1


def one_shard(store, n: int) -> list[int]:
    """``n`` numbers i whose trajectories t<i> land in one shard (every i with one shard):
    order and the per-shard backlog bound hold within a shard."""
    layout = getattr(store, "layout", None)
    if layout is None or layout.shards == 1:
        return list(range(n))
    return [i for i in range(1000) if layout.shard_of(f"t{i}") == layout.shard_of("t0")][:n]


async def test_publish_is_idempotent_and_delivers_once(make):
    s = make()
    assert await s.create_group("job")
    assert not await s.create_group("job")
    t1 = traj(1)
    assert await s.publish(t1)
    assert not await s.publish(traj(1))
    got = await s.read("job", "c1", 10)
    assert [e.trajectory_id for e in got] == ["t1"]
    assert got[0].delivery_count == 1
    assert trajectory_codec.decode(got[0].data).trajectory_id == "t1"
    assert got[0].data == trajectory_codec.encode(t1)  # byte-identical to what was published
    assert await s.read("job", "c1", 10) == []
    st = await s.stats()
    assert (st.published, st.duplicates) == (1, 1)


async def test_unknown_group_and_bad_names(make):
    s = make()
    with pytest.raises(NotFound):
        await s.read("nope", "c", 1)
    with pytest.raises(NotFound):
        await s.ack("nope", [])
    with pytest.raises(InvalidArgument):
        await s.create_group("bad name with spaces")
    await s.create_group("job")
    with pytest.raises(InvalidArgument):
        await s.ack("job", ["not-an-id!"])


async def test_without_a_group_the_backlog_bound_refuses(make):
    # several shards: each holds its share of max_backlog (here 2 each)
    s = make(max_backlog=2 * shards(make))
    i = one_shard(s, 3)
    assert await s.publish(traj(i[0])) and await s.publish(traj(i[1]))
    with pytest.raises(ResourceExhausted):
        await s.publish(traj(i[2]))
    await s.create_group("job")  # a group takes over: it is bounded, publishing goes on
    assert await s.publish(traj(i[2]))


async def test_a_full_group_loses_its_oldest_and_never_blocks_another(make):
    s = make(max_backlog=3 * shards(make))  # 3 per shard
    t = one_shard(s, 6)
    await s.create_group("zombie")  # created, never read (until below)
    await s.create_group("live")
    for i in t[:5]:
        assert await s.publish(traj(i))  # never refused: zombie is full from the 4th on
        got = await s.read("live", "c", 10)
        assert [e.trajectory_id for e in got] == [f"t{i}"]
        assert await s.ack("live", [e.entry_id for e in got]) == 1
    assert await s.group_backlog("zombie") == 3 and await s.group_backlog("live") == 0
    assert await s.backlog() == 0  # admission: the most caught-up group's
    assert (await s.stats()).backlog == 3  # dashboards: the worst group's
    zs = await s.read("zombie", "c", 10)
    assert [e.trajectory_id for e in zs] == [f"t{i}" for i in t[2:5]]  # its newest 3
    assert (await s.stats()).overflow_dropped == 2
    by = {g.group: g for g in await s.group_stats()}
    assert by["zombie"].overflow_dropped == 2 and by["live"].overflow_dropped == 0
    # full of delivered-unacked entries: the oldest pending one goes
    assert await s.publish(traj(t[5]))
    assert await s.ack("zombie", [zs[0].entry_id]) == 0  # t[2] was dropped for it
    assert await s.ack("zombie", [e.entry_id for e in zs[1:]]) == 2
    assert [e.trajectory_id for e in await s.read("zombie", "c", 10)] == [f"t{t[5]}"]
    assert [e.trajectory_id for e in await s.read("live", "c", 10)] == [f"t{t[5]}"]


async def test_lease_expiry_redelivers_to_another_consumer(make):
    s = make(lease_seconds=0.3)
    await s.create_group("job")
    await s.publish(traj(1))
    first = await s.read("job", "learner-a", 5)
    assert [e.delivery_count for e in first] == [1]
    assert await s.read("job", "learner-b", 5) == []  # leased to a
    await asyncio.sleep(0.4)
    again = await s.read("job", "learner-b", 5)
    assert [(e.trajectory_id, e.delivery_count) for e in again] == [("t1", 2)]
    assert await s.ack("job", [again[0].entry_id]) == 1
    await asyncio.sleep(0.4)
    assert await s.read("job", "learner-c", 5) == []


async def test_nack_requeues_then_dead_letters(make):
    s = make(max_deliveries=2, lease_seconds=60)
    await s.create_group("job")
    await s.publish(traj(1))
    e1 = (await s.read("job", "c", 1))[0]
    assert await s.nack("job", [e1.entry_id]) == (1, 0)
    e2 = (await s.read("job", "c2", 1))[0]
    assert (e2.trajectory_id, e2.delivery_count) == ("t1", 2)
    assert await s.nack("job", [e2.entry_id]) == (0, 1)
    assert await s.read("job", "c", 1) == []
    st = await s.stats()
    assert st.dead_lettered == 1 and st.backlog == 0


async def test_release_undelivered_rolls_back_count(make):
    s = make(max_deliveries=1)
    await s.create_group("job")
    await s.publish(traj(1))
    e = (await s.read("job", "c", 1))[0]
    assert await s.nack("job", [e.entry_id], delivered=False) == (1, 0)  # never dead-lettered
    again = (await s.read("job", "c2", 1))[0]
    assert (again.trajectory_id, again.delivery_count) == ("t1", 1)


async def test_groups_are_independent(make):
    s = make()
    t = one_shard(s, 3)  # publish order is read order within a shard
    await s.publish(traj(t[0]))
    await s.create_group("a")
    await s.publish(traj(t[1]))
    await s.create_group("late", from_latest=True)
    await s.publish(traj(t[2]))
    assert [e.trajectory_id for e in await s.read("a", "c", 10)] == [f"t{i}" for i in t]
    assert [e.trajectory_id for e in await s.read("late", "c", 10)] == [f"t{t[2]}"]
    assert await s.group_backlog("a") == 3 and await s.group_backlog("late") == 1


@pytest.mark.parametrize("policy", list(StalePolicy))
async def test_staleness_filter(make, policy):
    s = make()
    await s.create_group("job")
    # learner at version 5, max_lag 2: fresh = min version >= 3
    specs = {"fresh": (4, 5), "edge": (3,), "stale": (1, 5), "old": (0,)}
    for i, (name, versions) in enumerate(specs.items()):
        await s.publish(make_trajectory(name, versions=versions, seed=i))
    got = await s.pull("job", "c", 10, learner_version=5, max_lag=2, policy=policy)
    st = await s.stats()
    ids = {e.trajectory_id: e.masked for e in got}
    if policy == StalePolicy.MASK:
        assert ids == {"fresh": False, "edge": False, "stale": True, "old": True}
        assert (st.stale_masked, st.stale_dropped, st.stale_recycled) == (2, 0, 0)
    else:
        assert ids == {"fresh": False, "edge": False}
        assert await s.group_backlog("job") == 2  # stale ones were acked
        if policy == StalePolicy.DROP:
            assert (st.stale_dropped, st.stale_recycled) == (2, 0)
            assert await s.take_recycled(10) == []
        else:
            assert (st.stale_dropped, st.stale_recycled) == (0, 2)
            rec = await s.take_recycled(10)
            assert sorted(t.trajectory_id for t in rec) == ["old", "stale"]
            assert await s.take_recycled(10) == []


async def test_blocking_read_wakes_on_publish(make):
    s = make()
    await s.create_group("job")

    async def later():
        await asyncio.sleep(0.2)
        await s.publish(traj(7))

    task = asyncio.create_task(later())
    got = await s.read("job", "c", 1, block_ms=3000)
    await task
    assert [e.trajectory_id for e in got] == ["t7"]


async def test_reopen_keeps_pending_and_unconsumed(make_durable):
    make = make_durable
    s = make(lease_seconds=0.2)
    await s.create_group("job")
    for i in range(4):
        await s.publish(traj(i))
    got = await s.read("job", "c", 2)
    await s.ack("job", [got[0].entry_id])
    await s.close()
    s2 = make(lease_seconds=0.2)
    await asyncio.sleep(0.3)
    assert not await s2.publish(traj(0))  # still deduplicated
    again = await s2.read("job", "c2", 10)
    unread = {f"t{i}" for i in range(4)} - {e.trajectory_id for e in got}
    assert sorted((e.trajectory_id, e.delivery_count) for e in again) == sorted(
        [(got[1].trajectory_id, 2), *((t, 1) for t in unread)])
    assert (await s2.stats()).published == 4


async def test_retention_trims_only_acked(make):
    s = make(retention_seconds=0)
    await s.create_group("job")
    for i in range(3):
        await s.publish(traj(i))
    got = await s.read("job", "c", 3)
    await asyncio.sleep(0.01)  # past the (zero) retention window, in ms-resolution ids too
    await s.ack("job", [got[0].entry_id, got[1].entry_id])
    await s.create_group("replay")  # starts at the oldest retained entry
    assert [e.trajectory_id for e in await s.read("replay", "c", 10)] == ["t2"]
