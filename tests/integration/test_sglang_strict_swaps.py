"""Hot-swaps against engines answering as SGLang does (``--sglang-strict``), including
SGLang's sharp edges: versions before 0.5.21 (no weight_versions spans, no
begin/end_weight_update) and before 0.5.6 (no pause modes), a load that fails halfway,
and ``/update_weight_version``'s abort-all default. Stamps are checked against fresh
forward passes of each version's weights."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest
from _gateway_support import GatewayProcess, Streams, check_against_ground_truth, rollout

from reference_engine.config import ModelConfig

pytestmark = pytest.mark.integration

BASE_SEED = 21  # version v has seed BASE_SEED + v
STEP_MS = 25
NEW_TOKENS = 24  # >= 0.5 s left after SWAP_AFTER tokens: the swap lands mid-flight
SWAP_AFTER = 2


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from reference_engine.checkpoint import init_checkpoint

    root = tmp_path_factory.mktemp("strict_ckpts")
    return {v: init_checkpoint(root / f"v{v}", seed=BASE_SEED + v) for v in range(3)}


@pytest.fixture(scope="module")
def models(reference_model):
    return {v: reference_model((ModelConfig(), BASE_SEED + v)) for v in range(3)}


def strict(make_engine, ckpt, **kw):
    return make_engine(checkpoint=ckpt, weight_version="0", sglang_strict=True,
                       enable_return_routed_experts=True, step_delay_ms=STEP_MS, **kw)


def swap_under_load(gw, body: dict, prompts: int = 3):
    """Stream ``prompts`` rollouts; swap once every sample has streamed SWAP_AFTER tokens."""
    with Streams(gw.url) as st:
        futs = [st.start([5 + i, 6, 7], max_new_tokens=NEW_TOKENS) for i in range(prompts)]
        st.wait_tokens(SWAP_AFTER)
        r = httpx.post(gw.url + "/v1/weights", json=body, timeout=120)
        trajs = [t for f in futs for t in f.result()["trajectories"]]
    return r, trajs


def disk(ckpt, version: int, mode: str) -> dict:
    return {"version": version, "source": {"kind": "disk", "path": str(ckpt)}, "mode": mode}


@pytest.mark.parametrize("emulate", ["0.5.23", "0.5.20"])
def test_in_place_swap_under_load(make_engine, ckpts, models, emulate):
    """0.5.23: requests straddle the swap in place (spans say where). 0.5.20 has no spans:
    the gateway turns in_place into abort_resume, so no request straddles two versions."""
    e = strict(make_engine, ckpts[0], emulate_version=emulate)
    if emulate == "0.5.20":
        assert httpx.post(e.url + "/begin_weight_update", json={}).status_code == 404
        meta = httpx.post(e.url + "/generate", json={"input_ids": [1, 2], "sampling_params": {
            "max_new_tokens": 2}}, timeout=30).json()["meta_info"]
        assert "weight_versions" not in meta and meta["weight_version"] == "0"
    with GatewayProcess({"e0": e.url}) as gw:
        r, trajs = swap_under_load(gw, disk(ckpts[1], 1, "in_place"))
        assert r.status_code == 200, r.text
        began = {s["began"] for t in trajs for s in t["segments"][1:]}
        assert began and began <= ({"in_place"} if emulate == "0.5.23" else {"abort_resume"})
        assert any(set(t["policy_version"]) == {0, 1} for t in trajs)  # caught mid-flight
        for t in trajs:
            assert t["num_tokens"] == NEW_TOKENS and set(t["policy_version"]) <= {0, 1}
            check_against_ground_truth(t, models)
        assert httpx.get(e.url + "/model_info").json()["weight_version"] == "1"


def test_before_pause_modes_only_drain(make_engine, ckpts, models):
    e = strict(make_engine, ckpts[0], emulate_version="0.5.5")
    with GatewayProcess({"e0": e.url}) as gw:
        r = httpx.post(gw.url + "/v1/weights", json=disk(ckpts[1], 1, "in_place"), timeout=60)
        assert r.status_code == 409 and "mode=drain" in r.text
        r, trajs = swap_under_load(gw, disk(ckpts[1], 1, "drain"))
        assert r.status_code == 200, r.text
        for t in trajs:  # drained: every request ran under one version
            assert len({v for v in t["policy_version"]}) == 1
            check_against_ground_truth(t, models)
        t = rollout(gw.url, [1, 2, 3], max_new_tokens=4)["trajectories"][0]
        assert t["policy_version"] == [1] * 4


def test_load_failing_halfway_never_advertises_the_new_version(make_engine, ckpts, models,
                                                                tmp_path):
    """A checkpoint whose second file is unreadable: the load fails after the first file;
    the engine keeps its version, the gateway takes it out and never stamps v2."""
    from safetensors.torch import load_file, save_file

    half = tmp_path / "half"
    shutil.copytree(ckpts[2], half)
    (f,) = sorted(half.glob("*.safetensors"))
    tensors = load_file(str(f))
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[: len(names) // 2]}, str(half / "a.safetensors"))
    f.unlink()
    (half / "b.safetensors").write_bytes(b"\x00" * 64)  # truncated: fails mid-load
    a = strict(make_engine, ckpts[0])
    b = strict(make_engine, ckpts[0])
    with GatewayProcess({"a": a.url, "b": b.url}) as gw:
        body = disk(half, 2, "in_place") | {"engines": ["b"]}
        r, trajs = swap_under_load(gw, body, prompts=4)
        assert r.status_code == 503, r.text
        outcome = r.json()["error"]["details"]["swap"]["engines"]["b"]
        assert not outcome["ok"] and "b.safetensors" in outcome["error"]
        # the engine says it kept v0: it keeps serving v0, advertised as v0
        assert outcome["kept_version"] and outcome["version_after"] == 0
        assert httpx.get(b.url + "/model_info").json()["weight_version"] == "0"
        eng = httpx.get(gw.url + "/v1/engines/b").json()
        assert eng["weight_version"] == 0 and eng["state"] in ("healthy", "paused")
        for t in trajs:
            assert 2 not in t["policy_version"]
            check_against_ground_truth(t, models)
        for i in range(4):  # whichever engine serves it: v0, exact
            t = rollout(gw.url, [3, 4 + i], max_new_tokens=3)["trajectories"][0]
            assert t["policy_version"] == [0] * 3
            check_against_ground_truth(t, models)


def test_update_weight_version_is_sent_with_explicit_abort_flag(make_engine, ckpts):
    """SGLang aborts every in-flight request on /update_weight_version unless told not
    to: the adapter always sends abort_all_requests, so a relabel keeps them running."""
    from rollout_gateway.engines.client import EngineClient

    e = strict(make_engine, ckpts[0])

    async def go():
        c = EngineClient("e", e.url)
        await c.detect()
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 12,
                                                         "ignore_eos": True}}
        async with httpx.AsyncClient(timeout=60) as h, \
                h.stream("POST", e.url + "/generate", json=body | {"stream": True}) as r:
            lines = r.aiter_lines()
            first = await anext(line async for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["meta_info"]["finish_reason"] is None  # running
            await c.update_weight_version(3)
            data = [line[6:] async for line in lines if line.startswith("data: ")]
            assert data[-1] == "[DONE]"
            out = json.loads(data[-2])
        assert await c.weight_version() == 3
        await c.close()
        return out

    out = asyncio.run(go())
    assert out["meta_info"]["finish_reason"]["type"] == "length"  # not aborted
    assert out["meta_info"]["completion_tokens"] == 12


def test_streamed_chunks_stamped_as_the_trajectory_across_an_in_place_swap(make_engine, ckpts,
                                                                           models):
    """Live chunks of ``/v1/rollouts`` streams carry no engine spans (SGLang sends them with
    the last chunk only): a chunk after an in-place switch must still keep the older KV
    version and the label lag of the overlap scheduler, i.e. equal the final trajectory."""
    import threading

    e = strict(make_engine, ckpts[0])
    with GatewayProcess({"e0": e.url}) as gw:
        events: list[dict] = []
        started = threading.Event()

        def stream():
            body = {"input_ids": [9, 8, 7], "n": 2, "stream": True,
                    "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 1.0,
                                        "ignore_eos": True}}
            with httpx.stream("POST", gw.url + "/v1/rollouts", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
                        if sum(ev.get("type") == "chunk" for ev in events) >= 6:
                            started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60)
        r = httpx.post(gw.url + "/v1/weights", json=disk(ckpts[1], 1, "in_place"), timeout=60)
        assert r.status_code == 200, r.text
        t.join(120)
        trajs = [ev["trajectory"] for ev in events if ev["type"] == "trajectory"]
        assert len(trajs) == 2 and any(set(x["policy_version"]) == {0, 1} for x in trajs)
        for traj in trajs:
            check_against_ground_truth(traj, models)
            pv, kv = {}, {}
            for ev in events:
                if ev["type"] == "chunk" and ev["trajectory_id"] == traj["trajectory_id"]:
                    for k in range(len(ev["token_ids"])):
                        pv[ev["offset"] + k] = ev["policy_version"][k]
                        kv[ev["offset"] + k] = ev["kv_version"][k]
            assert [pv[i] for i in range(NEW_TOKENS)] == traj["policy_version"]
            assert [kv[i] for i in range(NEW_TOKENS)] == traj["kv_version"]
