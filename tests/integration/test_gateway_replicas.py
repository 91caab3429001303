"""Two gateway replicas sharing Redis (store + registry) in front of the same two engines:
a swap led by one replica keeps the other's stamps exact, and one swap leads at a time."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from _gateway_support import (GatewayProcess, Streams, check_against_ground_truth, redis_urls,
                              wait_for)

from reference_engine.config import ModelConfig
from rollout_gateway.commands.engine_process import EngineProcess

pytestmark = pytest.mark.integration

SEED0 = 21  # version v has seed SEED0 + v


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    from reference_engine.checkpoint import init_checkpoint

    root = tmp_path_factory.mktemp("replica_ckpts")
    ckpts = {v: init_checkpoint(root / f"v{v}", seed=SEED0 + v) for v in range(4)}
    store, registry = redis_urls()
    with EngineProcess(checkpoint=ckpts[0], step_delay_ms=25) as e0, \
            EngineProcess(checkpoint=ckpts[0], step_delay_ms=25) as e1:
        engines = {"e0": e0.url, "e1": e1.url}
        with GatewayProcess(engines, store_url=store, registry_url=registry) as a, \
                GatewayProcess(engines, store_url=store, registry_url=registry) as b:
            yield a, b, ckpts


@pytest.fixture(scope="module")
def models(reference_model):
    return {v: reference_model((ModelConfig(), SEED0 + v)) for v in range(4)}


def load_on_b_swap_via_a(a, b, body):
    with Streams(b.url) as st:
        futs = [st.start([30 + i, 31], max_new_tokens=16) for i in range(4)]
        st.wait_tokens(2)  # every sample on B is generating
        r = httpx.post(a.url + "/v1/weights", json=body, timeout=120)
        return r, [t for f in futs for t in f.result()["trajectories"]]


@pytest.mark.parametrize("version,mode,began", [(1, "retract", "retract"),
                                                (2, "abort_resume", "abort_resume")])
def test_swap_led_by_one_replica_keeps_the_others_stamps_exact(replicas, models, version, mode,
                                                                began):
    a, b, ckpts = replicas
    r, trajs = load_on_b_swap_via_a(a, b, {"version": version, "mode": mode, "source": {
        "kind": "disk", "path": str(ckpts[version])}})
    assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
    spanning = [t for t in trajs if len(set(t["policy_version"])) == 2]
    assert spanning, "no rollout on replica B spanned the swap led by A"
    for t in trajs:
        check_against_ground_truth(t, models)
    for t in spanning:
        assert [s["began"] for s in t["segments"]] == ["start", began]
    # B learns the engines' new version from the shared registry
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        vs = {e["weight_version"] for e in httpx.get(b.url + "/v1/engines").json()["engines"]}
        if vs == {version}:
            break
        time.sleep(0.1)
    assert vs == {version}
    assert httpx.get(b.url + "/v1/versions").json()["learner_version"] == version


def test_one_replica_leads_a_swap_at_a_time(replicas):
    a, b, ckpts = replicas
    before = httpx.get(a.url + "/v1/versions").json()["learner_version"]
    with Streams(a.url) as st, ThreadPoolExecutor(1) as ex:
        long = st.start([1, 2], max_new_tokens=48)  # ~1.2 s on A
        st.wait_tokens(2)
        drain = ex.submit(httpx.post, a.url + "/v1/weights", timeout=120, json={
            "version": 3, "mode": "drain", "source": {"kind": "disk", "path": str(ckpts[3])}})
        # A holds the lease while it drains: its engines are fenced
        wait_for(lambda: drain.done() or all(e["fenced"] for e in httpx.get(
            a.url + "/v1/engines").json()["engines"]), 30, "A fencing its engines")
        assert not drain.done(), drain.result().text
        r = httpx.post(b.url + "/v1/weights", timeout=60, json={
            "version": 4, "mode": "in_place", "source": {"kind": "disk", "path": str(ckpts[3])}})
        assert r.status_code == 409, r.text
        assert "being led by" in r.json()["error"]["message"]
        assert drain.result().json()["status"] == "succeeded"
        assert set(long.result()["trajectories"][0]["policy_version"]) == {before}


def _running(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("rollout_gateway_admission_running "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("admission running gauge missing")


def test_the_staleness_bound_holds_across_replicas_sharing_a_registry(make_engine):
    """Bound (0 + 1) * 3 = 3 samples for both replicas together: what A runs counts on B."""
    eng = make_engine(seed=1, step_delay_ms=60)
    store, registry = redis_urls()
    env = {"ROLLOUT_GATEWAY_ADMISSION__BATCH_SIZE": "3",
           "ROLLOUT_GATEWAY_ADMISSION__MAX_STALENESS": "0"}
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 12, "ignore_eos": True}}

    def post(url: str, n: int) -> httpx.Response:
        return httpx.post(url + "/v1/rollouts", json={**body, "n": n}, timeout=60)

    with GatewayProcess({"e0": eng.url}, store_url=store, registry_url=registry, env=env) as a, \
            GatewayProcess({"e0": eng.url}, store_url=store, registry_url=registry,
                           env=env) as b, ThreadPoolExecutor(2) as ex:
        on_a = ex.submit(post, a.url, 2)  # ~0.7 s of generation
        deadline = time.monotonic() + 15
        while _running(a.url) != 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = post(b.url, 2)  # B runs nothing itself, but 2 + 2 > 3
        assert r.status_code == 429, r.text
        d = r.json()["error"]["details"]
        assert (d["running"], d["staleness_used"], d["staleness_limit"]) == (0, 2, 3)
        assert post(b.url, 1).status_code == 200  # 2 + 1 fits
        assert on_a.result().status_code == 200
        # all 3 published, none consumed: the bound is full for both replicas
        for url in (a.url, b.url):
            r = post(url, 1)
            assert r.status_code == 429 and r.json()["error"]["details"]["staleness_used"] == 3
