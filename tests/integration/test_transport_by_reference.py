"""Pull by reference: the learner reads trajectory bytes from Redis itself, gRPC carries
references, credit, staleness decisions, leases and acks (real Redis, real loopback gRPC)."""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
import pytest
import redis
from _redis_support import delete_prefix
from test_transport_grpc import raw_pull

from learner_client.client import AsyncTrajectoryClient, TrajectoryClient
from learner_client.errors import TrajectoryClientError
from learner_client.wire import Rollout
from rollout_gateway.store.base import StoreConfig
from rollout_gateway.store.factory import store_from_url
from doubles.control_plane import InProcessControlPlane
from rollout_gateway.transport.server import GrpcServer
from doubles.trajectories import make_trajectory
from rollout_proto import codec
from rollout_proto.rollout.v1 import service_pb2 as spb

pytestmark = pytest.mark.integration

REDIS = "redis://127.0.0.1:6379/0"


async def _serve(url: str, **config):
    store = store_from_url(url, StoreConfig(**{"lease_seconds": 30, **config}))
    server = GrpcServer(store, InProcessControlPlane(["e0"], version=0), port=0, poll_ms=50)
    port = await server.start()
    await server.set_serving(True)
    await store.create_group("job")
    return store, server, f"127.0.0.1:{port}"


@pytest.fixture
async def redis_gateway():
    prefix = f"test-ref-{uuid.uuid4().hex[:10]}"
    made = []

    async def make(**config):
        store, server, target = await _serve(f"{REDIS}?prefix={prefix}", **config)
        made.append((store, server))
        return store, target

    yield make, prefix
    for store, server in made:
        await server.stop(0)
        await store.close()
    await delete_prefix(prefix)


@pytest.fixture
async def memory_gateway():
    store, server, target = await _serve("memory://")
    yield store, target
    await server.stop(0)
    await store.close()


async def publish(store, n, **kw):
    for i in range(n):
        await store.publish(make_trajectory(f"t{i}", seed=i, **kw))


def _same(a: Rollout, b: Rollout) -> None:
    for name in Rollout.__slots__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert x.tobytes() == y.tobytes(), name
        elif isinstance(x, dict) and x and isinstance(next(iter(x.values())), np.ndarray):
            assert x.keys() == y.keys() and all(x[k].tobytes() == y[k].tobytes() for k in x)
        else:
            assert x == y, name


async def test_by_reference_gives_the_same_trajectories_as_bytes(redis_gateway):
    make, _ = redis_gateway
    store, target = await make()
    await publish(store, 6, num_layers=4, top_k=2, versions=(0, 1), old_logprobs=True)
    async with AsyncTrajectoryClient(target, "job", "bytes") as by_bytes:
        await by_bytes.create_group()
        plain = await by_bytes.pull(6, timeout=2.0)
    await store.create_group("refs")
    async with AsyncTrajectoryClient(target, "refs", "refs", store_url=REDIS) as by_ref:
        got = await by_ref.pull(6, timeout=2.0)
        assert by_ref.fetched == 6  # every byte came from Redis, none over gRPC
        assert await by_ref.ack(got) == 6
        assert (await by_ref.status()).store.group_backlog == 0
    assert len(plain) == len(got) == 6
    for a, b in zip(sorted(plain, key=lambda r: r.trajectory_id),
                    sorted(got, key=lambda r: r.trajectory_id)):
        _same(a, b)
        assert not b.token_ids.flags.writeable  # read-only views, like over gRPC


async def test_the_stream_carries_references_not_bytes(redis_gateway):
    make, prefix = redis_gateway
    store, target = await make()
    await publish(store, 4, num_layers=2)  # the 4th: raw_pull's barrier delivery
    stored = await store.lookup(["t0", "t1", "t2"])
    batches, _ = await raw_pull(target, "job", [spb.CreditGrant(trajectories=3)], 3,
                                payload=spb.PAYLOAD_REFERENCE)
    ds = [d for b in batches for d in b.deliveries]
    assert len(ds) == 3 and not any(d.HasField("trajectory") for d in ds)
    for d in ds:
        ref = d.reference
        assert (ref.kind, ref.key) == (codec.REDIS_STREAM, f"{prefix}:stream")
        assert ref.size == len(stored[ref.trajectory_id]) and ref.num_tokens == 8 + 16
        [(_, fields)] = redis.Redis().xrange(ref.key, d.entry_id, d.entry_id)
        assert fields[b"d"] == stored[ref.trajectory_id]  # the reference names those bytes


