"""Lease renewal over real loopback gRPC, against both stores: a learner holding
deliveries past lease_seconds keeps them (background renewal, or ``extend()``) instead of
having them redelivered to another consumer; without renewal they are redelivered."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from _redis_support import delete_prefix
from learner_client.client import AsyncTrajectoryClient
from rollout_gateway.store.base import StoreConfig
from rollout_gateway.store.factory import store_from_url
from doubles.control_plane import InProcessControlPlane
from rollout_gateway.transport.server import GrpcServer
from doubles.trajectories import make_trajectory

pytestmark = pytest.mark.integration

LEASE = 1.0


@pytest.fixture(params=["memory", "redis", "cluster"])
async def served(request):
    prefix = f"test-{uuid.uuid4().hex[:10]}"
    url = {"memory": "memory://", "redis": f"redis://127.0.0.1:6379/0?prefix={prefix}",
           "cluster": None}[request.param]
    if url is None:  # 3 shards on a real Redis Cluster
        url = f"{request.getfixturevalue('redis_cluster').url}/?prefix={prefix}&shards=3"
    store = store_from_url(url, StoreConfig(lease_seconds=LEASE))
    server = GrpcServer(store, InProcessControlPlane(["e0"], version=0), port=0, poll_ms=50)
    port = await server.start()
    await server.set_serving(True)
    await store.create_group("job")
    for i in range(4):
        await store.publish(make_trajectory(f"t{i}", seed=i))
    yield store, f"127.0.0.1:{port}"
    await server.stop(0)
    await store.close()
    if request.param == "redis":
        await delete_prefix(prefix)


async def test_held_deliveries_are_renewed_in_the_background(served):
    store, target = served
    async with AsyncTrajectoryClient(target, "job", "slow-learner") as slow, \
            AsyncTrajectoryClient(target, "job", "other") as other:
        got = await slow.pull(4, timeout=5)
        assert len(got) == 4
        await asyncio.sleep(3.5 * LEASE)  # a long optimizer step: 3.5 leases
        assert slow.lease_seconds == LEASE
        assert await other.pull(4, timeout=0.5) == []  # nothing was redelivered
        assert await slow.ack(got) == 4
        assert not slow.leases_lost
    assert (await store.stats()).redelivered == 0


async def test_explicit_extend_and_without_renewal_redelivery(served):
    store, target = served
    async with AsyncTrajectoryClient(target, "job", "a", auto_extend=False) as a, \
            AsyncTrajectoryClient(target, "job", "b", auto_extend=False) as b:
        got = await a.pull(4, timeout=5)
        assert len(got) == 4
        keep, let_go = got[:2], got[2:]
        for _ in range(3):
            await asyncio.sleep(0.5 * LEASE)
            assert await a.extend(keep) == 2
        # the two not extended expired and go to another consumer, as redeliveries
        again = await b.pull(2, timeout=3)
        assert sorted(r.entry_id for r in again) == sorted(r.entry_id for r in let_go)
        assert all(r.delivery_count == 2 for r in again)
        assert await a.extend(keep) == 2  # still a's
        # leases that moved to b cannot be extended by a: reported lost
        assert await a.extend(let_go) == 0
        assert sorted(a.leases_lost) == sorted(r.entry_id for r in let_go)
        assert await a.ack(keep) == 2 and await b.ack(again) == 2
