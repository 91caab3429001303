"""Hot-swaps against engines answering as SGLang does (``--sglang-strict``), including
SGLang's sharp edges: versions before 0.5.21 (no weight_versions spans, no
begin/end_weight_update) and before 0.5.6 (no pause modes), a load that fails halfway,
and ``/update_weight_version``'s abort-all default. Stamps are checked against fresh
forward passes of each version's weights."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
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
        # under heavy load a swap can reach the engine after every stream ended: then a
        # second round swaps to v2 (every round's trajectories are checked)
        for v in (1, 2):
            r, trajs = swap_under_load(gw, disk(ckpts[v], v, "in_place"))
            assert r.status_code == 200, r.text
            for t in trajs:
                assert t["num_tokens"] == NEW_TOKENS and set(t["policy_version"]) <= {v - 1, v}
                check_against_ground_truth(t, models)
            if any(set(t["policy_version"]) == {v - 1, v} for t in trajs):
                break  # caught mid-flight
        assert any(set(t["policy_version"]) == {v - 1, v} for t in trajs), "never mid-flight"
        began = {s["began"] for t in trajs for s in t["segments"][1:]}
        assert began and began <= ({"in_place"} if emulate == "0.5.23" else {"abort_resume"})
        assert httpx.get(e.url + "/model_info").json()["weight_version"] == str(v)


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
        assert r.status_code == 400, r.text  # its one engine refused the source: fix it
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


# ---------------------------------------------------------------------------------------------
# retract swaps and routing (docs/gateway.md, "SGLang behaviours the gateway corrects")


def routed_rows(meta_or_traj: dict) -> np.ndarray:
    """[positions, layers, top_k] rows of a ``/generate`` meta_info (base64 int32) or of a
    ``/v1/rollouts`` trajectory."""
    cfg = ModelConfig()
    re_ = meta_or_traj["routed_experts"]
    if isinstance(re_, str):
        data, dtype = base64.b64decode(re_), "<i4"
    else:
        assert re_["start"] == 0, re_
        data, dtype = base64.b64decode(re_["data_b64"]), re_["dtype"]
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(
        -1, cfg.num_hidden_layers, cfg.num_experts_per_tok).astype(np.int64)


def true_rows(traj: dict, models: dict) -> np.ndarray:
    """Row ``j``: the routing of the forward that sampled the next token from position ``j``
    (prompt rows: the first prefill's), for trajectories whose segments all rebuilt their KV
    (start / retract / abort_resume)."""
    from reference_engine.reference import score

    prompt, out = traj["prompt_token_ids"], traj["token_ids"]
    ids, p = prompt + out, len(prompt)
    segs = traj["segments"]
    want = score(models[segs[0]["policy_version"]], ids, p).routed_experts.astype(np.int64)
    for s in segs[1:]:
        assert s["began"] != "in_place", s
        rows = score(models[s["policy_version"]], ids, p).routed_experts
        want[p - 1 + s["start"]:p - 1 + s["end"]] = rows[p - 1 + s["start"]:p - 1 + s["end"]]
    return want


def stream_until(url: str, path: str, bodies: list[dict], chunks: int, during) -> list[list]:
    """Stream ``bodies`` to ``url + path`` at once; when every stream has delivered ``chunks``
    chunks, call ``during()``; return each stream's events once all ended."""
    import json
    import threading

    events: list[list] = [[] for _ in bodies]
    counts = [0] * len(bodies)
    ready = threading.Event()
    lock = threading.Lock()

    def one(i: int) -> None:
        with httpx.stream("POST", url + path, json=bodies[i], timeout=120) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                events[i].append(ev)
                with lock:
                    counts[i] += 1
                    if min(counts) >= chunks:
                        ready.set()

    with ThreadPoolExecutor(len(bodies)) as ex:
        futs = [ex.submit(one, i) for i in range(len(bodies))]
        assert ready.wait(60), counts
        during()
        for f in futs:
            f.result()
    return events


def test_strict_retract_rewrites_the_routing_before_it(make_engine, ckpts, models):
    """SGLang's behaviour, reproduced by the strict engine: after a retract pause and a load,
    the request is re-prefilled (prompt + output) under the new weights, and its routed rows
    for every position, those of the tokens sampled before the swap included, are the
    re-prefill's (research §4). This is what the gateway must correct."""
    e = strict(make_engine, ckpts[0])
    prompt = [5, 9, 13, 2]
    body = {"input_ids": prompt, "stream": True, "return_logprob": True,
            "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 1.0,
                                "ignore_eos": True}}

    def swap() -> None:
        for path, b in (("/pause_generation", {"mode": "retract"}),
                        ("/update_weights_from_disk", {"model_path": str(ckpts[1]),
                                                       "weight_version": "1"}),
                        ("/continue_generation", {})):
            r = httpx.post(e.url + path, json=b, timeout=60)
            assert r.status_code == 200, (path, r.text)

    (events,) = stream_until(e.url, "/generate", [body], 3, swap)
    last = events[-1]
    meta = last["meta_info"]
    spans = meta["weight_versions"]
    assert [str(s["version"]) for s in spans] == ["0", "1"], spans
    ids = prompt + last["output_ids"]
    rows = routed_rows(meta)
    from reference_engine.reference import score

    v0 = score(models[0], ids, len(prompt)).routed_experts
    v1 = score(models[1], ids, len(prompt)).routed_experts
    assert rows.shape == v1.shape
    assert np.array_equal(rows, v1)  # every row the re-prefill's (new weights)
    assert not np.array_equal(rows[:len(prompt) + 2], v0[:len(prompt) + 2])


def test_retract_swap_keeps_the_routing_that_sampled_each_token(make_engine, ckpts, models):
    """Through the gateway: a retract swap breaks off the requests that asked for routed
    experts (they resume as after abort_resume, each segment keeping its own rows: every row
    is the routing that sampled its token); a request without routing stays retracted."""
    e = strict(make_engine, ckpts[0])
    with GatewayProcess({"e0": e.url}) as gw:
        def body(i: int, routed: bool) -> dict:
            return {"input_ids": [7 + i, 3, 11], "n": 1, "stream": True,
                    "return_routed_experts": routed,
                    "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 1.0,
                                        "ignore_eos": True}}
        swaps = []

        def swap() -> None:
            swaps.append(httpx.post(gw.url + "/v1/weights", json=disk(ckpts[1], 1, "retract"),
                                    timeout=60))
        events = stream_until(gw.url, "/v1/rollouts",
                              [body(0, True), body(1, True), body(2, False)], 3, swap)
        (r,) = swaps
        assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
        trajs = [[ev["trajectory"] for ev in evs if ev["type"] == "trajectory"][0]
                 for evs in events]
        for t in trajs:
            assert set(t["policy_version"]) == {0, 1}, t["policy_version"]  # straddles
            check_against_ground_truth(t, models)
        for t in trajs[:2]:
            got, want = routed_rows(t), true_rows(t, models)
            assert got.shape == want.shape
            bad = np.flatnonzero((got != want).any(axis=(1, 2)))
            assert bad.size == 0, f"routed rows wrong at positions {bad.tolist()}"
            assert [s["began"] for s in t["segments"]] == ["start", "abort_resume"]
        assert [s["began"] for s in trajs[2]["segments"]] == ["start", "retract"]
        assert trajs[2].get("routed_experts") is None
