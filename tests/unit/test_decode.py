"""Decoding SGLang /generate responses (recorded 0.5.23 shapes) into columnar arrays."""

from __future__ import annotations

import base64
import json

import numpy as np
import orjson
import pytest

from rollout_gateway.core.trajectory import EntropyKind
from rollout_gateway.engines.decode import (
    DecodeOptions,
    RoutingSpec,
    decode_generate,
    decode_one,
)
from rollout_gateway.engines import decode_experts
from rollout_gateway.engines.decode_experts import decode_routed_experts
from rollout_gateway.errors import EngineError


@pytest.fixture(params=["pybase64", "numpy"])
def b64_path(request, monkeypatch):
    """Run a test through both routed-experts decoders (SIMD pybase64, numpy fallback)."""
    if request.param == "pybase64":
        pytest.importorskip("pybase64")
    monkeypatch.setattr(decode_experts, "USE_PYBASE64", request.param == "pybase64")
    return request.param

# A non-streaming SGLang 0.5.23 /generate response with return_logprob, top_logprobs_num=2,
# logprob_start_len=0, return_routed_experts (2 layers x top-2 over 4 experts; prompt 3
# tokens + 3 output tokens - 1 = 5 rows) and a weight_versions span list, as the
# tokenizer_manager builds it (orjson: no spaces; -inf as null).
RE_ROWS = np.array([[[0, 1], [2, 3]], [[1, 2], [3, 0]], [[3, 3], [0, 1]],
                    [[2, 0], [1, 1]], [[0, 3], [2, 2]]], dtype="<i4")
RECORDED = (
    b'{"text":" Paris.","output_ids":[12095,13,151645],"meta_info":{"id":"6f0c1f2ad4",'
    b'"finish_reason":{"type":"stop","matched":151645},"prompt_tokens":3,'
    b'"weight_version":"7","num_retractions":0,'
    b'"input_token_logprobs":[[null,785,null],[-3.25,6722,null],[-0.5,374,null]],'
    b'"output_token_logprobs":[[-0.0123,12095,null],[-0.75,13,null],[null,151645,null]],'
    b'"input_top_logprobs":[null,[[-1.0,11,null],[-2.0,12,null]],[[-0.5,374,null],'
    b'[-1.5,9,null]]],'
    b'"output_top_logprobs":[[[-0.0123,12095,null],[-5.1,785,null]],[[-0.75,13,null],'
    b'[-0.9,11,null]],[[-1e-05,151645,null],[-12.0,1,null]]],'
    b'"reasoning_tokens":0,"completion_tokens":3,"cached_tokens":0,'
    b'"weight_versions":[{"version":"6","start":0,"end":1},{"version":"7","start":1,"end":3}],'
    b'"routed_experts":"' + base64.b64encode(RE_ROWS.tobytes()) + b'",'
    b'"e2e_latency":0.0421}}'
)


def test_recorded_response_decodes_every_column(b64_path):
    opts = DecodeOptions(routing=RoutingSpec(num_layers=2, top_k=2, num_experts=4),
                         vocab_size=151936)
    d = decode_one(RECORDED, opts)
    assert d.output_ids.dtype == np.int32
    assert d.output_ids.tolist() == [12095, 13, 151645]
    assert d.logprobs.dtype == np.float32
    np.testing.assert_allclose(d.logprobs[:2], [-0.0123, -0.75], rtol=1e-6)
    assert d.logprobs[2] == -np.inf  # null logprob is orjson's -inf
    assert d.entropy_kind == EntropyKind.TOPK_ESTIMATE
    assert d.entropy.shape == (3,) and np.isfinite(d.entropy).all()
    assert 0 < d.entropy_error_bound < 10
    assert d.weight_version == 7 and d.weight_version_raw == "7"
    assert d.spans == [(6, 0, 1), (7, 1, 3)]
    assert d.finish_reason == {"type": "stop", "matched": 151645}
    assert (d.prompt_tokens, d.completion_tokens, d.cached_tokens) == (3, 3, 0)
    assert d.rid == "6f0c1f2ad4" and d.text == " Paris."
    assert d.input_token_ids.tolist() == [785, 6722, 374]
    assert d.routed.data.dtype == np.uint8 and d.routed.data.shape == (5, 2, 2)
    np.testing.assert_array_equal(d.routed.data, RE_ROWS)
    assert d.meta["e2e_latency"] == 0.0421 and "output_token_logprobs" not in d.meta
    assert d.finished


def test_list_response_for_n_samples():
    one = orjson.loads(RECORDED)
    two = dict(one, output_ids=[13, 151645])
    two["meta_info"] = dict(one["meta_info"], id="b", completion_tokens=2,
                            output_token_logprobs=[[-0.5, 13, None], [-0.1, 151645, None]],
                            output_top_logprobs=None, routed_experts=None,
                            weight_versions=[{"version": "7", "start": 0, "end": 2}])
    out = decode_generate(orjson.dumps([one, two]),
                          DecodeOptions(routing=RoutingSpec(2, 2, 4)))
    assert [d.rid for d in out] == ["6f0c1f2ad4", "b"]
    assert out[1].output_ids.tolist() == [13, 151645]
    assert out[1].entropy_kind == EntropyKind.NONE and np.isnan(out[1].entropy).all()
    assert out[1].routed is None and out[0].routed is not None
    assert out[1].spans == [(7, 0, 2)]


