"""Weight updates mid-request in each pause mode, as SGLang 0.5.23 does them."""

from __future__ import annotations

import asyncio
import base64
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import orjson
import pytest
import torch

from reference_engine.checkpoint import build_model, to_hub_state_dict
from reference_engine.config import ModelConfig
from rollout_gateway.commands.engine_process import free_port
from reference_engine.reference import score, score_mixed

pytestmark = pytest.mark.integration
CFG = ModelConfig()
PROMPT = [256, *b"weights"]
MAX_NEW = 64


def routed(meta) -> np.ndarray:
    raw = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4")
    return raw.reshape(-1, CFG.num_hidden_layers, CFG.num_experts_per_tok)


class StreamWatcher:
    """Reads one SSE /generate stream in the background, remembering every chunk."""

    def __init__(self, client: httpx.AsyncClient, url: str, body: dict) -> None:
        self.chunks: list[dict] = []
        self.first = asyncio.Event()
        self.task = asyncio.create_task(self._run(client, url, body))

    async def _run(self, client, url, body) -> list[dict]:
        async with client.stream("POST", url + "/generate", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                self.chunks.append(orjson.loads(data))
                self.first.set()
        return self.chunks

    async def settle(self) -> int:
        """Tokens seen once the (paused) engine stops sending."""
        n = -1
        while n != len(self.chunks):
            n = len(self.chunks)
            await asyncio.sleep(0.3)
        return len(self.chunks[-1]["output_ids"])


def body(seed: int = 11) -> dict:
    return {"input_ids": PROMPT, "rid": f"swap-{seed}",
            "sampling_params": {"max_new_tokens": MAX_NEW, "ignore_eos": True, "sampling_seed": seed},
            "return_logprob": True, "return_entropy": True, "return_routed_experts": True}


async def _swap_mid_request(eng, mode: str, checkpoint_v2, flush_cache: bool):
    async with httpx.AsyncClient(timeout=120) as c:
        w = StreamWatcher(c, eng.url, body())
        await asyncio.wait_for(w.first.wait(), 30)
        r = await c.post(eng.url + "/pause_generation", json={"mode": mode})
        assert r.status_code == 200
        assert (await c.get(eng.url + "/health")).status_code == 503
        k = await w.settle()
        assert 0 < k < MAX_NEW or mode == "abort"
        blocked = asyncio.create_task(c.post(eng.url + "/generate", json={
            "input_ids": [256, 1], "sampling_params": {"max_new_tokens": 2}}))
        await asyncio.sleep(0.3)
        assert not blocked.done()  # new requests wait while paused
        up = await c.post(eng.url + "/update_weights_from_disk", json={
            "model_path": str(checkpoint_v2), "weight_version": "1", "flush_cache": flush_cache})
        # SGLang: /model_info moves only when the update succeeds (a refused flush keeps it)
        info = (await c.get(eng.url + "/model_info")).json()
        assert info["weight_version"] == ("1" if up.json()["success"] else "0")
        await c.post(eng.url + "/continue_generation", json={})
        chunks = await asyncio.wait_for(w.task, 60)
        late = await asyncio.wait_for(blocked, 60)
        assert late.status_code == 200
        assert late.json()["meta_info"]["weight_versions"] == [{"version": "1", "start": 0, "end": 2}]
        assert (await c.get(eng.url + "/health")).status_code == 200
        return k, up, chunks[-1]


async def test_abort_mode_returns_partial_output(make_engine, checkpoint_v2, reference_model):
    eng = make_engine(seed=1, step_delay_ms=25)
    k, up, final = await _swap_mid_request(eng, "abort", checkpoint_v2, True)
    assert up.json()["success"] is True  # nothing resident after abort: flush succeeds
    meta = final["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    n = len(final["output_ids"])
    assert n == k and 0 < n < MAX_NEW
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": n}]
    ref = score(reference_model((CFG, 1)), PROMPT + final["output_ids"], len(PROMPT))
    np.testing.assert_allclose([t[0] for t in meta["output_token_logprobs"]], ref.logprobs, atol=1e-4)


async def test_retract_mode_recomputes_prefix_with_new_weights(make_engine, checkpoint_v2,
                                                                reference_model):
    eng = make_engine(seed=1, step_delay_ms=25)
    k, up, final = await _swap_mid_request(eng, "retract", checkpoint_v2, True)
    assert up.json()["success"] is True, up.json()  # retracted requests hold no KV
    meta = final["meta_info"]
    ids = final["output_ids"]
    assert meta["finish_reason"] == {"type": "length", "length": MAX_NEW} and len(ids) == MAX_NEW
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": k},
                                       {"version": "1", "start": k, "end": MAX_NEW}]
    assert meta["num_retractions"] == 1
    lps = np.array([t[0] for t in meta["output_token_logprobs"]])
    old = score(reference_model((CFG, 1)), PROMPT + ids, len(PROMPT))
    new = score(reference_model(checkpoint_v2), PROMPT + ids, len(PROMPT))
    np.testing.assert_allclose(lps[:k], old.logprobs[:k], atol=1e-4)
    np.testing.assert_allclose(lps[k:], new.logprobs[k:], atol=1e-4)
    np.testing.assert_allclose(meta["output_token_entropy"][k:], new.entropy[k:], atol=1e-4)
    np.testing.assert_array_equal(routed(meta), new.routed_experts)  # whole prefix re-prefilled


@pytest.mark.parametrize("overlap", [False, True])
async def test_in_place_mode_keeps_old_kv(make_engine, checkpoint_v2, reference_model, overlap):
    """Exact by default (SGLang --disable-overlap-schedule). With the overlap scheduler
    emulated (SGLang's default), the result in flight at the pause is processed after the
    update: the first token labelled "1" was computed by the old weights."""
    eng = make_engine(seed=1, step_delay_ms=25,
                      extra_args=["--enable-overlap-schedule"] if overlap else [])
    k, up, final = await _swap_mid_request(eng, "in_place", checkpoint_v2, False)
    assert up.json()["success"] is True
    meta = final["meta_info"]
    ids = final["output_ids"]
    assert len(ids) == MAX_NEW and meta["num_retractions"] == 0
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": k},
                                       {"version": "1", "start": k, "end": MAX_NEW}]
    v1, v2 = reference_model((CFG, 1)), reference_model(checkpoint_v2)
    # first position fed to the model under the new weights: one later under overlap
    switch = len(PROMPT) + k - 1 + int(overlap)
    mixed = score_mixed(v1, v2, PROMPT + ids, switch, len(PROMPT))
    lps = np.array([t[0] for t in meta["output_token_logprobs"]])
    np.testing.assert_allclose(lps, mixed.logprobs, atol=1e-4)
    np.testing.assert_allclose(meta["output_token_entropy"], mixed.entropy, atol=1e-4)
    np.testing.assert_array_equal(routed(meta), mixed.routed_experts)
    fresh = score(v2, PROMPT + ids, len(PROMPT))  # the test can tell stale KV from fresh
    assert np.abs(fresh.logprobs[k + 1:] - lps[k + 1:]).max() > 1e-3
    if overlap:  # and the spans' own boundary is one token early
        labelled = score_mixed(v1, v2, PROMPT + ids, len(PROMPT) + k - 1, len(PROMPT))
        assert np.abs(labelled.logprobs[k:] - lps[k:]).max() > 1e-3
        async with httpx.AsyncClient() as c:
            info = (await c.get(eng.url + "/server_info")).json()
        assert info["disable_overlap_schedule"] is False


