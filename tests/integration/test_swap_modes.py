"""Hot-swaps under load, in every mode (and rolling), against two real engines and Redis.

Each test streams a batch of rollouts, swaps the weights once every sample has streamed
its first tokens, and checks every token's policy_version, kv_version and logprob against
fresh forward passes of the weights of each version. Each test swaps from whatever version
the gateway serves to the next one (checkpoints are made on demand), so any test runs
alone or in any order.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from _gateway_support import (GatewayProcess, Streams, check_against_ground_truth, redis_urls,
                              wait_for)

from reference_engine.config import ModelConfig
from rollout_gateway.commands.engine_process import EngineProcess

pytestmark = pytest.mark.integration

BASE_SEED = 11  # version v has seed BASE_SEED + v
STEP_MS = 25  # engine step delay: generation slow enough for a swap to land mid-sequence
NEW_TOKENS = 16
SWAP_AFTER = 2  # tokens every sample has streamed before the swap is posted


class ByVersion(dict):
    """version -> thing, made on first use."""

    def __init__(self, make) -> None:
        super().__init__()
        self.make = make

    def __missing__(self, v: int):
        self[v] = got = self.make(v)
        return got


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from reference_engine.checkpoint import init_checkpoint

    root = tmp_path_factory.mktemp("swap_ckpts")
    return ByVersion(lambda v: init_checkpoint(root / f"v{v}", seed=BASE_SEED + v))


@pytest.fixture(scope="module")
def models(reference_model):
    return ByVersion(lambda v: reference_model((ModelConfig(), BASE_SEED + v)))


@pytest.fixture(scope="module")
def cluster(ckpts):
    store, registry = redis_urls()
    with EngineProcess(checkpoint=ckpts[0], step_delay_ms=STEP_MS) as e0, \
            EngineProcess(checkpoint=ckpts[0], step_delay_ms=STEP_MS) as e1, \
            GatewayProcess({"e0": e0.url, "e1": e1.url}, store_url=store,
                           registry_url=registry) as gw:
        yield gw, {"e0": e0, "e1": e1}


def disk(ckpt, version: int, mode: str, **extra) -> dict:
    return {"version": version, "source": {"kind": "disk", "path": str(ckpt)}, "mode": mode,
            **extra}


def fenced(gw) -> bool:
    return all(e["fenced"] for e in httpx.get(gw.url + "/v1/engines").json()["engines"])


def swap_round(gw, body: dict, prompts: int, late: int,
               per_rollout=lambda i: {}) -> tuple[httpx.Response, list, bool]:
    """``prompts`` streamed rollouts (rollout ``i`` with the fields ``per_rollout(i)``); once
    every sample streamed SWAP_AFTER tokens, the swap; with ``late``, that many more rollouts
    once the swap has fenced every engine. Returns (swap response, trajectories, whether the
    late ones were started while fenced)."""
    with Streams(gw.url) as st, ThreadPoolExecutor(1) as ex:
        futs = [st.start([5 + i, 6, 7 + i], max_new_tokens=NEW_TOKENS, **per_rollout(i))
                for i in range(prompts)]
        st.wait_tokens(SWAP_AFTER)
        swap = ex.submit(httpx.post, gw.url + "/v1/weights", json=body, timeout=120)
        in_window = True
        if late:
            wait_for(lambda: swap.done() or fenced(gw), 60, "the swap fencing the engines")
            in_window = not swap.done()
            futs += [st.start([40 + i, 41], max_new_tokens=NEW_TOKENS) for i in range(late)]
        r = swap.result()
        trajs = [t for f in futs for t in f.result()["trajectories"]]
    return r, trajs, in_window


def spanned(trajs) -> bool:
    """Some trajectory spans the swap (tokens of two versions)."""
    return any(len(set(t["policy_version"])) > 1 for t in trajs)


def swap_under_load(gw, ckpts, mode: str, *, prompts: int = 4, late: int = 0, straddle=spanned,
                    tries: int = 3, per_rollout=lambda i: {}, **extra):
    """Rounds of :func:`swap_round`, each to the version after the one served, until one
    caught the rollouts mid-flight: ``straddle(trajectories)`` holds, the late
    rollouts were started during it (``late``). Under heavy load a swap can reach the engines
    after every stream ended; every round's trajectories are returned for the truth check.
    Returns (swap response, version before the last swap, its trajectories, earlier ones)."""
    earlier: list = []
    for k in range(tries):
        v = versions_now(gw)["learner_version"]
        r, trajs, in_window = swap_round(gw, disk(ckpts[v + 1], v + 1, mode, **extra),
                                         prompts, late, per_rollout)
        caught = straddle is None or straddle(trajs)
        if r.status_code != 200 or (caught and in_window) or k == tries - 1:
            return r, v, trajs, earlier
        earlier += trajs


def check_all(trajs, models):
    for t in trajs:
        assert t["num_tokens"] == NEW_TOKENS and t["finish_reason"]["type"] == "length"
        check_against_ground_truth(t, models)


def versions_now(gw):
    return httpx.get(gw.url + "/v1/versions").json()


def test_in_place(cluster, ckpts, models):
    gw, _ = cluster
    r, v, trajs, earlier = swap_under_load(gw, ckpts, "in_place")
    assert r.status_code == 200, r.text
    rec = r.json()
    assert rec["status"] == "succeeded" and rec["ok"] and rec["mode"] == "in_place"
    assert {e["version_after"] for e in rec["engines"].values()} == {v + 1}
    assert rec["pause_windows"] and all(w["resumed_at"] >= w["paused_at"] for w in rec["pause_windows"])
    check_all(earlier + trajs, models)
    spanning = [t for t in trajs if set(t["policy_version"]) == {v, v + 1}]
    assert spanning, "no rollout spanned the swap"
    for t in spanning:
        assert [s["began"] for s in t["segments"]] == ["start", "in_place"]
        assert set(t["kv_version"]) == {v}  # the old KV was kept
    now = versions_now(gw)
    assert now["learner_version"] == v + 1
    assert {e["version"] for e in now["engines"].values()} == {v + 1}
    assert now["recent_swaps"][0]["version"] == v + 1


def test_retract(cluster, ckpts, models):
    """Requests without routed experts are retracted; those asking for them are broken off
    and resumed (a retract would replace the routing of their tokens before the swap)."""
    gw, _ = cluster

    def both_kinds_spanned(trajs) -> bool:
        return {t.get("routed_experts") is not None for t in trajs
                if len(set(t["policy_version"])) > 1} == {True, False}

    r, v, trajs, earlier = swap_under_load(
        gw, ckpts, "retract", straddle=both_kinds_spanned,
        per_rollout=lambda i: {"return_routed_experts": i % 2 == 0})
    assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
    check_all(earlier + trajs, models)
    spanning = [t for t in trajs if set(t["policy_version"]) == {v, v + 1}]
    routed = {t.get("routed_experts") is not None for t in spanning}
    assert routed == {True, False}, "no rollout of each kind spanned the swap"
    for t in spanning:
        began = "abort_resume" if t.get("routed_experts") is not None else "retract"
        assert [s["began"] for s in t["segments"]] == ["start", began]
        assert t["kv_version"] == t["policy_version"]  # KV rebuilt under the new weights


def test_abort_resume(cluster, ckpts, models):
    gw, _ = cluster
    r, v, trajs, earlier = swap_under_load(gw, ckpts, "abort_resume")
    assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
    check_all(earlier + trajs, models)
    spanning = [t for t in trajs if set(t["policy_version"]) == {v, v + 1}]
    assert spanning
    for t in spanning:
        assert [s["began"] for s in t["segments"]] == ["start", "abort_resume"]
        # resumed on the same engine, prompt + partial output re-prefilled under v + 1
        assert len(set(t["engine_ids"])) == 1
        assert t["kv_version"] == t["policy_version"]


def test_drain(cluster, ckpts, models):
    gw, _ = cluster
    r, v, trajs, earlier = swap_under_load(gw, ckpts, "drain", late=2, straddle=None)
    assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
    check_all(earlier + trajs, models)
    # drain: nobody spans the swap; the early ones finished on v, the late ones (started
    # while the engines were fenced) waited and ran on v + 1
    assert all(len(set(t["policy_version"])) == 1 for t in trajs)
    assert {t["policy_version"][0] for t in trajs[:4]} == {v}
    assert {t["policy_version"][0] for t in trajs[4:]} == {v + 1}


def test_rolling_in_place(cluster, ckpts, models):
    gw, _ = cluster
    r, v, trajs, earlier = swap_under_load(gw, ckpts, "in_place", prompts=6, rolling=True)
    assert r.status_code == 200, r.text
    rec = r.json()
    assert rec["status"] == "succeeded" and rec["rolling"]
    w = sorted((e["paused_at"], e["resumed_at"]) for e in rec["engines"].values())
    assert len(w) == 2 and w[0][1] <= w[1][0], f"rolling pauses overlap: {w}"
    check_all(earlier + trajs, models)
    assert any(set(t["policy_version"]) == {v, v + 1} for t in trajs)


def test_failed_load_keeps_the_old_weights_serving_and_a_retry_works(cluster, ckpts, models,
                                                                     tmp_path):
    gw, engines = cluster
    bad = tmp_path / "not-a-checkpoint"
    bad.mkdir()
    v = versions_now(gw)["learner_version"]
    r, trajs, _ = swap_round(gw, disk(bad, v + 1, "in_place", engines=["e1"]), 6, 0)
    assert r.status_code == 400, r.text  # the one engine refused the source: fix the source
    err = r.json()["error"]
    assert err["code"] == "INVALID_ARGUMENT"
    assert f"no engine took version {v + 1}: every engine refused" in err["message"]
    outcome = err["details"]["swap"]["engines"]["e1"]
    assert not outcome["ok"] and outcome["error"]
    # e1 answered that it kept its weights: it keeps serving them
    assert outcome["kept_version"] and outcome["version_after"] == v
    check_all(trajs, models)
    assert {x for t in trajs for x in t["policy_version"]} == {v}
    # nothing was aborted: no rollout had to move off e1
    assert not [t for t in trajs if any(s["began"] == "failover" for s in t["segments"])]
    assert any("e1" in t["engine_ids"] for t in trajs)
    eng = httpx.get(gw.url + "/v1/engines/e1").json()
    assert eng["state"] == "healthy" and eng["weight_version"] == v
    assert f"serving version {v}" in eng["last_error"]
    # the learner version did not move, so the same version can be retried
    assert versions_now(gw)["learner_version"] == v
    r = httpx.post(gw.url + "/v1/weights", timeout=120,
                   json=disk(ckpts[v + 1], v + 1, "in_place"))
    assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
    assert versions_now(gw)["learner_version"] == v + 1
    body = httpx.post(gw.url + "/v1/rollouts", timeout=60, json={
        "input_ids": [1, 2], "n": 4, "sampling_params": {"max_new_tokens": 4}}).json()
    assert {x for t in body["trajectories"] for x in t["policy_version"]} == {v + 1}


def test_an_engine_joining_behind_catches_up_before_serving(cluster, ckpts, models):
    gw, _ = cluster
    v = versions_now(gw)["learner_version"] + 1  # the pool moves past version 0 first
    r = httpx.post(gw.url + "/v1/weights", timeout=120, json=disk(ckpts[v], v, "in_place"))
    assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
    with EngineProcess(checkpoint=ckpts[0]) as late:  # still at version 0
        r = httpx.post(gw.url + "/v1/engines", json={"id": "late", "url": late.url}, timeout=60)
        assert r.status_code == 201, r.text
        assert r.json()["weight_version"] == v  # the newest version a swap delivered
        swaps = httpx.get(gw.url + "/v1/versions").json()["recent_swaps"]
        assert swaps[0]["message"] == "catch-up of late" and swaps[0]["status"] == "succeeded"
        body = httpx.post(gw.url + "/v1/rollouts", timeout=60, json={
            "input_ids": [1, 2], "n": 6, "sampling_params": {"max_new_tokens": 4}}).json()
        ran = [t for t in body["trajectories"] if t["engine_ids"] == ["late"]]
        assert ran, "the caught-up engine got no traffic"
        for t in ran:
            assert set(t["policy_version"]) == {v}
            check_against_ground_truth(t, models)
        assert httpx.delete(gw.url + "/v1/engines/late").status_code == 200