async def test_nack_and_expired_lease_redeliver_by_reference(redis_gateway):
    make, _ = redis_gateway
    store, target = await make(lease_seconds=0.5)
    await publish(store, 2)
    async with AsyncTrajectoryClient(target, "job", "a", store_url=REDIS,
                                     auto_extend=False) as a, \
            AsyncTrajectoryClient(target, "job", "b", store_url=REDIS, by_reference=True,
                                  auto_extend=False) as b:
        first = await a.pull(2, timeout=2.0)
        assert sorted(r.trajectory_id for r in first) == ["t0", "t1"]
        assert await a.nack([first[0]]) == (1, 0)
        [again] = await a.pull(1, timeout=2.0)
        assert (again.trajectory_id, again.delivery_count) == (first[0].trajectory_id, 2)
        await a.ack([again])
        # a never acks first[1]: its lease expires and b gets it, counted as a redelivery
        await asyncio.sleep(0.7)
        [late] = await b.pull(1, timeout=2.0)
        assert (late.trajectory_id, late.delivery_count) == (first[1].trajectory_id, 2)
        assert await b.ack([late]) == 1
        assert (await b.status()).store.group_backlog == 0


@pytest.mark.parametrize("policy", ["drop", "mask", "recycle"])
async def test_staleness_is_decided_by_the_server(redis_gateway, policy):
    make, _ = redis_gateway
    store, target = await make()
    for i, (tid, v) in enumerate({"fresh": (9,), "stale": (2,)}.items()):
        await store.publish(make_trajectory(tid, versions=v, seed=i))
    async with AsyncTrajectoryClient(target, "job", learner_version=10, max_lag=3,
                                     stale_policy=policy, store_url=REDIS) as c:
        got = await c.pull(2, timeout=1.0)
        st = (await c.status()).store
        assert c.fetched == len(got)
    seen = {r.trajectory_id: r.masked for r in got}
    if policy == "mask":
        assert seen == {"fresh": False, "stale": True} and st.stale_masked == 1
    else:  # dropped on the server: never referenced, never fetched
        assert seen == {"fresh": False}
        if policy == "drop":
            assert st.stale_dropped == 1
        else:  # the gateway read the payload it had skipped, to re-generate the prompt
            assert st.stale_recycled == 1
            [again] = await store.take_recycled(5)
            assert again.trajectory_id == "stale" and len(again.prompt_token_ids) == 8


async def test_entry_deleted_before_the_fetch_is_nacked_and_reported(redis_gateway, caplog):
    make, _ = redis_gateway
    store, target = await make()
    await publish(store, 3)
    r = redis.Redis()
    async with AsyncTrajectoryClient(target, "job", store_url=REDIS) as c:
        fetch = c._store.fetch

        def trim_first(refs):  # the entry goes between the reference and the fetch
            r.xdel(refs[0].key, refs[0].entry_id)
            return fetch(refs)

        c._store.fetch = trim_first
        got = await c.pull(3, timeout=1.0)
        c._store.fetch = fetch
        assert len(got) == 2 and len(c.missing) == 1
        assert c.missing[0] not in {x.entry_id for x in got}
        assert "no longer in the store" in caplog.text and c.missing[0] in caplog.text
        await c.ack(got)
        # the lost entry is not delivered again, and the client is not waiting on it
        assert await c.pull(1, timeout=0.5) == []
        await store.publish(make_trajectory("t9", seed=9))
        [nxt] = await c.pull(1, timeout=2.0)
        assert nxt.trajectory_id == "t9"
        await c.ack([nxt])
        # the gateway saw the deleted entry leave the group: the backlog stays exact
        assert (await c.status()).store.group_backlog == 0
        assert "deleted from the stream" in caplog.text
    r.close()