@pytest.mark.parametrize("strict", [False, True])
async def test_in_place_flush_cache_true_fails_but_swaps(make_engine, checkpoint_v2,
                                                         reference_model, strict):
    """SGLang 0.5.23: HTTP 400, success false, the weights swapped and the scheduler labelling
    new tokens with the new version, but /model_info keeps the old version and model_path
    (strict /server_info: internal_states shows the scheduler's new ones)."""
    eng = make_engine(seed=1, step_delay_ms=25, sglang_strict=strict,
                      extra_args=["--disable-overlap-schedule"] if strict else [])
    async with httpx.AsyncClient() as c:
        path_before = (await c.get(eng.url + "/model_info")).json()["model_path"]
    k, up, final = await _swap_mid_request(eng, "in_place", checkpoint_v2, True)
    assert up.status_code == 400 and up.json() == {
        "success": False, "num_paused_requests": 0,
        "message": "Weights were updated, but the cache was not flushed because requests are "
                   "still running or queued. Retract or finish them, then call /flush_cache."}
    meta = final["meta_info"]
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": k},
                                       {"version": "1", "start": k, "end": MAX_NEW}]
    async with httpx.AsyncClient() as c:
        info = (await c.get(eng.url + "/model_info")).json()
        server = (await c.get(eng.url + "/server_info")).json()
    assert info["weight_version"] == "0" and info["model_path"] == path_before
    if strict:
        assert server["internal_states"][0]["weight_version"] == "1"
        assert server["internal_states"][0]["model_path"] == str(checkpoint_v2)
    ids = final["output_ids"]
    mixed = score_mixed(reference_model((CFG, 1)), reference_model(checkpoint_v2), PROMPT + ids,
                        len(PROMPT) + k - 1, len(PROMPT))  # swapped all the same
    np.testing.assert_allclose([t[0] for t in meta["output_token_logprobs"]], mixed.logprobs,
                               atol=1e-4)


async def test_update_without_pause_waits_for_inflight(make_engine, checkpoint_v2):
    eng = make_engine(seed=1, step_delay_ms=25)
    async with httpx.AsyncClient(timeout=120) as c:
        w = StreamWatcher(c, eng.url, body(3))
        await asyncio.wait_for(w.first.wait(), 30)
        up = await c.post(eng.url + "/update_weights_from_disk", json={
            "model_path": str(checkpoint_v2), "weight_version": "2"})
        assert up.json()["success"] is True
        final = (await w.task)[-1]
        assert len(final["output_ids"]) == MAX_NEW
        assert final["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": MAX_NEW}]
        assert (await c.get(eng.url + "/model_info")).json()["weight_version"] == "2"


