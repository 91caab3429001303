"""Admission control (AReaL-style bound on unconsumed + in-flight work) and the stale
policy, through the real gateway process and a real engine."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from _gateway_support import GatewayProcess, redis_urls

from rollout_gateway.store.factory import store_from_url
from doubles.trajectories import make_trajectory

pytestmark = pytest.mark.integration


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} missing")


def post(url: str, n: int, max_new_tokens: int = 3) -> httpx.Response:
    return httpx.post(url + "/v1/rollouts", timeout=60, json={
        "input_ids": [3, 4], "n": n,
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}})


def wait_metric(url: str, name: str, value: float, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while (got := metric(url, name)) != value:
        assert time.monotonic() < deadline, f"{name} = {got}, waited for {value}"
        time.sleep(0.05)


def on_store(url: str, fn):
    """Run ``await fn(store)`` against the gateway's Redis store, as a learner would."""
    async def go():
        store = store_from_url(url)
        try:
            return await fn(store)
        finally:
            await store.close()
    return asyncio.run(go())


async def _consume_all(store) -> int:
    got = await store.read("learner", "c0", 100)
    return await store.ack("learner", [e.entry_id for e in got])


def test_admission_bound_refuses_with_429_and_stale_trajectories_are_counted(engine):
    env = {"ROLLOUT_GATEWAY_ADMISSION__BATCH_SIZE": "2",
           "ROLLOUT_GATEWAY_ADMISSION__MAX_STALENESS": "0",
           "ROLLOUT_GATEWAY_ADMISSION__STALE_POLICY": "recycle",
           "ROLLOUT_GATEWAY_ADMISSION__MAX_RECYCLES": "1"}
    with GatewayProcess({"e0": engine.url}, env=env) as gw:
        r = post(gw.url, 3)  # (0 + 1) * 2 = 2 slots
        assert r.status_code == 429, r.text
        assert r.json()["error"]["details"]["binding"] == "staleness"
        assert post(gw.url, 2).status_code == 200
        assert metric(gw.url, "rollout_gateway_store_backlog") == 2
        r = post(gw.url, 1)  # the learner consumed nothing: the bound holds
        assert r.status_code == 429 and "admission control" in r.json()["error"]["message"]
        assert metric(gw.url, "rollout_gateway_admission_refused_total") == 4


