"""The gateway in front of an engine answering exactly as SGLang 0.5.23 does (the reference
engine with ``--sglang-strict``), registered with nothing but ``--engine URL``.

SGLang's /model_info has no layer or expert counts and SGLang returns no entropy: the
routing shape comes from the HF config.json under model_path, the entropy is the top-k
estimate. Everything is checked against fresh forward passes of the same weights."""

from __future__ import annotations

import asyncio
import base64
import time

import httpx
import numpy as np
import pytest
from _gateway_support import GatewayProcess, check_against_ground_truth, redis_urls, rollout

from reference_engine.config import ModelConfig
from rollout_gateway.commands.engine_process import EngineProcess
from reference_engine.reference import score
from reference_engine.tokenizer import ByteTokenizer

pytestmark = pytest.mark.integration

SEED = 5
L, K = ModelConfig().num_hidden_layers, ModelConfig().num_experts_per_tok


@pytest.fixture(scope="module")
def strict_engine():
    with EngineProcess(seed=SEED, weight_version="0", sglang_strict=True,
                       enable_return_routed_experts=True) as eng:
        yield eng


@pytest.fixture(scope="module")
def urls():
    return redis_urls()


@pytest.fixture(scope="module")
def gw(strict_engine, urls):
    with GatewayProcess({"e0": strict_engine.url}, store_url=urls[0],
                        registry_url=urls[1]) as g:
        yield g


@pytest.fixture(scope="module")
def model(reference_model):
    return reference_model((ModelConfig(), SEED))


def published(urls) -> int:
    from rollout_gateway.store.factory import store_from_url

    async def stats():
        store = store_from_url(urls[0])
        try:
            return (await store.stats()).published
        finally:
            await store.close()

    return asyncio.run(stats())


def test_strict_engine_speaks_sglang_only(strict_engine):
    info = httpx.get(strict_engine.url + "/model_info").json()
    assert set(info) == {"model_path", "tokenizer_path", "is_generation",
                         "preferred_sampling_params", "weight_version",
                         "has_image_understanding", "has_audio_understanding", "model_type",
                         "architectures"}
    assert isinstance(info["weight_version"], str)
    cfg = ModelConfig.from_arg(info["model_path"])  # a HF config.json sits there
    assert cfg.num_hidden_layers == L
    body = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 3},
            "return_logprob": True, "return_entropy": True}
    meta = httpx.post(strict_engine.url + "/generate", json=body).json()["meta_info"]
    assert "output_token_entropy" not in meta  # SGLang's return_entropy is a stub


def test_rollouts_carry_routing_row_for_row_and_topk_entropy_within_bound(gw, model, urls):
    before = published(urls)
    prompt = [1, 2, 3, 4, 5]
    trajs = rollout(gw.url, prompt, n=3, max_new_tokens=10)["trajectories"]
    for t in trajs:
        check_against_ground_truth(t, {0: model})
        sc = score(model, prompt + t["token_ids"], len(prompt))
        r = t["routed_experts"]
        assert r["shape"] == [len(prompt) + 10 - 1, L, K]
        got = np.frombuffer(base64.b64decode(r["data_b64"]), np.uint8).reshape(r["shape"])
        np.testing.assert_array_equal(got, sc.routed_experts)  # row for row
        assert t["entropy_kind"] == "topk_estimate"
        bound = t["entropy_error_bound"]
        assert 0 < bound < np.inf
        err = np.abs(np.array(t["entropy"], np.float64) - sc.entropy)
        assert (err <= bound + 1e-4).all(), (err.max(), bound)  # holds for every token
    assert published(urls) == before + 3