async def test_store_url_of_another_redis_db_is_refused_clearly(redis_gateway):
    make, _ = redis_gateway
    store, target = await make()
    await publish(store, 1)
    async with AsyncTrajectoryClient(target, "job", store_url="redis://127.0.0.1:6379/15",
                                     backoff_max=0.1) as c:
        with pytest.raises(TrajectoryClientError) as info:
            await c.pull(1, timeout=2.0)
        assert info.value.code == "FAILED_PRECONDITION" and "no stream" in info.value.message


async def test_embedded_store_falls_back_to_bytes_or_refuses(memory_gateway):
    store, target = memory_gateway
    await publish(store, 3)  # the 3rd: raw_pull's barrier delivery
    async with AsyncTrajectoryClient(target, "job", store_url=REDIS) as c:  # prefer
        got = await c.pull(1, timeout=1.0)
        assert [r.trajectory_id for r in got] == ["t0"] and c.fetched == 0
        await c.ack(got)
    async with AsyncTrajectoryClient(target, "job", store_url=REDIS, by_reference=True,
                                     backoff_max=0.1) as c:  # demanded
        with pytest.raises(TrajectoryClientError) as info:
            await c.pull(1, timeout=2.0)
        assert info.value.code == "FAILED_PRECONDITION"
        assert "cannot serve references" in info.value.message
    batches, _ = await raw_pull(target, "job", [spb.CreditGrant(trajectories=1)], 1,
                                payload=spb.PAYLOAD_PREFER_REFERENCE)
    [d] = [d for b in batches for d in b.deliveries]
    assert d.HasField("trajectory") and not d.HasField("reference")


def test_by_reference_needs_a_store_url():
    with pytest.raises(ValueError, match="store_url"):
        AsyncTrajectoryClient("127.0.0.1:1", "job", by_reference=True)
    with pytest.raises(ValueError, match="redis://"):
        AsyncTrajectoryClient("127.0.0.1:1", "job", store_url="memory://")


async def test_blocking_client_by_reference(redis_gateway):
    make, prefix = redis_gateway
    store, target = await make()
    await publish(store, 2)

    def learner():
        # the gateway's own --store URL works as the learner's store_url
        with TrajectoryClient(target, "job", "sync", store_url=f"{REDIS}?prefix={prefix}",
                              by_reference=True) as c:
            got = c.pull(2, timeout=2.0)
            assert c.ack(got) == 2
            return sorted(r.trajectory_id for r in got), c.fetched

    assert await asyncio.to_thread(learner) == (["t0", "t1"], 2)


async def test_by_reference_from_a_sharded_redis_cluster(redis_cluster):
    """A store of 3 shards on a Redis Cluster: each reference names its shard's stream, the
    learner reads each from that stream's master (entries big enough to be skipped, not
    read, by the gateway's lease), and gets what it would over gRPC."""
    url = f"{redis_cluster.url}/?prefix=test-ref-{uuid.uuid4().hex[:10]}&shards=3"
    store, server, target = await _serve(url)
    try:
        await publish(store, 12, num_layers=48, top_k=8, num_tokens=256)
        async with AsyncTrajectoryClient(target, "job", "bytes") as by_bytes:
            plain = await by_bytes.pull(12, timeout=2.0)
        await store.create_group("refs")
        async with AsyncTrajectoryClient(target, "refs", "refs", store_url=url,
                                         by_reference=True) as by_ref:
            got = await by_ref.pull(12, timeout=2.0)
            assert by_ref.fetched == 12
            assert {r.entry_id.split("/")[0] for r in got} == {"0", "1", "2"}
            assert await by_ref.ack(got) == 12
            assert (await by_ref.status()).store.group_backlog == 0
        assert len(plain) == 12
        for a, b in zip(sorted(plain, key=lambda r: r.trajectory_id),
                        sorted(got, key=lambda r: r.trajectory_id)):
            _same(a, b)
        assert min(map(len, (await store.lookup([r.trajectory_id for r in got])).values())) \
            > 64 << 10  # leased without reading the bytes (rollout_proto.resp skips them)
    finally:
        await server.stop(0)
        await store.close()
