"""The store's dashboard facts, every store (embedded, journaled, Redis Streams on the real
server and on a real Redis Cluster; several shards below): output tokens per version of unconsumed entries, per-group backlog, pending and
redeliveries, and per-version token counts on delivered entries."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from _redis_support import delete_prefix
from rollout_gateway.core.staleness import StalePolicy
from rollout_gateway.store.base import StoreConfig, parse_version_tokens, version_tokens
from rollout_gateway.store.factory import store_from_url
from doubles.trajectories import make_trajectory

pytestmark = pytest.mark.integration


@pytest.fixture(params=["memory", "journal", "redis", "cluster"])
async def make(request, tmp_path):
    prefix = f"test-lag-{uuid.uuid4().hex[:10]}"
    url = {"memory": "memory://", "journal": f"memory://?journal={tmp_path / 'j.db'}",
           "redis": f"redis://127.0.0.1:6379/0?prefix={prefix}",
           "cluster": None}[request.param]
    if url is None:
        # one shard: the order-dependent checks below hold (several: the test at the end)
        url = f"{request.getfixturevalue('redis_cluster').url}/?prefix={prefix}"
    opened = []

    def factory(**cfg):
        s = store_from_url(url, StoreConfig(**cfg))
        opened.append(s)
        return s

    yield factory
    for s in opened:
        await s.close()
    if request.param == "redis":
        await delete_prefix(prefix)


# four trajectories: (versions of their segments, output tokens)
SPECS = [((0,), 10), ((0, 1), 12), ((1,), 6), ((1, 2), 9)]


def _trajs():
    return [make_trajectory(f"t{i}", versions=v, num_tokens=n, seed=i)
            for i, (v, n) in enumerate(SPECS)]


def _by_version(trajs) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in trajs:
        for v in t.tokens.policy_version.tolist():
            out[v] = out.get(v, 0) + 1
    return out


def test_version_tokens_roundtrip():
    t = make_trajectory("x", versions=(3, 5), num_tokens=10)
    assert version_tokens(t) == "3:5;5:5"
    assert parse_version_tokens(version_tokens(t)) == {3: 5, 5: 5}
    assert version_tokens(make_trajectory("e", num_tokens=0)) == ""


async def test_unconsumed_tokens_and_group_stats(make):
    s = make(lease_seconds=0.3)
    trajs = _trajs()
    for t in trajs:
        assert await s.publish(t)
    # no group yet: everything is unconsumed
    un = await s.unconsumed_tokens()
    assert un.tokens_by_version == _by_version(trajs) and un.entries == 4 and not un.truncated
    assert await s.group_stats() == []
    await s.create_group("a")
    await s.create_group("b")
    got = await s.read("a", "c1", 2)
    assert [e.trajectory_id for e in got] == ["t0", "t1"]
    # delivered entries carry their tokens per version
    assert [e.tokens_by_version() for e in got] == [{0: 10}, {0: 6, 1: 6}]
    await s.ack("a", [got[0].entry_id])
    # b has consumed nothing: still all four
    assert (await s.unconsumed_tokens()).entries == 4
    bgot = await s.read("b", "c1", 10)
    await s.ack("b", [e.entry_id for e in bgot])
    # now only a's: t1 pending, t2 and t3 never delivered
    un = await s.unconsumed_tokens()
    assert un.tokens_by_version == _by_version(trajs[1:]) and un.entries == 3
    stats = {g.group: (g.backlog, g.pending, g.redelivered) for g in await s.group_stats()}
    assert stats == {"a": (3, 1, 0), "b": (0, 0, 0)}
    # a's lease on t1 expires: the next pull redelivers it (counted for a only)
    await asyncio.sleep(0.4)
    again = await s.pull("a", "c2", 1, learner_version=2, max_lag=None,
                         policy=StalePolicy.DROP)
    assert [(e.trajectory_id, e.delivery_count) for e in again] == [("t1", 2)]
    stats = {g.group: (g.backlog, g.pending, g.redelivered) for g in await s.group_stats()}
    assert stats == {"a": (3, 1, 1), "b": (0, 0, 0)}
    # the scan limit truncates, and says so
    un = await s.unconsumed_tokens(limit=2)
    assert un.entries == 2 and un.truncated
    assert un.tokens_by_version == _by_version(trajs[1:3])


async def test_redis_facts_stream_is_trimmed_with_the_entries():
    import redis.asyncio as aioredis

    prefix = f"test-lag-{uuid.uuid4().hex[:10]}"
    s = store_from_url(f"redis://127.0.0.1:6379/0?prefix={prefix}",
                       StoreConfig(retention_seconds=0))
    r = aioredis.Redis()
    try:
        await s.create_group("a")
        for t in _trajs():
            await s.publish(t)
        assert await r.xlen(f"{prefix}:facts") == await r.xlen(f"{prefix}:stream") == 4
        got = await s.read("a", "c", 3)
        await s.ack("a", [e.entry_id for e in got])
        assert await r.xlen(f"{prefix}:facts") == await r.xlen(f"{prefix}:stream") == 1
        un = await s.unconsumed_tokens()
        assert un.entries == 1 and un.tokens_by_version == _by_version(_trajs()[3:])
    finally:
        await s.close()
        await r.aclose()
        await delete_prefix(prefix)


@pytest.mark.parametrize("where", ["redis", "cluster"])
async def test_facts_add_up_over_shards(request, where):
    """Three shards: unconsumed tokens, backlogs and pending counts are the sums over the
    shards (an entry counts in the shard it went to, whichever that is)."""
    prefix = f"test-lag-{uuid.uuid4().hex[:10]}"
    base = (request.getfixturevalue("redis_cluster").url + "/" if where == "cluster"
            else "redis://127.0.0.1:6379/0")
    s = store_from_url(f"{base}?prefix={prefix}&shards=3")
    try:
        trajs = [make_trajectory(f"u{i}", versions=(i % 3,), num_tokens=5 + i, seed=i)
                 for i in range(12)]
        assert len({s.layout.shard_of(t.trajectory_id) for t in trajs}) == 3
        for t in trajs:
            assert await s.publish(t)
        un = await s.unconsumed_tokens()
        assert un.tokens_by_version == _by_version(trajs) and un.entries == 12
        await s.create_group("a")
        got = await s.read("a", "c", 5)
        assert len({e.entry_id.split("/")[0] for e in got}) >= 2  # read over the shards
        await s.ack("a", [e.entry_id for e in got[:2]])
        rest = [t for t in trajs if t.trajectory_id not in {e.trajectory_id for e in got[:2]}]
        un = await s.unconsumed_tokens()
        assert un.tokens_by_version == _by_version(rest) and un.entries == 10
        [g] = await s.group_stats()
        assert (g.group, g.backlog, g.pending) == ("a", 10, 3)
        assert await s.backlog() == 10 and (await s.stats()).published == 12
        un = await s.unconsumed_tokens(limit=4)
        assert un.entries == 4 and un.truncated
    finally:
        await s.close()
        if where == "redis":
            await delete_prefix(prefix)
