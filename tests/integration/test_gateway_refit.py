"""A fleet refit as one transaction (docs/gateway.md, "Hot-swap": "One refit, one version
cut") against three reference engines as processes: per-engine results (207 for a partial
refit), the version published only for engines that verified, sampled tensors read back
(``/get_weights_by_name``) against the checkpoint's manifest, no in-flight rollout lost to
a default refit, and an engine that joins behind taking no traffic until it runs the
current version."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from _gateway_support import GatewayProcess, Streams, wait_for

from rollout_gateway.swap.manifest import MANIFEST_FILE, write_manifest

pytestmark = pytest.mark.integration

NEW_TOKENS = 12
SAMPLED = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
           "model.layers.1.mlp.experts.3.down_proj.weight", "lm_head.weight")
#: an engine of another shape: it cannot load the fleet's checkpoints, keeps its weights
OTHER_SHAPE = json.dumps({"hidden_size": 32})


def _tensors(ckpt) -> dict:
    from safetensors.torch import load_file

    return load_file(str(ckpt / "model.safetensors"))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Checkpoints v1 (with a manifest), v2 (no manifest) and v3 (a manifest of other
    weights: the checkpoint differs from what its manifest says)."""
    from reference_engine.checkpoint import init_checkpoint

    root = tmp_path_factory.mktemp("refit")
    v1 = init_checkpoint(root / "v1", seed=21)
    write_manifest(v1, {n: t for n, t in _tensors(v1).items() if n in SAMPLED})
    v2 = init_checkpoint(root / "v2", seed=22)
    v3 = init_checkpoint(root / "v3", seed=23)
    write_manifest(v3, {n: t for n, t in _tensors(v2).items() if n in SAMPLED})
    return {1: v1, 2: v2, 3: v3}


def disk(ckpt, version: int, **extra) -> dict:
    return {"version": version, "source": {"kind": "disk", "path": str(ckpt)}, **extra}


def versions(gw) -> dict:
    return httpx.get(gw.url + "/v1/versions", timeout=10).json()


def published(gw) -> dict[str, int]:
    """engine id -> the version the registry publishes for it."""
    return {k: e["version"] for k, e in versions(gw)["engines"].items()}


def engine(gw, eid: str) -> dict:
    return httpx.get(gw.url + f"/v1/engines/{eid}", timeout=10).json()


def rollouts(gw, n: int, **extra) -> list[dict]:
    r = httpx.post(gw.url + "/v1/rollouts", timeout=60, json={
        "input_ids": [3, 4, 5], "n": n, "sampling_params": {"max_new_tokens": 4},
        **extra})
    assert r.status_code == 200, r.text
    return r.json()["trajectories"]


def test_partial_refit_is_207_publishes_only_for_verified_engines(make_engine, ckpts):
    a = make_engine(seed=21, step_delay_ms=20)
    b = make_engine(seed=21, step_delay_ms=20)
    c = make_engine(seed=21, step_delay_ms=20, model_config=OTHER_SHAPE)
    with GatewayProcess({"a": a.url, "b": b.url, "c": c.url}) as gw, Streams(gw.url) as st:
        # a default refit (mode abort_resume) under load, every sample mid-generation
        futs = [st.start([5 + i, 6, 7], n=2, max_new_tokens=NEW_TOKENS) for i in range(3)]
        st.wait_tokens(2)
        r = httpx.post(gw.url + "/v1/weights", json=disk(ckpts[1], 1), timeout=120)
        trajs = [t for f in futs for t in f.result()["trajectories"]]
        assert r.status_code == 207, r.text
        body = r.json()
        assert body["status"] == "partial" and not body["ok"] and body["swap_id"]
        res = body["results"]
        for eid in ("a", "b"):
            assert res[eid]["result"] == "verified" and res[eid]["serving_version"] == 1
            assert res[eid]["verification"] == f"version and {len(SAMPLED)} sampled tensor(s)"
        # c is named: its load failed, it kept and serves its old version
        assert res["c"]["result"] == "kept_version" and res["c"]["serving_version"] == 0
        assert res["c"]["why"].startswith("load:"), res["c"]
        assert "kept their weights and serve: c (still v0)" in body["message"]
        # the version is published once, for the engines that verified only
        assert versions(gw)["learner_version"] == 1
        assert published(gw) == {"a": 1, "b": 1, "c": 0}
        # (its state reads "paused" until the health probe sees it resumed)
        wait_for(lambda: engine(gw, "c")["state"] == "healthy", 30, "c healthy again")
        assert engine(gw, "c")["weight_version"] == 0
        # no in-flight rollout was lost: each ran to its length, none ended aborted
        assert len(trajs) == 6
        for t in trajs:
            assert t["num_tokens"] == NEW_TOKENS and t["finish_reason"]["type"] == "length", t
        # c keeps serving (its old version); "latest" never reaches it
        assert "c" in {e for t in rollouts(gw, 9) for e in t["engine_ids"]}
        latest = rollouts(gw, 6, version_policy="latest")
        assert {e for t in latest for e in t["engine_ids"]} <= {"a", "b"}
        assert {x for t in latest for x in t["policy_version"]} == {1}


def test_refit_without_manifest_verifies_by_version_only(make_engine, ckpts):
    a = make_engine(seed=21)
    with GatewayProcess({"a": a.url}) as gw:
        r = httpx.post(gw.url + "/v1/weights", json=disk(ckpts[2], 1), timeout=120)
        assert r.status_code == 200, r.text
        res = r.json()["results"]["a"]
        assert res["result"] == "verified"
        assert res["verification"].startswith(f"version only: no {MANIFEST_FILE} beside the ")