def test_stale_trajectories_are_dropped_and_counted(engine):
    env = {"ROLLOUT_GATEWAY_ADMISSION__MAX_STALENESS": "1",
           "ROLLOUT_GATEWAY_ADMISSION__STALE_POLICY": "drop"}
    with GatewayProcess({"e0": engine.url}, env=env) as gw:
        # the learner moves to version 2 (announce only: the engine keeps version 0)
        r = httpx.post(gw.url + "/v1/weights", json={"version": 2}, timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "succeeded"
        assert httpx.get(gw.url + "/v1/versions").json()["learner_version"] == 2
        r = post(gw.url, 2)
        assert r.status_code == 200
        for t in r.json()["trajectories"]:
            assert t["metadata"]["stale_verdict"] == "drop" and t["metadata"]["stale_max_lag"] == "2"
        assert metric(gw.url, "rollout_gateway_admission_stale_dropped_total") == 2
        assert 'rollout_gateway_trajectory_lag_total{lag="2"} 2' in httpx.get(gw.url + "/metrics").text
        assert metric(gw.url, "rollout_gateway_published_total") == 0
        assert metric(gw.url, "rollout_gateway_store_backlog") == 0


def test_admin_routes_need_the_admin_key(engine):
    key = "s3cret-admin-key-0123"
    with GatewayProcess({"e0": engine.url}, env={"ROLLOUT_GATEWAY_ADMIN_API_KEY": key}) as gw:
        r = httpx.post(gw.url + "/v1/weights", json={"version": 1}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "UNAUTHENTICATED"
        r = httpx.delete(gw.url + "/v1/engines/e0", timeout=30)
        assert r.status_code == 401
        assert httpx.get(gw.url + "/v1/engines").status_code == 200  # reads stay open
        r = httpx.post(gw.url + "/v1/weights", json={"version": 1}, timeout=30,
                       headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200 and r.json()["status"] == "succeeded"


def test_a_full_store_does_not_lose_the_generated_trajectory(engine):
    env = {"ROLLOUT_GATEWAY_ADMISSION__ENABLED": "false"}
    with GatewayProcess({"e0": engine.url}, store_url="memory://?max_backlog=1", env=env) as gw:
        r = post(gw.url, 2)
        assert r.status_code == 200, r.text
        trajs = r.json()["trajectories"]
        assert all(t["num_tokens"] == 3 for t in trajs)
        errs = [t["metadata"].get("publish_error", "") for t in trajs]
        assert sorted(bool(e) for e in errs) == [False, True]
        assert any(e.startswith("RESOURCE_EXHAUSTED") for e in errs)
        assert metric(gw.url, "rollout_gateway_publish_failed_total") == 1


def test_recycled_prompts_are_regenerated_then_dropped_when_exhausted(engine):
    env = {"ROLLOUT_GATEWAY_ADMISSION__MAX_STALENESS": "0",
           "ROLLOUT_GATEWAY_ADMISSION__STALE_POLICY": "recycle",
           "ROLLOUT_GATEWAY_ADMISSION__MAX_RECYCLES": "1"}
    with GatewayProcess({"e0": engine.url}, env=env) as gw:
        assert httpx.post(gw.url + "/v1/weights", json={"version": 1}, timeout=30).status_code == 200
        r = post(gw.url, 1)  # the engine still runs v0: every generation is stale
        assert r.status_code == 200, r.text
        assert r.json()["trajectories"][0]["metadata"]["stale_verdict"] == "drop"
        assert metric(gw.url, "rollout_gateway_admission_stale_recycled_total") == 1
        assert metric(gw.url, "rollout_gateway_admission_recycle_exhausted_total") == 1
        assert metric(gw.url, "rollout_gateway_samples_total") == 2  # generated twice
        assert metric(gw.url, "rollout_gateway_admission_running") == 0


def test_a_recycled_prompt_refused_readmission_waits_for_a_slot_and_is_never_lost(make_engine):
    """Bound of one sample; every generation is stale (learner v1, engine v0). While the
    first generation runs, the backlog fills the bound, so its recycled prompt cannot be
    re-admitted: it must wait and be regenerated once the learner consumes, or fail its
    request with a 429 naming it, counted. (It used to be counted recycled and lost.)"""
    eng = make_engine(seed=1, step_delay_ms=60)
    store_url, registry_url = redis_urls()
    env = {"ROLLOUT_GATEWAY_ADMISSION__BATCH_SIZE": "1",
           "ROLLOUT_GATEWAY_ADMISSION__MAX_STALENESS": "0",
           "ROLLOUT_GATEWAY_ADMISSION__STALE_POLICY": "recycle",
           "ROLLOUT_GATEWAY_ADMISSION__MAX_RECYCLES": "1",
           "ROLLOUT_GATEWAY_ADMISSION__RECYCLE_WAIT_S": "4"}
    on_store(store_url, lambda s: s.create_group("learner"))
    with GatewayProcess({"e0": eng.url}, store_url=store_url, registry_url=registry_url,
                        env=env) as gw, ThreadPoolExecutor(1) as ex:
        assert httpx.post(gw.url + "/v1/weights", json={"version": 1}, timeout=30).status_code == 200

        def start_then_fill_backlog(tid: str):
            fut = ex.submit(post, gw.url, 1, 12)  # ~0.7 s of generation
            wait_metric(gw.url, "rollout_gateway_admission_running", 1)
            assert on_store(store_url, lambda s: s.publish(make_trajectory(tid)))
            return fut

        # 1) capacity frees up while the recycled prompt waits: it is regenerated
        fut = start_then_fill_backlog("injected-1")
        wait_metric(gw.url, "rollout_gateway_admission_recycle_waiting", 1)
        assert metric(gw.url, "rollout_gateway_admission_stale_recycled_total") == 1
        assert metric(gw.url, "rollout_gateway_admission_running") == 0
        assert post(gw.url, 1).status_code == 429  # new work does not jump the queue
        time.sleep(0.3)
        assert not fut.done()
        assert on_store(store_url, _consume_all) == 1  # the learner consumes: a slot frees
        r = fut.result(timeout=30)
        assert r.status_code == 200, r.text
        (t,) = r.json()["trajectories"]
        assert t["num_tokens"] == 12 and t["metadata"]["stale_verdict"] == "drop"
        assert metric(gw.url, "rollout_gateway_samples_total") == 2  # generated twice
        assert metric(gw.url, "rollout_gateway_admission_recycle_exhausted_total") == 1
        assert metric(gw.url, "rollout_gateway_admission_recycle_waiting") == 0

        # 2) no slot within recycle_wait_s: the caller gets a clear 429, counted
        fut = start_then_fill_backlog("injected-2")
        r = fut.result(timeout=30)
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["code"] == "RESOURCE_EXHAUSTED" and "recycled sample" in err["message"]
        assert err["details"]["recycled"] is True and err["details"]["trajectory_id"]
        assert metric(gw.url, "rollout_gateway_admission_recycle_refused_total") == 1
        assert metric(gw.url, "rollout_gateway_failed_samples_total") == 1
        assert metric(gw.url, "rollout_gateway_admission_running") == 0
        assert metric(gw.url, "rollout_gateway_admission_stale_recycled_total") == 2
