"""Redis key names (rollout_gateway.store.keys) and Redis Cluster URLs (rollout_proto.redis_url):
pure code, no server."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from rollout_gateway.errors import InvalidArgument
from rollout_gateway.store.factory import store_from_url
from rollout_gateway.store.keys import MAX_SHARDS, KeyLayout
from rollout_proto.codec import stream_entry_id
from rollout_proto.redis_url import is_cluster_url, parse_cluster_url


def test_single_node_one_shard_keeps_its_key_names():
    k = KeyLayout("job")
    assert k.shard_key(0, "stream") == "job:stream" and k.key("reg:learner") == "job:reg:learner"
    assert k.shard_key(0, "id:t1") == "job:id:t1" and k.shard_of("anything") == 0


@pytest.mark.parametrize("shards", [1, 2, 3, 6, 16, MAX_SHARDS])
def test_shard_keys_share_a_slot_and_spread_evenly(shards):
    k = KeyLayout("job", shards=shards, cluster=True)
    slots = []
    for s in range(shards):
        names = [k.shard_key(s, n) for n in ("stream", "groups", "acked", "counters", "facts",
                                             "id:some-trajectory")]
        assert all(n.startswith("job:") for n in names)
        assert len({key_slot(n.encode()) for n in names}) == 1  # one slot per shard
        slots.append(key_slot(names[0].encode()))
    # shard s in the s-th of `shards` equal ranges: each master of an even split gets its share
    assert all(s * 16384 // shards <= slot < (s + 1) * 16384 // shards
               for s, slot in enumerate(slots))


def test_home_and_tagged_keys():
    k = KeyLayout("job", cluster=True)
    home = [k.key(n) for n in ("reg:learner", "reg:events", "recycled")]
    assert len({key_slot(n.encode()) for n in home}) == 1
    a, b = k.tagged("sess:1", "turns"), k.tagged("sess:1", "lock")
    assert key_slot(a.encode()) == key_slot(b.encode()) and a.startswith("job:")
    with pytest.raises(ValueError):
        k.tagged("x}y", "n")
    with pytest.raises(ValueError):
        KeyLayout("a{b")
    with pytest.raises(ValueError):
        KeyLayout("a", shards=0)


def test_shard_of_is_stable_and_uses_every_shard():
    k = KeyLayout("job", shards=3)
    seen = {k.shard_of(f"t{i}") for i in range(100)}
    assert seen == {0, 1, 2} and k.shard_of("t7") == KeyLayout("other", shards=3).shard_of("t7")


def test_stream_entry_id_drops_the_shard():
    assert stream_entry_id("2/1700000000000-3") == "1700000000000-3"
    assert stream_entry_id("1700000000000-3") == "1700000000000-3"


def test_cluster_urls():
    t = parse_cluster_url("redis+cluster://u:p%40w@10.0.0.1:7000,[::1]:7001/?prefix=x")
    assert t.nodes == [("10.0.0.1", 7000), ("::1", 7001)] and not t.ssl
    assert (t.username, t.password, t.query) == ("u", "p@w", {"prefix": "x"})
    assert parse_cluster_url("rediss+cluster://h:1").ssl
    assert is_cluster_url("redis+cluster://h:1") and not is_cluster_url("redis://h:1/0")
    for bad in ("redis+cluster://h", "redis+cluster://h:99999", "redis+cluster://h:1/3",
                "redis://h:1"):
        with pytest.raises(ValueError):
            parse_cluster_url(bad)


@pytest.mark.parametrize("url", ["redis+cluster://h/?prefix=x", "redis+cluster://h:1/2",
                                 "redis+cluster://h:1/?bogus=1", "redis://h:1/0?shards=0",
                                 "redis://h:1/0?shards=x", "redis+cluster://h:1/?shards=257",
                                 "redis://h:1/0?prefix=a{b}"])
def test_bad_store_urls_are_invalid_argument(url):
    with pytest.raises(InvalidArgument):
        store_from_url(url)


def test_store_url_shards_win_over_the_setting():
    import asyncio

    s = store_from_url("redis+cluster://127.0.0.1:1/?prefix=x&shards=4", shards=2)
    t = store_from_url("redis://127.0.0.1:1/0?prefix=x", shards=2)
    assert (s.shards, s.cluster, t.shards, t.cluster) == (4, True, 2, False)
    assert s.reference_key("3/1-0") == s.layout.shard_key(3, "stream")
    with pytest.raises(InvalidArgument):
        s.reference_key("4/1-0")
    asyncio.run(s.close())
    asyncio.run(t.close())