def test_an_engine_that_cannot_read_weights_back_verifies_by_version_only(make_engine,
                                                                          ckpts):
    # strict: SGLang 0.5.23's Qwen3-MoE has no get_weights_by_name (the route answers 400)
    a = make_engine(seed=21, sglang_strict=True)
    with GatewayProcess({"a": a.url}) as gw:
        r = httpx.post(gw.url + "/v1/weights", json=disk(ckpts[1], 1), timeout=120)
        assert r.status_code == 200, r.text
        res = r.json()["results"]["a"]
        assert res["result"] == "verified" and res["serving_version"] == 1
        assert res["verification"].startswith("version only: the engine cannot read "), res
        assert "Get parameter by name failed" in res["verification"]


def test_sampled_tensors_catch_a_checkpoint_that_differs_from_its_manifest(make_engine, ckpts):
    a = make_engine(seed=21)
    b = make_engine(seed=21)
    with GatewayProcess({"a": a.url, "b": b.url}) as gw:
        r = httpx.post(gw.url + "/v1/weights", json=disk(ckpts[3], 1, engines=["a"]),
                       timeout=120)
        assert r.status_code == 503, r.text  # the only engine refitted did not verify
        swap = r.json()["error"]["details"]["swap"]
        res = swap["results"]["a"]
        assert res["result"] == "failed" and res["serving_version"] is None
        assert "differs from the checkpoint's manifest" in res["why"], res
        # never published: not the learner version, not a's version
        assert versions(gw)["learner_version"] == 0 and published(gw)["a"] == 0
        # a runs weights it was not asked for: out of rotation, named; b serves
        eng = engine(gw, "a")
        assert eng["state"] == "failed_load" and "manifest" in eng["last_error"]
        assert {e for t in rollouts(gw, 4) for e in t["engine_ids"]} == {"b"}
        # the same checkpoint with a true manifest verifies (the check is the manifest's)
        r = httpx.post(gw.url + "/v1/weights", json=disk(ckpts[1], 1, engines=["b"]),
                       timeout=120)
        assert r.status_code == 200 and r.json()["results"]["b"]["result"] == "verified"


def test_a_joining_engine_at_an_old_version_takes_no_traffic_until_current(make_engine,
                                                                          ckpts):
    a = make_engine(seed=21, step_delay_ms=10)
    late = make_engine(seed=21, step_delay_ms=10)  # boots with version 0
    with GatewayProcess({"a": a.url}) as gw, Streams(gw.url) as st, \
            ThreadPoolExecutor(1) as ex:
        r = httpx.post(gw.url + "/v1/weights", json=disk(ckpts[1], 1), timeout=120)
        assert r.status_code == 200, r.text
        # rollouts arrive while it registers: none may reach it before it runs version 1
        futs = [st.start([9, i + 1], n=2, max_new_tokens=NEW_TOKENS) for i in range(4)]
        st.wait_tokens(1)
        reg = ex.submit(httpx.post, gw.url + "/v1/engines",
                        json={"id": "late", "url": late.url}, timeout=120)
        futs += [st.start([10, i + 1], n=2, max_new_tokens=NEW_TOKENS) for i in range(4)]
        r = reg.result()
        assert r.status_code == 201, r.text
        assert r.json()["weight_version"] == 1
        futs += [st.start([11, i + 1], n=4, max_new_tokens=NEW_TOKENS) for i in range(2)]
        trajs = [t for f in futs for t in f.result()["trajectories"]]
        swaps = versions(gw)["recent_swaps"]
        assert swaps[0]["message"] == "catch-up of late" and swaps[0]["status"] == "succeeded"
        assert swaps[0]["engines"]["late"]["verification"] == \
            f"version and {len(SAMPLED)} sampled tensor(s)"
        assert any("late" in t["engine_ids"] for t in trajs), "late got no traffic"
        for t in trajs:  # every token is version 1, on a and on late
            assert set(t["policy_version"]) == {1}, t


def test_a_joining_engine_that_cannot_catch_up_serves_only_policies_admitting_it(
        make_engine, ckpts):
    a = make_engine(seed=21)
    odd = make_engine(seed=21, model_config=OTHER_SHAPE)  # cannot load the fleet's weights
    with GatewayProcess({"a": a.url}) as gw:
        r = httpx.post(gw.url + "/v1/weights", json=disk(ckpts[1], 1), timeout=120)
        assert r.status_code == 200, r.text
        r = httpx.post(gw.url + "/v1/engines", json={"id": "odd", "url": odd.url}, timeout=120)
        assert r.status_code == 201, r.text
        assert r.json()["weight_version"] == 0  # its catch-up failed: it kept version 0
        swaps = versions(gw)["recent_swaps"]
        assert swaps[0]["message"] == "catch-up of odd" and swaps[0]["status"] == "failed"
        assert swaps[0]["engines"]["odd"]["kept_version"]
        assert published(gw) == {"a": 1, "odd": 0}
        # the default policy (any) admits it; latest and max_staleness:0 never reach it
        assert "odd" in {e for t in rollouts(gw, 8) for e in t["engine_ids"]}
        for policy in ("latest", "max_staleness:0", "min_version:1"):
            trajs = rollouts(gw, 6, version_policy=policy)
            assert {e for t in trajs for e in t["engine_ids"]} == {"a"}, policy