def test_generate_returns_every_requested_field(gw, model):
    tok = ByteTokenizer()
    prompt = [1, 72, 105, 33, 9]
    body = {"input_ids": prompt, "rid": "slime-7",
            "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True},
            "return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": 3,
            "return_text_in_logprobs": True, "return_routed_experts": True,
            "routed_experts_start_len": 2}
    r = httpx.post(gw.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    meta, ids = out["meta_info"], out["output_ids"]
    sc = score(model, prompt + ids, 1)
    assert meta["id"] == "slime-7" and meta["prompt_tokens"] == 5
    assert [row[1] for row in meta["output_token_logprobs"]] == ids
    assert all(row[2] == tok.token_text(row[1]) for row in meta["output_token_logprobs"])
    np.testing.assert_allclose([row[0] for row in meta["output_token_logprobs"]],
                               sc.logprobs[4:], atol=2e-3)
    # input logprobs from position 1 (SGLang: the start token's is null, the others are
    # scored given what precedes them)
    inp = meta["input_token_logprobs"]
    assert [row[1] for row in inp] == prompt[1:] and inp[0][0] is None
    np.testing.assert_allclose([row[0] for row in inp[1:]], sc.logprobs[1:4], atol=2e-3)
    assert len(meta["input_top_logprobs"]) == len(inp) and meta["input_top_logprobs"][0] is None
    top = meta["output_top_logprobs"]
    assert len(top) == len(ids) and all(len(row) == 3 for row in top)
    assert all(row[0][0] >= row[1][0] >= row[2][0] for row in top)
    assert all(isinstance(e[2], str) for row in top for e in row)
    routed = np.frombuffer(base64.b64decode(meta["routed_experts"]), "<i4")
    assert routed.size == (5 + 6 - 1 - 2) * L * K  # rows from routed_experts_start_len
    np.testing.assert_array_equal(routed.reshape(-1, L, K), sc.routed_experts[2:])
    assert meta["policy_versions"] == [0] * 6 and meta["entropy_kind"] == "topk_estimate"


def test_generate_batches_and_n_are_lists_each_stamped_and_published(gw, urls):
    before = published(urls)
    body = {"input_ids": [[1, 2, 3], [4, 5]], "rid": ["a", "b"],
            # ignore_eos: a sampled end of sequence would end an output early (seen in CI)
            "sampling_params": [{"max_new_tokens": 4, "n": 2, "ignore_eos": True},
                                {"max_new_tokens": 3, "ignore_eos": True}],
            "return_logprob": True}
    r = httpx.post(gw.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    outs = r.json()
    assert isinstance(outs, list) and len(outs) == 3
    assert [o["index"] for o in outs] == [0, 1, 2]
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [3, 3, 2]
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [4, 4, 3]
    assert outs[2]["meta_info"]["id"] == "b"
    assert len({o["meta_info"]["trajectory_id"] for o in outs}) == 3
    for o in outs:
        assert len(o["meta_info"]["policy_versions"]) == len(o["output_ids"])
    assert published(urls) == before + 3


def test_generate_streams_cumulative_with_top_logprobs(gw):
    body = {"text": "hi", "stream": True, "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
    chunks = []
    with httpx.stream("POST", gw.url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(httpx.Response(200, content=line[6:]).json())
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    assert len(final["meta_info"]["output_top_logprobs"]) == 5
    lens = [len(c["output_ids"]) for c in chunks]
    assert lens == sorted(lens) and lens[-1] == 5  # cumulative
    for c in chunks[:-1]:
        assert len(c["meta_info"]["output_top_logprobs"]) == len(c["output_ids"])


def test_unknowable_shape_is_a_clear_error_logged_once(make_engine, tmp_path):
    """model_path not readable by the gateway, no settings: asking for routing is a 409
    naming what to configure; not asking still works; settings fix it."""
    eng = make_engine(seed=SEED, sglang_strict=True, enable_return_routed_experts=True,
                      model_path=tmp_path / "model")
    (tmp_path / "model" / "config.json").unlink()  # the gateway's view: not mounted
    with GatewayProcess({"e0": eng.url}) as g:
        r = httpx.post(g.url + "/v1/rollouts", json={"input_ids": [1, 2], "return_routed_experts": True,
                                                     "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 409, r.text
        msg = r.json()["error"]["message"]
        assert "ROLLOUT_GATEWAY_MODEL__NUM_LAYERS" in msg and "config.json" in msg
        r = httpx.post(g.url + "/generate", json={"input_ids": [1, 2], "return_routed_experts": True})
        assert r.status_code == 409 and "ROLLOUT_GATEWAY_MODEL__TOP_K" in r.text
        t = rollout(g.url, [1, 2], max_new_tokens=2)["trajectories"][0]  # not asked: fine
        assert "routed_experts" not in t or t["routed_experts"] is None
        assert g.log_tail(20000).count("routing shape of engine e0 is unknown") == 1
    env = {"ROLLOUT_GATEWAY_MODEL__NUM_LAYERS": str(L), "ROLLOUT_GATEWAY_MODEL__TOP_K": str(K),
           "ROLLOUT_GATEWAY_MODEL__NUM_EXPERTS": "8"}
    with GatewayProcess({"e0": eng.url}, env=env) as g:
        t = rollout(g.url, [1, 2], max_new_tokens=3, return_routed_experts=True)["trajectories"][0]
        assert t["routed_experts"]["shape"] == [4, L, K]
    env["ROLLOUT_GATEWAY_MODEL__TOP_K"] = str(K + 1)  # wrong: every payload is checked
    with GatewayProcess({"e0": eng.url}, env=env) as g:
        r = httpx.post(g.url + "/v1/rollouts", timeout=180, json={"input_ids": [1, 2],
                                                     "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code >= 500 and "routed_experts" in r.text


def test_engine_without_the_routing_flag_is_named(make_engine):
    eng = make_engine(seed=SEED, sglang_strict=True, weight_version="0")
    with GatewayProcess({"e0": eng.url}) as g:
        r = httpx.post(g.url + "/v1/rollouts", json={"input_ids": [1, 2], "return_routed_experts": True,
                                                     "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 409 and "--enable-return-routed-experts" in r.text
        assert rollout(g.url, [1, 2], max_new_tokens=2)["trajectories"][0]["num_tokens"] == 2


def test_string_weight_version_is_refused_at_registration(make_engine, gw):
    eng = make_engine(seed=SEED, sglang_strict=True, weight_version=None)  # SGLang's "default"
    assert httpx.get(eng.url + "/model_info").json()["weight_version"] == "default"
    r = httpx.post(gw.url + "/v1/engines", json={"id": "dflt", "url": eng.url})
    assert r.status_code == 503
    msg = r.json()["error"]["message"]
    assert "'default'" in msg and "--weight-version" in msg
    assert "dflt" not in {e["id"] for e in httpx.get(gw.url + "/v1/engines").json()["engines"]}
    # configured at start-up instead: kept out of rotation with the reason, no crash
    with GatewayProcess({"d": eng.url}) as g:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            e = httpx.get(g.url + "/v1/engines/d").json()
            if e["last_error"]:
                break
            time.sleep(0.1)
        assert e["state"] == "unhealthy" and "--weight-version" in e["last_error"]


# ---- existing rollout code, replayed: the payloads slime, AReaL and verl send to SGLang's
# /generate (read from their source), answers parsed the way their code parses them ------

def _post(url: str, payload: dict) -> dict:
    r = httpx.post(url + "/generate", json=payload, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_slime_payload(gw, model):
    """slime/rollout/sglang_rollout.py generate(): input_ids, its sampling params (None
    stop lists, no_stop_trim, spaces_between_special_tokens), return_logprob, and with
    --use-rollout-routing-replay return_routed_experts; routing decoded as in its
    Sample: int32 reshaped to (len(tokens) - 1, num_layers, moe_router_topk)."""
    import pybase64

    prompt_ids = [1, 40, 41, 42]
    sampling_params = dict(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=8, stop=None,
                           stop_token_ids=None, skip_special_tokens=False, no_stop_trim=True,
                           spaces_between_special_tokens=False, sampling_seed=1234)
    payload = {"sampling_params": sampling_params, "return_logprob": True,
               "return_routed_experts": True, "input_ids": prompt_ids}
    output = _post(gw.url, payload)
    new_tokens = [item[1] for item in output["meta_info"]["output_token_logprobs"]]
    new_log_probs = [item[0] for item in output["meta_info"]["output_token_logprobs"]]
    assert isinstance(output["text"], str)
    assert output["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    tokens = prompt_ids + new_tokens
    routed = np.frombuffer(pybase64.b64decode(output["meta_info"]["routed_experts"].encode("ascii")),
                           dtype=np.int32).reshape(len(tokens) - 1, L, K)
    sc = score(model, tokens, len(prompt_ids))
    np.testing.assert_allclose(new_log_probs, sc.logprobs, atol=2e-3)
    np.testing.assert_array_equal(routed, sc.routed_experts)


def test_areal_payload_with_its_abort_loop(gw, model):
    """areal/engine/sglang_remote.py agenerate(): input_ids, image_data None, its sampling
    params, return_logprob, stream false; loops while finish_reason type is not
    stop/length, appending output tokens to input_ids."""
    input_ids = [1, 50, 51]
    sample_params = {"top_p": 1.0, "top_k": -1, "max_new_tokens": 7, "temperature": 1.0,
                     "stop_token_ids": [2], "frequency_penalty": 0.0}
    payload = {"input_ids": list(input_ids), "image_data": None,
               "sampling_params": sample_params, "return_logprob": True, "stream": False}
    tokens, logprobs, stop_reason = [], [], None
    while stop_reason not in ("stop", "tool_calls", "length") and len(tokens) < 7:
        meta_info = _post(gw.url, payload)["meta_info"]
        finish_reason = meta_info["finish_reason"]
        stop_reason = finish_reason["type"]
        out = [x[1] for x in meta_info["output_token_logprobs"]]
        tokens += out
        logprobs += [x[0] for x in meta_info["output_token_logprobs"]]
        payload["input_ids"] += out
        sample_params["max_new_tokens"] -= len(out)
    assert stop_reason in ("stop", "length") and 0 < len(tokens) <= 7
    sc = score(model, input_ids + tokens, len(input_ids))
    np.testing.assert_allclose(logprobs, sc.logprobs, atol=2e-3)


def test_verl_payload(gw, model):
    """verl's HttpServerEngineAdapter.generate(): its keyword payload with None values
    filtered out; the agent loop reads output_ids and output_token_logprobs [x[0]]."""
    payload = {"text": None, "sampling_params": {"temperature": 1.0, "top_p": 1.0,
                                                 "top_k": -1, "repetition_penalty": 1.0,
                                                 "max_new_tokens": 6},
               "input_ids": [1, 60, 61], "image_data": None, "return_logprob": True,
               "logprob_start_len": None, "top_logprobs_num": None, "token_ids_logprob": None,
               "lora_path": None, "custom_logit_processor": None}
    payload = {k: v for k, v in payload.items() if v is not None}
    output = _post(gw.url, payload)
    token_ids = output["output_ids"]
    log_probs = [x[0] for x in output["meta_info"]["output_token_logprobs"]]
    assert len(token_ids) == len(log_probs) == output["meta_info"]["completion_tokens"]
    sc = score(model, [1, 60, 61] + token_ids, 3)
    np.testing.assert_allclose(log_probs, sc.logprobs, atol=2e-3)
    # and the same request with SGLang's None-valued defaults left in (no filtering)
    unfiltered = {"text": None, "input_ids": [1, 60, 61], "image_data": None, "lora_path": None,
                  "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
    assert len(_post(gw.url, unfiltered)["output_ids"]) == 2


def _sse(url: str, body: dict) -> list[dict]:
    import json

    chunks = []
    with httpx.stream("POST", url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_generate_streams_deltas_when_engines_are_incremental(make_engine):
    eng = make_engine(seed=SEED, sglang_strict=True, enable_return_routed_experts=True,
                      weight_version="0", incremental_streaming_output=True, step_delay_ms=5)
    with GatewayProcess({"e0": eng.url}) as g:
        body = {"input_ids": [1, 2, 3], "stream": True, "return_logprob": True,
                "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 6,
                                                           "ignore_eos": True}}
        chunks = _sse(g.url, body)
        final = chunks[-1]["meta_info"]
        assert final["finish_reason"]["type"] == "length" and final["completion_tokens"] == 6
        ids = [t for c in chunks for t in c["output_ids"]]
        assert len(ids) == 6 and len(chunks) > 1
        rows = [r for c in chunks for r in c["meta_info"]["output_token_logprobs"]]
        tops = [r for c in chunks for r in c["meta_info"]["output_top_logprobs"]]
        pv = [v for c in chunks for v in c["meta_info"]["policy_versions"]]
        assert [r[1] for r in rows] == ids and len(tops) == 6 and pv == [0] * 6
        # each delta carries its own tokens' entropies (the final delta holds only the rest)
        ents = [e for c in chunks for e in c["meta_info"].get("output_token_entropy", [])]
        assert len(ents) == 6
        assert "".join(c["text"] for c in chunks) == chunks[-1]["text"]