def test_python_json_spacing_and_exact_entropy_extension():
    obj = orjson.loads(RECORDED)
    obj["meta_info"]["output_token_entropy"] = [0.25, 1.5, 0.0]
    body = json.dumps(obj).encode()  # ": " separators, "routed_experts": "..."
    d = decode_one(body, DecodeOptions(routing=RoutingSpec(2, 2, 4)))
    assert d.entropy_kind == EntropyKind.EXACT and d.entropy_error_bound == 0.0
    np.testing.assert_allclose(d.entropy, [0.25, 1.5, 0.0])
    np.testing.assert_array_equal(d.routed.data, RE_ROWS)


def test_without_routing_spec_returns_flat_int32(b64_path):
    d = decode_one(RECORDED)
    assert d.routed is None
    assert d.routed_experts.dtype == np.int32
    np.testing.assert_array_equal(d.routed_experts, RE_ROWS.reshape(-1))


def test_non_integer_weight_version_gives_no_spans():
    obj = orjson.loads(RECORDED)
    obj["meta_info"]["weight_version"] = "default"
    obj["meta_info"]["weight_versions"] = [{"version": "default", "start": 0, "end": 3}]
    d = decode_one(orjson.dumps(obj))
    assert d.weight_version is None and d.weight_version_raw == "default" and d.spans == []


def test_aborted_while_queued_has_no_prompt_tokens():
    body = (b'{"text":"","output_ids":[],"meta_info":{"id":"q","finish_reason":{"type":"abort",'
            b'"message":"Abort before prefill","status_code":200,"err_type":null},'
            b'"weight_version":"3","num_retractions":0,"completion_tokens":0,'
            b'"cached_tokens":0,"output_token_logprobs":[]}}')
    d = decode_one(body)
    assert d.num_tokens == 0 and d.prompt_tokens is None
    assert d.finish_reason["type"] == "abort"


def _body_with(**meta_changes) -> bytes:
    obj = orjson.loads(RECORDED)
    obj["meta_info"].update(meta_changes)
    return orjson.dumps(obj)


@pytest.mark.parametrize("body, match", [
    (b"<html>502 Bad Gateway</html>", "invalid JSON"),
    (b'{"error":{"message":"boom"}}', "error"),
    (b'{"text":"x"}', "meta_info"),
    (b'[1,2]', "not an object"),
    (_body_with(output_token_logprobs=[[-0.1, 99, None], [-0.2, 13, None],
                                       [-0.3, 151645, None]]), "does not match"),
    (_body_with(output_token_logprobs=[[-0.1, 12095, None]]), "entries for 3"),
    (_body_with(output_token_logprobs=[[0.5, 12095, None], [-0.2, 13, None],
                                       [-0.3, 151645, None]]), "positive"),
    (_body_with(routed_experts="!!!notbase64!!!"), "base64"),
    (_body_with(completion_tokens="3"), "completion_tokens"),
    (_body_with(weight_versions=[{"version": "6", "start": 0, "end": 1},
                                 {"version": "7", "start": 2, "end": 3}]), "contiguous"),
    (_body_with(output_top_logprobs=[[[-0.1, 1, None], [-0.2, 2, None]]] * 3), "sum to"),
    (_body_with(finish_reason=[1]), "finish_reason"),
])
def test_garbage_becomes_engine_error(b64_path, body, match):
    with pytest.raises(EngineError, match=match):
        decode_generate(body, DecodeOptions(routing=RoutingSpec(2, 2, 4)))


def test_routed_experts_shape_and_range_are_validated(b64_path):
    with pytest.raises(EngineError, match="rows"):
        decode_one(RECORDED, DecodeOptions(routing=RoutingSpec(2, 2, 4),
                                           routed_experts_start_len=1))
    with pytest.raises(EngineError, match="outside"):
        decode_one(RECORDED, DecodeOptions(routing=RoutingSpec(2, 2, 3)))
    with pytest.raises(EngineError, match="multiple"):
        decode_one(RECORDED, DecodeOptions(routing=RoutingSpec(3, 2, 4)))


@pytest.mark.parametrize("num_experts", [1, 7, 128, 256, 257, 384])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 383, 384, 385, 3000])
def test_routed_experts_fast_path_matches_reference(b64_path, num_experts, n):
    rng = np.random.default_rng(n * 1000 + num_experts)
    ids = rng.integers(0, num_experts, n).astype("<i4")
    text = base64.b64encode(ids.tobytes())
    body = b'xx"' + text + b'"'
    got = decode_routed_experts(body, 3, 3 + len(text), num_experts=num_experts)
    assert got.dtype == (np.uint8 if num_experts <= 256 else np.int32)
    np.testing.assert_array_equal(got, ids)


