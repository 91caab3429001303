"""The gatekeeper: admission across replicas sharing a registry, and recycled samples
waiting for a slot (embedded store and registry; no I/O)."""

from __future__ import annotations

import asyncio

import pytest

from rollout_gateway.core.admission import AdmissionConfig
from rollout_gateway.errors import ResourceExhausted
from rollout_gateway.registry import create_registry
from rollout_gateway.rollouts.gatekeeper import Gatekeeper
from rollout_gateway.store.factory import store_from_url


def pair(**cfg):
    config = AdmissionConfig(max_staleness=0, batch_size=3, **cfg)
    store, registry = store_from_url("memory://"), create_registry("memory://")
    return (Gatekeeper(config, store, registry, "a"), Gatekeeper(config, store, registry, "b"),
            registry)


async def test_admissions_count_the_other_replicas_and_releases_are_reported():
    a, b, registry = pair()
    a.start()
    b.start()
    try:
        await a.admit(2)
        assert await registry.running_elsewhere("b") == 2  # reported before it returns
        with pytest.raises(ResourceExhausted) as ei:
            await b.admit(2)
        assert ei.value.details["staleness_used"] == 2
        await b.admit(1)
        a.release_failed(1)
        for _ in range(100):  # the background reporter catches up
            if await registry.running_elsewhere("b") == 1:
                break
            await asyncio.sleep(0.01)
        assert await registry.running_elsewhere("b") == 1
        await b.admit(1)
    finally:
        await a.stop()
        await b.stop()
    assert await registry.running_elsewhere("nobody") == 0  # stopped replicas withdraw


async def test_replica_id_comes_from_the_config_or_the_host_and_pid():
    store, registry = store_from_url("memory://"), create_registry("memory://")
    assert Gatekeeper(AdmissionConfig(replica_id="gw-7"), store, registry).replica_id == "gw-7"
    assert ":" in Gatekeeper(AdmissionConfig(), store, registry).replica_id


async def test_a_recycled_sample_waits_for_a_slot_then_takes_it_before_new_work():
    a, b, _ = pair(recycle_wait_s=10)
    await a.admit(3)
    a.release_failed(1)  # as judge() does for the recycled sample
    await a._report()  # (what the background reporter does)
    await b.admit(1)  # another replica takes the slot first
    waiter = asyncio.create_task(a.readmit_recycled("t:0"))
    for _ in range(500):  # until it waits (an event of the gatekeeper's), not a set delay
        if a.ctl.stats.recycle_waiting or waiter.done():
            break
        await asyncio.sleep(0.01)
    assert not waiter.done() and a.ctl.stats.recycle_waiting == 1
    b.release_failed(1)
    await b._report()
    with pytest.raises(ResourceExhausted):  # the free slot is kept for the waiter
        await a.admit(1)
    await asyncio.wait_for(waiter, 5)
    assert a.running == 3 and a.ctl.stats.recycle_waiting == 0


async def test_a_recycled_sample_with_no_slot_in_time_fails_loudly_and_is_counted():
    a, _, _ = pair(recycle_wait_s=0.2)
    await a.admit(3)
    a.release_failed(1)
    await a.admit(1)
    with pytest.raises(ResourceExhausted) as ei:
        await a.readmit_recycled("t:1")
    assert ei.value.details["recycled"] is True and ei.value.details["trajectory_id"] == "t:1"
    assert "t:1" in ei.value.message
    st = a.ctl.stats
    assert (st.recycle_refused, st.recycle_waiting, st.running) == (1, 0, 3)


async def test_judging_without_a_learner_version_releases_the_slot_and_raises():
    from rollout_gateway.errors import Unavailable
    from doubles.trajectories import make_trajectory

    a, _, registry = pair()
    await a.admit(1)

    async def down() -> int:
        raise Unavailable("registry down")

    registry.learner_version = down
    with pytest.raises(Unavailable):
        await a.judge(make_trajectory("t"), 0)
    assert (a.running, a.ctl.stats.failed) == (0, 1)
