"""The reference engine over real HTTP: stamps equal a fresh full forward pass."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import orjson
import pytest

from reference_engine.config import ModelConfig
from reference_engine.reference import score

pytestmark = pytest.mark.integration
CFG = ModelConfig()
SEED = 1


def decode_routed(b64: str) -> np.ndarray:
    raw = np.frombuffer(base64.b64decode(b64), dtype="<i4")
    return raw.reshape(-1, CFG.num_hidden_layers, CFG.num_experts_per_tok)


def check_against_reference(model, prompt: list[int], out: dict, temperature: float) -> None:
    meta = out["meta_info"]
    ids = out["output_ids"]
    assert len(ids) == meta["completion_tokens"] > 0
    lps = [t[0] for t in meta["output_token_logprobs"]]
    assert [t[1] for t in meta["output_token_logprobs"]] == ids
    ref = score(model, prompt + ids, len(prompt), temperature)
    np.testing.assert_allclose(lps, ref.logprobs, atol=1e-4)
    np.testing.assert_allclose(meta["output_token_entropy"], ref.entropy, atol=1e-4)
    routed = decode_routed(meta["routed_experts"])
    assert routed.shape == (len(prompt) + len(ids) - 1, CFG.num_hidden_layers,
                            CFG.num_experts_per_tok)
    np.testing.assert_array_equal(routed, ref.routed_experts)


def gen_body(prompt, **sp):
    return {"input_ids": prompt, "sampling_params": {"max_new_tokens": 12, **sp},
            "return_logprob": True, "return_entropy": True, "return_routed_experts": True}


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, -1), (0.7, 0.8, 20), (0.0, 1.0, -1)])
def test_stamps_match_full_forward(engine, reference_model, temperature, top_p, top_k):
    prompt = [256, *b"The quick brown fox"]
    body = gen_body(prompt, temperature=temperature, top_p=top_p, top_k=top_k, sampling_seed=7)
    r = httpx.post(engine.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert meta["finish_reason"] in ({"type": "length", "length": 12},
                                     {"type": "stop", "matched": CFG.eos_token_id})
    assert meta["prompt_tokens"] == len(prompt)
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": len(out["output_ids"])}]
    assert meta["weight_version"] == "0"
    check_against_reference(reference_model((CFG, SEED)), prompt, out, temperature)
    if temperature == 0.0:  # greedy: every token is the argmax of the full forward
        ref_logits = reference_model((CFG, SEED)).forward_full(
            __import__("torch").tensor(prompt + out["output_ids"]))[0]
        argmax = ref_logits[len(prompt) - 1:-1].argmax(-1).tolist()
        assert argmax == out["output_ids"]


def test_rescoring_with_input_logprobs(engine, reference_model):
    prompt = [256, *b"abc"]
    out = httpx.post(engine.url + "/generate", json=gen_body(prompt, sampling_seed=3),
                     timeout=60).json()
    full = prompt + out["output_ids"]
    r = httpx.post(engine.url + "/generate", timeout=60, json={
        "input_ids": full, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
        "logprob_start_len": 0, "return_text_in_logprobs": True, "return_routed_experts": True})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert r.json()["output_ids"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    inp = meta["input_token_logprobs"]
    assert len(inp) == len(full) and inp[0][0] is None and inp[0][1] == 256
    assert [t[1] for t in inp] == full
    assert inp[1][2] == "a"  # return_text_in_logprobs
    stamped = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
    np.testing.assert_allclose([t[0] for t in inp[len(prompt):]], stamped, atol=1e-4)
    ref = score(reference_model((CFG, SEED)), full, 1)
    np.testing.assert_allclose([t[0] for t in inp[1:]], ref.logprobs, atol=1e-4)
    assert decode_routed(meta["routed_experts"]).shape[0] == len(full) - 1
    # logprob_start_len > 0: entries from that index, the first one None (as SGLang)
    r2 = httpx.post(engine.url + "/generate", timeout=60, json={
        "input_ids": full, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
        "logprob_start_len": 2, "return_routed_experts": True, "routed_experts_start_len": 2})
    meta2 = r2.json()["meta_info"]
    assert [t[1] for t in meta2["input_token_logprobs"]] == full[2:]
    assert meta2["input_token_logprobs"][0][0] is None
    np.testing.assert_allclose([t[0] for t in meta2["input_token_logprobs"][1:]],
                               ref.logprobs[2:], atol=1e-4)
    np.testing.assert_array_equal(decode_routed(meta2["routed_experts"]), ref.routed_experts[2:])


def test_top_logprobs_and_text(engine):
    r = httpx.post(engine.url + "/generate", timeout=60, json={
        "text": "hi", "sampling_params": {"max_new_tokens": 4, "sampling_seed": 1},
        "return_logprob": True, "top_logprobs_num": 3})
    meta = r.json()["meta_info"]
    assert meta["prompt_tokens"] == 2
    assert len(meta["output_top_logprobs"]) == 4
    for top, (lp, tid, _) in zip(meta["output_top_logprobs"], meta["output_token_logprobs"]):
        assert len(top) == 3
        vals = [t[0] for t in top]
        assert vals == sorted(vals, reverse=True)
        assert lp <= vals[0] + 1e-6


def test_stop_token_finish_reason(engine, reference_model):
    prompt = [256, *b"zz"]
    greedy = httpx.post(engine.url + "/generate", timeout=60, json={
        "input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
    third = greedy["output_ids"][2]
    r = httpx.post(engine.url + "/generate", timeout=60, json={
        "input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                  "stop_token_ids": [third]}}).json()
    idx = greedy["output_ids"].index(third)
    assert r["output_ids"] == greedy["output_ids"][:idx + 1]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": third}


def test_n_and_batch_return_lists(engine):
    r = httpx.post(engine.url + "/generate", timeout=60, json={
        "text": "x", "rid": "mine", "sampling_params": {"max_new_tokens": 3, "n": 3}})
    outs = r.json()
    assert isinstance(outs, list) and len(outs) == 3
    assert len({o["meta_info"]["id"] for o in outs}) == 3
    r = httpx.post(engine.url + "/generate", timeout=60, json={
        "input_ids": [[256, 1], [256, 2, 3]], "rid": ["b1", "b2"],
        "sampling_params": [{"max_new_tokens": 2, "ignore_eos": True},
                            {"max_new_tokens": 3, "ignore_eos": True}]})
    outs = r.json()
    assert [o["meta_info"]["id"] for o in outs] == ["b1", "b2"]
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [2, 3]
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [2, 3]


def _sse(text: str) -> list:
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [orjson.loads(e) for e in events[:-1]]


def test_streaming_cumulative(engine, reference_model):
    prompt = [256, *b"stream"]
    body = {**gen_body(prompt, sampling_seed=5, ignore_eos=True), "stream": True}
    r = httpx.post(engine.url + "/generate", json=body, timeout=60)
    chunks = _sse(r.text)
    assert len(chunks) >= 2
    lens = [len(c["output_ids"]) for c in chunks]
    assert lens == sorted(lens) and lens[-1] == 12
    for c in chunks[:-1]:
        assert c["meta_info"]["finish_reason"] is None and "routed_experts" not in c["meta_info"]
    for a, b in zip(chunks, chunks[1:]):
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    check_against_reference(reference_model((CFG, SEED)), prompt, final, 1.0)


def test_streaming_incremental(make_engine, reference_model):
    eng = make_engine(seed=SEED, incremental_streaming_output=True)
    prompt = [256, *b"inc"]
    body = {**gen_body(prompt, sampling_seed=9, ignore_eos=True), "stream": True}
    chunks = _sse(httpx.post(eng.url + "/generate", json=body, timeout=60).text)
    ids = [t for c in chunks for t in c["output_ids"]]
    lps = [t for c in chunks for t in c["meta_info"]["output_token_logprobs"]]
    ents = [t for c in chunks for t in c["meta_info"]["output_token_entropy"]]
    assert len(ids) == 12 and all(len(c["output_ids"]) >= 1 for c in chunks)
    merged = {"output_ids": ids, "meta_info": {**chunks[-1]["meta_info"],
              "output_token_logprobs": lps, "output_token_entropy": ents,
              "completion_tokens": len(ids)}}
    check_against_reference(reference_model((CFG, SEED)), prompt, merged, 1.0)


async def test_32_concurrent_requests(engine, reference_model):
    model = reference_model((CFG, SEED))
    prompts = [[256, *f"prompt number {i}".encode()] for i in range(32)]
    async with httpx.AsyncClient(timeout=120) as client:
        rs = await asyncio.gather(*(client.post(engine.url + "/generate", json={
            **gen_body(p, sampling_seed=i, ignore_eos=True), "rid": f"conc-{i}"})
            for i, p in enumerate(prompts)))
    for i, (p, r) in enumerate(zip(prompts, rs)):
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["meta_info"]["id"] == f"conc-{i}"
        assert out["meta_info"]["completion_tokens"] == 12
        check_against_reference(model, p, out, 1.0)


def test_info_endpoints(engine):
    info = httpx.get(engine.url + "/server_info").json()
    assert info["version"] == "0.5.23" and info["reference_engine"] is True
    assert httpx.get(engine.url + "/model_info").json()["weight_version"] == "0"
    assert httpx.get(engine.url + "/ready").status_code == 200
    assert httpx.get(engine.url + "/health_generate", timeout=30).status_code == 200
    assert httpx.post(engine.url + "/flush_cache").status_code == 200


async def test_client_disconnect_aborts_stream(make_engine):
    eng = make_engine(seed=SEED, step_delay_ms=25)
    async with httpx.AsyncClient(timeout=60) as c:
        async with c.stream("POST", eng.url + "/generate", json={
                "input_ids": [256, 5], "stream": True,
                "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break  # leave after the first chunk
        for _ in range(100):
            info = (await c.get(eng.url + "/server_info")).json()
            if info["num_running_reqs"] + info["num_waiting_reqs"] == 0:
                break
            await asyncio.sleep(0.05)
        assert info["num_running_reqs"] + info["num_waiting_reqs"] == 0
        assert info["decode_steps"] < 300  # aborted long before its 400 tokens


async def test_requests_beyond_max_running_wait_their_turn(make_engine, reference_model):
    eng = make_engine(seed=SEED, max_running_requests=2)
    prompts = [[256, 40 + i] for i in range(5)]
    async with httpx.AsyncClient(timeout=120) as c:
        rs = await asyncio.gather(*(c.post(eng.url + "/generate", json=gen_body(
            p, sampling_seed=i, ignore_eos=True)) for i, p in enumerate(prompts)))
    for p, r in zip(prompts, rs):
        assert r.status_code == 200
        check_against_reference(reference_model((CFG, SEED)), p, r.json(), 1.0)
