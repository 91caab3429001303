"""Property tests (hypothesis) of the SGLang response parser: malformed, truncated and
hostile engine responses give a clean ``GatewayError`` (EngineError / InvalidArgument) or a
valid result, never another exception (which would surface as a 500 mid-rollout)."""

from __future__ import annotations

import base64
import json

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_gateway import native
from rollout_gateway.engines import decode_experts
from rollout_gateway.engines.decode import DecodeOptions, RoutingSpec, decode_generate
from rollout_gateway.engines.decode_experts import decode_routed_experts_str
from rollout_gateway.engines.decode_stream import StreamDecoder
from rollout_gateway.engines.decode_toplogprobs import (
    LogprobRows,
    parse_top_segment,
    splice_top,
)
from rollout_gateway.errors import GatewayError

FAST = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

OPTS = [DecodeOptions(), DecodeOptions(routing=RoutingSpec(2, 2, 4), vocab_size=1000),
        DecodeOptions(routing=RoutingSpec(2, 2, 300), routed_experts_start_len=1)]

ROUTED = np.array([0, 1, 2, 3, 1, 2, 3, 0, 3, 3, 0, 1, 2, 0, 1, 1, 0, 3, 2, 2], "<i4")


B64_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="


def valid_response() -> dict:
    return {"text": " Paris.", "output_ids": [12, 13, 14], "meta_info": {
        "id": "r1", "finish_reason": {"type": "stop", "matched": 14}, "prompt_tokens": 3,
        "weight_version": "7", "num_retractions": 0,
        "output_token_logprobs": [[-0.01, 12, None], [-0.75, 13, None], [None, 14, None]],
        "output_top_logprobs": [[[-0.01, 12, None], [-5.1, 7, None]],
                                [[-0.75, 13, None], [-0.9, 11, None]],
                                [[-1e-05, 14, None], [-12.0, 1, None]]],
        "output_token_entropy": [0.1, 0.2, 0.3],
        "completion_tokens": 3, "cached_tokens": 0,
        "weight_versions": [{"version": "6", "start": 0, "end": 1},
                            {"version": "7", "start": 1, "end": 3}],
        "routed_experts": base64.b64encode(ROUTED.tobytes()).decode()}}


def dumps(v) -> bytes:
    """JSON of any Python value, with integers wider than orjson writes."""
    return json.dumps(v).encode()


def clean(fn, *args, **kw):
    """Run ``fn``; only a GatewayError may escape."""
    try:
        return fn(*args, **kw)
    except GatewayError as exc:
        assert exc.message and isinstance(exc.to_dict(), dict)
        return None


json_leaf = (st.none() | st.booleans() | st.integers(min_value=-(1 << 70), max_value=1 << 70)
             | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_value = st.recursive(json_leaf, lambda kids: st.lists(kids, max_size=4)
                          | st.dictionaries(st.text(max_size=6), kids, max_size=4),
                          max_leaves=12)
META_KEYS = list(valid_response()["meta_info"])


def test_the_valid_response_decodes():
    for opts in OPTS[:2]:
        [d] = decode_generate(orjson.dumps(valid_response()), opts)
        assert d.output_ids.tolist() == [12, 13, 14] and d.finished


@FAST
@given(data=st.binary(max_size=400), opt=st.sampled_from(OPTS))
def test_arbitrary_bytes(data, opt):
    clean(decode_generate, data, opt)


@FAST
@given(cut=st.integers(min_value=0), opt=st.sampled_from(OPTS))
def test_every_truncation(cut, opt):
    body = orjson.dumps(valid_response())
    clean(decode_generate, body[:cut % len(body)], opt)


@FAST
@given(flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255)), min_size=1,
                      max_size=4), opt=st.sampled_from(OPTS))
def test_corrupted_bytes(flips, opt):
    body = bytearray(orjson.dumps(valid_response()))
    for pos, b in flips:
        body[pos % len(body)] = b
    clean(decode_generate, bytes(body), opt)


@FAST
@given(key=st.sampled_from(META_KEYS + ["output_ids", "text", "index"]), value=json_value,
       opt=st.sampled_from(OPTS), as_list=st.booleans())
def test_hostile_field_values(key, value, opt, as_list):
    resp = valid_response()
    if key in resp and key != "meta_info":
        resp[key] = value
    elif key == "index":
        resp["index"] = value
    else:
        resp["meta_info"][key] = value
    body = dumps([resp, resp] if as_list else resp)
    clean(decode_generate, body, opt)


@FAST
@given(value=json_value, opt=st.sampled_from(OPTS))
def test_hostile_top_level(value, opt):
    clean(decode_generate, dumps(value), opt)


@FAST
@given(text=st.text(alphabet=B64_ALPHABET + "-_ \\\"", max_size=80),
       experts=st.sampled_from([None, 4, 300]), fast=st.booleans())
def test_routed_experts_text(text, experts, fast):
    old = decode_experts.USE_PYBASE64
    decode_experts.USE_PYBASE64 = fast
    try:
        clean(decode_routed_experts_str, text, num_experts=experts)
        resp = valid_response()
        resp["meta_info"]["routed_experts"] = text
        clean(decode_generate, orjson.dumps(resp), OPTS[1])
    finally:
        decode_experts.USE_PYBASE64 = old


@FAST
@given(seg=st.binary(max_size=200))
def test_top_logprob_segments(seg):
    clean(parse_top_segment, seg)
    clean(splice_top, b'{"meta_info":{"output_top_logprobs":' + seg + b'}}')