async def test_update_weight_version_aborts_by_default(make_engine):
    eng = make_engine(seed=1, step_delay_ms=25)
    async with httpx.AsyncClient(timeout=120) as c:
        w = StreamWatcher(c, eng.url, body(4))
        await asyncio.wait_for(w.first.wait(), 30)
        r = await c.post(eng.url + "/update_weight_version", json={"new_version": "7"})
        assert r.status_code == 200
        final = (await w.task)[-1]
        assert final["meta_info"]["finish_reason"]["type"] == "abort"
        assert (await c.get(eng.url + "/model_info")).json()["weight_version"] == "7"
        r = await c.post(eng.url + "/abort_request", json={"rid": "nothing", "abort_all": False})
        assert r.status_code == 200 and r.json()["num_aborted"] == 0


async def test_abort_request_by_rid_prefix(make_engine):
    eng = make_engine(seed=1, step_delay_ms=25)
    async with httpx.AsyncClient(timeout=120) as c:
        a = StreamWatcher(c, eng.url, {**body(5), "rid": "grp-a"})
        a2 = StreamWatcher(c, eng.url, {**body(7), "rid": "grp-a-2"})
        b = StreamWatcher(c, eng.url, {**body(6), "rid": "keep-b"})
        await asyncio.wait_for(asyncio.gather(a.first.wait(), a2.first.wait(), b.first.wait()), 30)
        # SGLang 0.5.23: the rid must be a live request's exact id (else ignored) ...
        for rid in ("grp-", ""):
            r = await c.post(eng.url + "/abort_request", json={"rid": rid})
            assert r.json()["num_aborted"] == 0
        # ... and the scheduler then aborts every rid starting with it
        r = await c.post(eng.url + "/abort_request", json={"rid": "grp-a"})
        assert r.json()["num_aborted"] == 2
        fa, fa2, fb = (await a.task)[-1], (await a2.task)[-1], (await b.task)[-1]
        assert fa["meta_info"]["finish_reason"]["type"] == "abort"
        assert fa2["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(fa["output_ids"]) < MAX_NEW
        assert fb["meta_info"]["finish_reason"] == {"type": "length", "length": MAX_NEW}


def test_distributed_update_over_gloo(make_engine, reference_model):
    """This test process plays the learner: rank 0 of a gloo group, broadcasting weights."""
    from reference_engine.distributed import init_custom_process_group

    eng = make_engine(seed=1)
    greedy = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0},
              "return_logprob": True}
    before = httpx.post(eng.url + "/generate", json=greedy, timeout=60).json()
    new_model = build_model(CFG, 2)
    named = to_hub_state_dict(new_model)
    names = list(named)
    port = free_port()
    with ThreadPoolExecutor(2) as pool:
        assert httpx.post(eng.url + "/begin_weight_update", json={"selector": "all"}).json()["success"]
        fut = pool.submit(httpx.post, eng.url + "/init_weights_update_group", timeout=60, json={
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2, "group_name": "wu", "backend": "gloo"})
        pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, "wu")
        assert fut.result().json()["success"] is True
        fut = pool.submit(httpx.post, eng.url + "/update_weights_from_distributed", timeout=60,
                          json={"names": names, "dtypes": ["float32"] * len(names),
                                "shapes": [list(named[n].shape) for n in names],
                                "group_name": "wu", "weight_version": "5", "flush_cache": True})
        for n in names:
            torch.distributed.broadcast(named[n], src=0, group=pg)
        res = fut.result()
        assert res.status_code == 200 and res.json()["success"] is True, res.text
        assert httpx.post(eng.url + "/end_weight_update", json={}).json()["success"]
        torch.distributed.destroy_process_group(pg)
    assert httpx.get(eng.url + "/model_info").json()["weight_version"] == "5"
    after = httpx.post(eng.url + "/generate", json=greedy, timeout=60).json()
    ref = new_model.forward_full(torch.tensor(PROMPT + after["output_ids"]))[0]
    assert ref[len(PROMPT) - 1:-1].argmax(-1).tolist() == after["output_ids"]
    ref_lp = score(new_model, PROMPT + after["output_ids"], len(PROMPT), 0.0).logprobs
    np.testing.assert_allclose([t[0] for t in after["meta_info"]["output_token_logprobs"]],
                               ref_lp, atol=1e-4)
    assert after["meta_info"]["weight_versions"] == [{"version": "5", "start": 0, "end": 8}]
    assert [t[0] for t in after["meta_info"]["output_token_logprobs"]] != \
        [t[0] for t in before["meta_info"]["output_token_logprobs"]]