@pytest.mark.parametrize("bad", [256, 1000, 1 << 20, -1, 1 << 31 - 1])
@pytest.mark.parametrize("pos", [0, 1, 2, 200])
def test_routed_experts_fast_path_rejects_out_of_range(b64_path, bad, pos):
    ids = np.zeros(384, "<i4")
    ids[pos] = bad
    text = base64.b64encode(ids.tobytes())
    with pytest.raises(EngineError, match="outside|negative"):
        decode_routed_experts(text, 0, len(text), num_experts=256)


def test_routed_experts_rejects_each_corrupted_character(b64_path):
    ids = np.arange(48, dtype="<i4") % 8
    text = bytearray(base64.b64encode(ids.tobytes()))
    for i in range(16):  # one block's every position, made invalid
        bad = bytearray(text)
        bad[i] = ord("*")
        with pytest.raises(EngineError):
            decode_routed_experts(bytes(bad), 0, len(bad), num_experts=8)


@pytest.mark.parametrize("rows, match", [
    ([None, [[-0.1, 1, None]], [[-0.1, 1, None]]], "output_top_logprobs"),
    ([[[-0.1, 1, None]], [], [[-0.1, 1, None]]], "empty row"),
    ([[[-0.1, 1, None]], "x", [[-0.1, 1, None]]], "output_top_logprobs"),
    ([[[-0.1, 1, None]], [[-0.1, 1, None]]], "3 rows"),
])
def test_bad_top_logprob_rows(rows, match):
    with pytest.raises(EngineError, match=match):
        decode_one(_body_with(output_top_logprobs=rows))


def test_ragged_top_logprob_rows_are_padded():
    rows = [[[-0.1, 1, None], [-3.0, 2, None]], [[-0.2, 1, None]], [[-0.3, 1, None]]]
    obj = orjson.loads(RECORDED)
    obj["meta_info"]["output_top_logprobs"] = rows
    d = decode_one(orjson.dumps(obj), DecodeOptions(vocab_size=10))
    assert d.entropy_kind == EntropyKind.TOPK_ESTIMATE and np.isfinite(d.entropy).all()


def test_fuzzed_bodies_only_ever_raise_engine_error(b64_path):
    """Truncations and byte flips of a real body: a clean EngineError or a valid decode."""
    rng = np.random.default_rng(0)
    opts = DecodeOptions(routing=RoutingSpec(2, 2, 4))
    bodies = [RECORDED[:i] for i in range(0, len(RECORDED), 7)]
    for _ in range(400):
        b = bytearray(RECORDED)
        for pos in rng.integers(0, len(b), rng.integers(1, 4)):
            b[pos] = int(rng.integers(0, 256))
        bodies.append(bytes(b))
    ok = 0
    for b in bodies:
        try:
            decode_generate(b, opts)
            ok += 1
        except EngineError:
            pass
    assert 0 < ok < len(bodies)


@pytest.mark.parametrize("key", ["output_ids", "text", "index", "meta_info"])
def test_wrong_types_at_top_level_only_raise_engine_error(key):
    _wrong_types(lambda obj, v: obj.__setitem__(key, v))


@pytest.mark.parametrize("key", sorted(orjson.loads(RECORDED)["meta_info"]) + [
    "output_token_entropy"])
def test_wrong_types_in_meta_info_only_raise_engine_error(key):
    _wrong_types(lambda obj, v: obj["meta_info"].__setitem__(key, v))


def _wrong_types(put):
    opts = DecodeOptions(routing=RoutingSpec(2, 2, 4))
    for v in [None, 1, -1, 1.5, True, "x", "", [], {}, [None], [[None]], [[[None]]],
              [{"a": 1}], [[1, 2, 3]] * 3, [[-0.1]] * 3, [["a", "b", None]] * 3, 2**70]:
        obj = orjson.loads(RECORDED)
        put(obj, v)
        try:
            decode_generate(orjson.dumps(obj, option=orjson.OPT_PASSTHROUGH_DATACLASS)
                            if not isinstance(v, int) or abs(v) < 2**63
                            else json.dumps(obj).encode(), opts)
        except EngineError:
            pass


def test_list_response_each_item_gets_its_own_routed_experts(b64_path):
    one = orjson.loads(RECORDED)
    two = orjson.loads(RECORDED)
    other = (RE_ROWS + 1) % 4
    two["meta_info"]["routed_experts"] = base64.b64encode(other.tobytes()).decode()
    out = decode_generate(orjson.dumps([one, two]), DecodeOptions(routing=RoutingSpec(2, 2, 4)))
    np.testing.assert_array_equal(out[0].routed.data, RE_ROWS)
    np.testing.assert_array_equal(out[1].routed.data, other)