def _sse(chunks) -> bytes:
    return b"".join(b"data: " + dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


@FAST
@given(cut=st.integers(min_value=0), split=st.integers(1, 64), flip=st.integers(min_value=0),
       byte=st.integers(0, 255), opt=st.sampled_from(OPTS))
def test_streams_truncated_split_and_corrupted(cut, split, flip, byte, opt):
    raw = bytearray(_sse([valid_response()]))
    raw[flip % len(raw)] = byte
    raw = bytes(raw[:cut % (len(raw) + 1)])
    dec = StreamDecoder(opt, keep=True, max_event_bytes=1 << 16)
    try:
        for i in range(0, len(raw), split):
            dec.feed(raw[i:i + split])
    except GatewayError:
        return


@FAST
@given(events=st.lists(json_value, max_size=4), opt=st.sampled_from(OPTS))
def test_streams_of_hostile_events(events, opt):
    dec = StreamDecoder(opt, keep=True)
    clean(dec.feed, _sse(events))


def test_oversized_stream_event_is_refused():
    dec = StreamDecoder(DecodeOptions(), max_event_bytes=1024)
    assert clean(dec.feed, b"data: " + b"x" * 4096) is None


# ------------------------------------------------ native data plane == Python data plane

@pytest.fixture(autouse=True, scope="module")
def _cut_every_body():
    """The native plane cuts columns out of bodies from CUT_MIN_BYTES on: from 0 here, so
    these small answers take that path."""
    from rollout_gateway.engines import decode
    saved, decode.CUT_MIN_BYTES = decode.CUT_MIN_BYTES, 0
    yield
    decode.CUT_MIN_BYTES = saved


#: a /generate caller that forwards top-k rows: every top-k value takes the spliced
#: (native-parsed) path whatever its size
PASS = DecodeOptions(routing=RoutingSpec(2, 2, 4), vocab_size=1000,
                     passthrough=frozenset({"output_top_logprobs", "output_token_logprobs"}))


def _plain(v):
    """A decoded value in comparable form (arrays by dtype and bytes, NaN bits included)."""
    if isinstance(v, np.ndarray):
        return ("nd", v.dtype.str, v.shape, v.tobytes())
    if isinstance(v, LogprobRows):
        return ("rows", _plain(v.logprobs), _plain(v.ids), None if v.raw is None else bytes(v.raw))
    if isinstance(v, memoryview):
        return ("mv", bytes(v))
    if isinstance(v, float) and v != v:
        return ("nan",)
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if hasattr(v, "__slots__") and not isinstance(v, (str, bytes, int, float)):
        return {s: _plain(getattr(v, s)) for s in type(v).__slots__ if hasattr(v, s)}
    return v


def _outcome(fn, *args):
    try:
        return ("ok", _plain(fn(*args)))
    except GatewayError as exc:
        return (type(exc).__name__, exc.message)


def same_on_both_planes(fn, *args):
    """fn gives the same result, or the same error, on the Python and the native plane."""
    with native.using("python"):
        ref = _outcome(fn, *args)
    with native.using("native"):
        got = _outcome(fn, *args)
    assert got == ref, _first_difference(got, ref)


def _first_difference(a, b, path="") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{path}.{k}")
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(x, y, f"{path}[{i}]")
    return f"native {a!r} != python {b!r} at {path}"


def _stream(body: bytes, opts: DecodeOptions):
    dec = StreamDecoder(opts, keep=True)
    out = dec.feed(body) + dec.close()
    return out, dec.result() if dec._states and len(dec._states) == 1 else None


@FAST
@given(flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255)), min_size=0,
                      max_size=3),
       cut=st.integers(min_value=0), opt=st.sampled_from(OPTS + [PASS]))
def test_native_plane_equals_python_plane_on_corrupted_bodies(flips, cut, opt):
    body = bytearray(orjson.dumps(valid_response()))
    for pos, byte in flips:
        body[pos % len(body)] = byte
    body = bytes(body[:len(body) - cut % 40])
    same_on_both_planes(decode_generate, body, opt)


@FAST
@given(key=st.sampled_from(META_KEYS + ["output_ids"]), value=json_value,
       opt=st.sampled_from([PASS, OPTS[2]]))
def test_native_plane_equals_python_plane_on_hostile_values(key, value, opt):
    resp = valid_response()
    (resp if key == "output_ids" else resp["meta_info"])[key] = value
    same_on_both_planes(decode_generate, dumps(resp), opt)


@FAST
# (shallow, and past orjson's nesting limit of 1024: in between, a decoded deep list would
# only test this file's comparison's recursion)
@given(depth=st.integers(1, 200) | st.integers(1030, 5000), tail=st.sampled_from([b"", b"1,2,null", b"]]]", b"\x00"]))
def test_native_plane_on_deep_nesting(depth, tail):
    resp = valid_response()
    resp["meta_info"]["output_top_logprobs"] = "@"
    body = orjson.dumps(resp).replace(b'"@"', b"[" * depth + tail + b"]" * depth)
    same_on_both_planes(decode_generate, body, PASS)
    same_on_both_planes(parse_top_segment, b"[" * depth + tail + b"]" * depth)


def test_native_plane_equals_python_plane_on_a_stream():
    resp = valid_response()
    chunks = []
    for n in (1, 2, 3):
        r = orjson.loads(orjson.dumps(resp))
        m = r["meta_info"]
        r["output_ids"] = r["output_ids"][:n]
        for k in ("output_token_logprobs", "output_top_logprobs", "output_token_entropy"):
            m[k] = m[k][:n]
        m["completion_tokens"] = n
        if n < 3:
            m["finish_reason"] = None
            del m["routed_experts"]
        chunks.append(r)
    body = _sse(chunks)
    for opt in (PASS, OPTS[1]):
        same_on_both_planes(_stream, body, opt)
