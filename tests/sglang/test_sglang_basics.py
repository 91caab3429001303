"""The real SGLang 0.5.23 server (CPU, float32) against the reference model: the ground truth
of the whole conformance suite.

Every number SGLang returns here is recomputed by the reference engine's model code on the same
checkpoint (a fresh full forward pass, float32): output and input logprobs to 1e-4, top-k
logprobs, routed experts identical; after ``/update_weights_from_disk`` the same under the new
weights (and provably not the old ones). Also: SGLang's own tokenizer path (text prompts, chat
template) gives the ids of our ``ByteTokenizer`` / ``ReferenceTemplate``, and the fixture itself
(options, restart on the same port, no leaked processes).
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
from _sglang_support import _group_members

from reference_engine.config import ModelConfig
from reference_engine.reference import score
from reference_engine.sampling import scaled_logprobs
from reference_engine.tokenizer import BOS_ID, EOS_ID, ByteTokenizer

CFG = ModelConfig()
L, K = CFG.num_hidden_layers, CFG.num_experts_per_tok
TOL = 1e-4
TOK = ByteTokenizer()
PROMPT = TOK.encode("The quick brown fox", add_bos=True)


def generate(url: str, **body) -> dict:
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def logprob_body(ids: list[int], n: int, temperature: float, top: int = 3) -> dict:
    return {"input_ids": ids,
            "sampling_params": {"max_new_tokens": n, "temperature": temperature,
                                "ignore_eos": True},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": top,
            "return_routed_experts": True}


def routed_experts(meta: dict) -> np.ndarray:
    flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
    return flat.reshape(-1, L, K)


def check_against_reference(model, prompt: list[int], out: dict, temperature: float) -> dict:
    """Assert every logprob, top-k entry and routing row SGLang returned equals recomputation by
    ``model``; returns the largest differences seen.

    SGLang 0.5.23 scales the *output* logprobs (and their top-k) by the request's temperature
    (log_softmax(logits / T); greedy: T = 1) but returns the *input* (prompt) logprobs of the
    raw logits, T = 1, whatever the temperature (``logprob_processor.py``)."""
    meta = out["meta_info"]
    output_ids = [t for _, t, _ in meta["output_token_logprobs"]]
    ids = prompt + output_ids
    t = 1.0 if temperature == 0 else temperature
    ref = score(model, ids, start=len(prompt), temperature=t)
    ref_in = score(model, prompt, start=1, temperature=1.0)
    got_out = np.array([lp for lp, _, _ in meta["output_token_logprobs"]], dtype=np.float64)
    got_in = np.array([lp for lp, _, _ in meta["input_token_logprobs"][1:]], dtype=np.float64)
    assert meta["input_token_logprobs"][0][0] is None  # nothing scores the first token
    assert [tok for _, tok, _ in meta["input_token_logprobs"]] == prompt
    d_out = np.abs(got_out - ref.logprobs).max()
    d_in = np.abs(got_in - ref_in.logprobs).max()
    assert d_out < TOL, (d_out, got_out, ref.logprobs)
    assert d_in < TOL, (d_in, got_in, ref_in.logprobs)

    # top-k: the values are the k largest of the reference distribution, and each id's value
    # is the reference logprob of that id (output rows at T, prompt rows at T = 1)
    logits, _ = model.forward_full(torch.tensor(ids))
    logp = scaled_logprobs(logits, torch.full((len(ids),), t)).numpy()
    logp1 = scaled_logprobs(logits, torch.ones(len(ids))).numpy()
    rows = [(top, logp[len(prompt) - 1 + i]) for i, top in enumerate(meta["output_top_logprobs"])]
    assert meta["input_top_logprobs"][0] is None
    rows += [(top, logp1[i]) for i, top in enumerate(meta["input_top_logprobs"][1:])]
    assert len(rows) == len(ids) - 1
    d_top = 0.0
    for top, row in rows:
        want = np.sort(row)[::-1][:len(top)]
        got_vals = np.array([lp for lp, _, _ in top])
        got_ref = np.array([row[tok] for _, tok, _ in top])
        d_top = max(d_top, np.abs(got_vals - want).max(), np.abs(got_vals - got_ref).max())
    assert d_top < TOL, d_top
    if temperature == 0:  # greedy: every output token is the reference argmax
        assert output_ids == [int(np.argmax(logp[len(prompt) - 1 + i]))
                              for i in range(len(output_ids))]

    got_routing = routed_experts(meta)
    assert got_routing.shape == (len(ids) - 1, L, K)
    assert np.array_equal(got_routing, ref.routed_experts)
    return {"output": d_out, "input": d_in, "top": d_top}


def test_generate_greedy_matches_reference(sglang, sglang_reference):
    out = generate(sglang.url, **logprob_body(PROMPT, 12, 0.0))
    meta = out["meta_info"]
    assert meta["weight_version"] == "0"
    assert meta["completion_tokens"] == 12
    assert len(meta["output_top_logprobs"]) == 12
    print("max |sglang - reference|:", check_against_reference(sglang_reference("0"), PROMPT,
                                                                 out, 0.0))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generate_sampled_matches_reference(sglang, sglang_reference, temperature):
    # SGLang returns the temperature-scaled logprob of what it sampled
    out = generate(sglang.url, **logprob_body(PROMPT, 10, temperature))
    print("max |sglang - reference|:", check_against_reference(sglang_reference("0"), PROMPT,
                                                                 out, temperature))


def test_weights_not_interchangeable(sglang, sglang_reference):
    """The check above could fail: v0's answer does not match v1's weights."""
    out = generate(sglang.url, **logprob_body(PROMPT, 6, 0.0))
    with pytest.raises(AssertionError):
        check_against_reference(sglang_reference("1"), PROMPT, out, 0.0)


def test_update_weights_from_disk_then_matches_new_weights(sglang, sglang_checkpoints,
                                                           sglang_reference):
    before = generate(sglang.url, **logprob_body(PROMPT, 8, 0.0))
    r = httpx.post(sglang.url + "/update_weights_from_disk",
                   json={"model_path": str(sglang_checkpoints.path("1")), "weight_version": "1"},
                   timeout=120)
    assert r.status_code == 200 and r.json()["success"], r.text
    info = sglang.model_info()
    assert info["weight_version"] == "1"
    assert info["model_path"] == str(sglang_checkpoints.path("1"))

    after = generate(sglang.url, **logprob_body(PROMPT, 8, 0.0))
    meta = after["meta_info"]
    assert meta["weight_version"] == "1"
    assert meta["weight_versions"] == [{"version": "1", "start": 0, "end": 8}]
    check_against_reference(sglang_reference("1"), PROMPT, after, 0.0)
    with pytest.raises(AssertionError):  # not the old weights any more
        check_against_reference(sglang_reference("0"), PROMPT, after, 0.0)
    assert [t for _, t, _ in before["meta_info"]["output_token_logprobs"]] != \
        [t for _, t, _ in meta["output_token_logprobs"]]


def test_text_prompt_uses_byte_tokenizer_ids(sglang, sglang_reference):
    text = "héllo wörld 🙂 <|bos|>x"
    out = generate(sglang.url, text=text,
                   sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
                   return_logprob=True, logprob_start_len=0)
    meta = out["meta_info"]
    want = TOK.encode("héllo wörld 🙂 ") + [BOS_ID] + TOK.encode("x")
    assert [t for _, t, _ in meta["input_token_logprobs"]] == want  # no BOS added by SGLang
    output_ids = [t for _, t, _ in meta["output_token_logprobs"]]
    assert out["text"] == TOK.decode(output_ids)
    # and the logprobs are those of the byte ids
    ref = score(sglang_reference("0"), want + output_ids, start=len(want))
    got = np.array([lp for lp, _, _ in meta["output_token_logprobs"]])
    assert np.abs(got - ref.logprobs).max() < TOL


def test_chat_uses_reference_template(sglang):
    from rollout_gateway.sessions.templates import ReferenceTemplate

    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Héllo?"}]
    r = httpx.post(sglang.url + "/v1/chat/completions", timeout=120, json={
        "model": "default", "messages": messages, "max_tokens": 4, "temperature": 0,
        "return_prompt_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    tpl = ReferenceTemplate()
    want = tpl.encode(tpl.render(messages, tools=None, add_generation_prompt=True))
    assert want[0] == BOS_ID and want.count(EOS_ID) == 2
    assert choice["prompt_token_ids"] == want


def test_chat_template_renders_like_reference_template(sglang_checkpoints):
    """The tokenizer files written next to the checkpoints, loaded as SGLang loads them
    (transformers.AutoTokenizer), render tools and tool calls as the gateway's template."""
    from transformers import AutoTokenizer

    from rollout_gateway.sessions.templates import ReferenceTemplate

    tok = AutoTokenizer.from_pretrained(str(sglang_checkpoints.path("0")))
    tools = [{"type": "function", "function": {"name": "add", "description": "a+b",
                                               "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "1+2?"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"id": "c0", "type": "function",
                                 "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
                {"role": "tool", "content": "3"}]
    tpl = ReferenceTemplate()
    for kw in ({"tools": None}, {"tools": tools}):
        want = tpl.render(messages, add_generation_prompt=True, **kw)
        got = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
        assert got == want
        assert tok.encode(got, add_special_tokens=False) == tpl.encode(want)


def test_server_options(sglang_pool):
    """A pooled server with the non-default options (kept for later tests asking the same)."""
    srv = sglang_pool.get(overlap_schedule=False, skip_tokenizer_init=True,
                          incremental_streaming_output=True)
    info = srv.server_info()
    assert info["disable_overlap_schedule"] is True
    assert info["skip_tokenizer_init"] is True
    assert info["incremental_streaming_output"] is True
    procs = srv.processes()
    assert len(procs) >= 3  # HTTP server, scheduler, detokenizer (+ resource tracker)
    print(f"\nsglang start {srv.start_seconds:.1f}s, rss {srv.rss_bytes() / 2**30:.2f} GiB "
          f"over {len(procs)} processes")
    # text needs a tokenizer: SGLang answers a client error and keeps serving
    r = httpx.post(srv.url + "/generate", timeout=60,
                   json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400, r.text
    out = generate(srv.url, input_ids=PROMPT, sampling_params={"max_new_tokens": 3})
    assert len(out["output_ids"]) == 3 and srv.running()


def test_restart_on_same_port_with_other_weights(sglang, sglang_checkpoints, sglang_reference):
    """restart(): stop (no process of the old group left: the fixture's stop() leaks nothing),
    start on the same port with v1. The ``sglang`` fixture puts v0 back afterwards."""
    port, pgid = sglang.port, sglang.pid  # the server leads its own process group
    old = sglang.processes()
    sglang.restart(model_path=sglang_checkpoints.path("1"), weight_version="1")
    print(f"\nsglang restart {sglang.start_seconds:.1f}s")
    assert _group_members(pgid) == []
    assert sglang.port == port and not set(old) & set(sglang.processes())
    info = sglang.model_info()
    assert info["weight_version"] == "1"
    assert info["model_path"] == str(sglang_checkpoints.path("1"))
    out = generate(sglang.url, **logprob_body(PROMPT, 6, 0.0))
    assert out["meta_info"]["weight_version"] == "1"
    check_against_reference(sglang_reference("1"), PROMPT, out, 0.0)
