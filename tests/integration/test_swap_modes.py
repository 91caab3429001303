"""Hot-swaps under load, in every mode (and rolling), against two real engines and Redis.

Each test runs a batch of rollouts, swaps the weights in the middle of it, and checks
every token's policy_version, kv_version and logprob against fresh forward passes of
the weights of each version. Tests run in file order: versions only go up.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from _gateway_support import GatewayProcess, check_against_ground_truth, redis_urls, rollout

from reference_engine.config import ModelConfig
from rollout_gateway.commands.engine_process import EngineProcess

pytestmark = pytest.mark.integration

BASE_SEED = 11  # version v has seed BASE_SEED + v
STEP_MS = 25  # engine step delay: generation slow enough for a swap to land mid-sequence
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from reference_engine.checkpoint import init_checkpoint

    root = tmp_path_factory.mktemp("swap_ckpts")
    return {v: init_checkpoint(root / f"v{v}", seed=BASE_SEED + v) for v in range(0, 7)}


@pytest.fixture(scope="module")
def models(reference_model):
    return {v: reference_model((ModelConfig(), BASE_SEED + v)) for v in range(0, 7)}


@pytest.fixture(scope="module")
def cluster(ckpts):
    store, registry = redis_urls()
    with EngineProcess(checkpoint=ckpts[0], step_delay_ms=STEP_MS) as e0, \
            EngineProcess(checkpoint=ckpts[0], step_delay_ms=STEP_MS) as e1, \
            GatewayProcess({"e0": e0.url, "e1": e1.url}, store_url=store,
                           registry_url=registry) as gw:
        yield gw, {"e0": e0, "e1": e1}


def swap_under_load(gw, body: dict, *, prompts: int = 4, late: int = 0, delay: float = 0.25,
                    extra=lambda i: {}):
    """Start ``prompts`` rollouts (rollout ``i`` with the fields ``extra(i)``), swap after
    ``delay`` s, start ``late`` more during the swap; return (swap response, trajectories)."""
    with ThreadPoolExecutor(prompts + late + 1) as ex:
        futs = [ex.submit(rollout, gw.url, [5 + i, 6, 7 + i], max_new_tokens=NEW_TOKENS,
                          **extra(i)) for i in range(prompts)]
        time.sleep(delay)
        swap = ex.submit(httpx.post, gw.url + "/v1/weights", json=body, timeout=120)
        time.sleep(0.15)  # the swap has closed the gates by now (in-flight still running)
        futs += [ex.submit(rollout, gw.url, [40 + i, 41], max_new_tokens=NEW_TOKENS)
                 for i in range(late)]
        r = swap.result()
        trajs = [t for f in futs for t in f.result()["trajectories"]]
    return r, trajs


def check_all(trajs, models):
    for t in trajs:
        assert t["num_tokens"] == NEW_TOKENS and t["finish_reason"]["type"] == "length"
        check_against_ground_truth(t, models)


def versions_now(gw):
    return httpx.get(gw.url + "/v1/versions").json()


def test_in_place(cluster, ckpts, models):
    gw, _ = cluster
    r, trajs = swap_under_load(gw, {"version": 1, "source": {"kind": "disk", "path": str(ckpts[1])},
                                    "mode": "in_place"})
    assert r.status_code == 200, r.text
    rec = r.json()
    assert rec["status"] == "succeeded" and rec["ok"] and rec["mode"] == "in_place"
    assert {e["version_after"] for e in rec["engines"].values()} == {1}
    assert rec["pause_windows"] and all(w["resumed_at"] >= w["paused_at"] for w in rec["pause_windows"])
    check_all(trajs, models)
    spanning = [t for t in trajs if set(t["policy_version"]) == {0, 1}]
    assert spanning, "no rollout spanned the swap"
    for t in spanning:
        assert [s["began"] for s in t["segments"]] == ["start", "in_place"]
        assert set(t["kv_version"]) == {0}  # the old KV was kept
    v = versions_now(gw)
    assert v["learner_version"] == 1 and {e["version"] for e in v["engines"].values()} == {1}
    assert v["recent_swaps"][0]["version"] == 1


def test_retract(cluster, ckpts, models):
    """Requests without routed experts are retracted; those asking for them are broken off
    and resumed (a retract would replace the routing of their tokens before the swap)."""
    gw, _ = cluster
    r, trajs = swap_under_load(gw, {"version": 2, "source": {"kind": "disk", "path": str(ckpts[2])},
                                    "mode": "retract"},
                               extra=lambda i: {"return_routed_experts": i % 2 == 0})
    assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
    check_all(trajs, models)
    spanning = [t for t in trajs if set(t["policy_version"]) == {1, 2}]
    routed = {t.get("routed_experts") is not None for t in spanning}
    assert routed == {True, False}, "no rollout of each kind spanned the swap"
    for t in spanning:
        began = "abort_resume" if t.get("routed_experts") is not None else "retract"
        assert [s["began"] for s in t["segments"]] == ["start", began]
        assert t["kv_version"] == t["policy_version"]  # KV rebuilt under the new weights


def test_abort_resume(cluster, ckpts, models):
    gw, _ = cluster
    r, trajs = swap_under_load(gw, {"version": 3, "source": {"kind": "disk", "path": str(ckpts[3])},
                                    "mode": "abort_resume"})
    assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
    check_all(trajs, models)
    spanning = [t for t in trajs if set(t["policy_version"]) == {2, 3}]
    assert spanning
    for t in spanning:
        assert [s["began"] for s in t["segments"]] == ["start", "abort_resume"]
        # resumed on the same engine, prompt + partial output re-prefilled under v3
        assert len(set(t["engine_ids"])) == 1
        assert t["kv_version"] == t["policy_version"]


def test_drain(cluster, ckpts, models):
    gw, _ = cluster
    r, trajs = swap_under_load(gw, {"version": 4, "source": {"kind": "disk", "path": str(ckpts[4])},
                                    "mode": "drain"}, late=2)
    assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
    check_all(trajs, models)
    # drain: nobody spans the swap; the early ones finished on v3, the late ones ran on v4
    assert all(len(set(t["policy_version"])) == 1 for t in trajs)
    assert {t["policy_version"][0] for t in trajs[:4]} == {3}
    assert {t["policy_version"][0] for t in trajs[4:]} == {4}


def test_rolling_in_place(cluster, ckpts, models):
    gw, _ = cluster
    r, trajs = swap_under_load(gw, {"version": 5, "source": {"kind": "disk", "path": str(ckpts[5])},
                                    "mode": "in_place", "rolling": True}, prompts=6)
    assert r.status_code == 200, r.text
    rec = r.json()
    assert rec["status"] == "succeeded" and rec["rolling"]
    w = sorted((e["paused_at"], e["resumed_at"]) for e in rec["engines"].values())
    assert len(w) == 2 and w[0][1] <= w[1][0], f"rolling pauses overlap: {w}"
    check_all(trajs, models)
    assert any(set(t["policy_version"]) == {4, 5} for t in trajs)


def test_failed_load_keeps_the_old_weights_serving_and_a_retry_works(cluster, ckpts, models,
                                                                     tmp_path):
    gw, engines = cluster
    bad = tmp_path / "not-a-checkpoint"
    bad.mkdir()
    r, trajs = swap_under_load(gw, {"version": 6, "source": {"kind": "disk", "path": str(bad)},
                                    "mode": "in_place", "engines": ["e1"]}, prompts=6)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert "no engine took version 6" in err["message"]
    outcome = err["details"]["swap"]["engines"]["e1"]
    assert not outcome["ok"] and outcome["error"]
    # e1 answered that it kept its weights: it keeps serving them
    assert outcome["kept_version"] and outcome["version_after"] == 5
    check_all(trajs, models)
    assert {v for t in trajs for v in t["policy_version"]} == {5}
    # nothing was aborted: no rollout had to move off e1
    assert not [t for t in trajs if any(s["began"] == "failover" for s in t["segments"])]
    assert any("e1" in t["engine_ids"] for t in trajs)
    eng = httpx.get(gw.url + "/v1/engines/e1").json()
    assert eng["state"] == "healthy" and eng["weight_version"] == 5
    assert "serving version 5" in eng["last_error"]
    # the learner version did not move, so the same version can be retried
    assert versions_now(gw)["learner_version"] == 5
    r = httpx.post(gw.url + "/v1/weights", timeout=120, json={
        "version": 6, "source": {"kind": "disk", "path": str(ckpts[6])}, "mode": "in_place"})
    assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
    assert versions_now(gw)["learner_version"] == 6
    body = httpx.post(gw.url + "/v1/rollouts", timeout=60, json={
        "input_ids": [1, 2], "n": 4, "sampling_params": {"max_new_tokens": 4}}).json()
    assert {v for t in body["trajectories"] for v in t["policy_version"]} == {6}


def test_an_engine_joining_behind_catches_up_before_serving(cluster, ckpts, models):
    gw, _ = cluster
    with EngineProcess(checkpoint=ckpts[0]) as late:  # still at version 0
        r = httpx.post(gw.url + "/v1/engines", json={"id": "late", "url": late.url}, timeout=60)
        assert r.status_code == 201, r.text
        assert r.json()["weight_version"] == 6  # the newest version a swap delivered
        swaps = httpx.get(gw.url + "/v1/versions").json()["recent_swaps"]
        assert swaps[0]["message"] == "catch-up of late" and swaps[0]["status"] == "succeeded"
        body = httpx.post(gw.url + "/v1/rollouts", timeout=60, json={
            "input_ids": [1, 2], "n": 6, "sampling_params": {"max_new_tokens": 4}}).json()
        ran = [t for t in body["trajectories"] if t["engine_ids"] == ["late"]]
        assert ran, "the caught-up engine got no traffic"
        for t in ran:
            assert set(t["policy_version"]) == {6}
            check_against_ground_truth(t, models)
        assert httpx.delete(gw.url + "/v1/engines/late").status_code == 200
