"""The native data plane (``rollout_gateway._native``) gives exactly the Python reference's
results: canonical top-k rows bit for bit, routed experts id for id, whole decoded answers
field for field (errors: same message). Hostile input is in
tests/security/test_decode_properties.py; the AddressSanitizer run in
tests/security/test_native_asan.py."""

from __future__ import annotations

import base64
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_gateway import native
from rollout_gateway.engines import decode_experts
from rollout_gateway.engines.decode_toplogprobs import parse_top_segment

ROOT = Path(__file__).resolve().parents[2]
FAST = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(autouse=True, scope="module")
def _cut_every_body():
    """The native plane cuts columns out of bodies from CUT_MIN_BYTES on: from 0 here, so
    these small answers take that path."""
    from rollout_gateway.engines import decode
    saved, decode.CUT_MIN_BYTES = decode.CUT_MIN_BYTES, 0
    yield
    decode.CUT_MIN_BYTES = saved


def test_the_native_module_is_built_and_selected_by_default():
    # scripts/setup-env.sh builds it (pip install -e .); a missing build is a finding here
    assert native.built(), native.describe()
    with native.using("auto") as plane:
        assert plane == "native" and "native" in native.describe()
    with native.using("python") as plane:
        assert plane == "python" and native.impl is None and "forced" in native.describe()


def test_select_rejects_unknown_planes():
    with pytest.raises(ValueError):
        native.select("fast")


def both(fn, *args, **kw):
    """fn's outcome on the Python and on the native data plane: (result or error text)."""
    out = []
    for plane in ("python", "native"):
        with native.using(plane):
            try:
                out.append(("ok", fn(*args, **kw)))
            except Exception as exc:  # noqa: BLE001 - compared, then re-checked by the caller
                out.append((type(exc).__name__, str(exc)))
    return out


def same_rows(a, b) -> None:
    assert (a is None) == (b is None)
    if a is not None:
        assert a.logprobs.dtype == b.logprobs.dtype and a.ids.dtype == b.ids.dtype
        assert a.logprobs.shape == b.logprobs.shape
        assert a.logprobs.tobytes() == b.logprobs.tobytes()  # bit for bit (NaN and -0.0 too)
        assert a.ids.tobytes() == b.ids.tobytes()
        assert bytes(a.raw) == bytes(b.raw)
        assert a.logprobs.flags.writeable and b.logprobs.flags.writeable


def check_top(seg: bytes):
    (ka, a), (kb, b) = both(parse_top_segment, seg)
    assert ka == kb == "ok", (ka, a, kb, b)
    same_rows(a, b)
    return b


# numbers as an engine (or a hostile one) may write them
def _float_texts(x: float) -> list[bytes]:
    return [orjson.dumps(x), repr(x).encode(), f"{x:.17g}".encode(), f"{x:.3e}".encode(),
            f"{x:.25f}".encode()]


number_text = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False).flatmap(
        lambda x: st.sampled_from(_float_texts(x))),
    st.integers(-(1 << 80), 1 << 80).map(lambda i: str(i).encode()),
    st.sampled_from([b"0", b"-0", b"-0.0", b"0.0", b"1e400", b"-1e400", b"1e-400", b"1E5",
                     b"2.5e-324", b"4.9406564584124654e-324", b"1.7976931348623157e308",
                     b"9007199254740993", b"18446744073709551615", b"18446744073709551616",
                     b"-9223372036854775808", b"-9223372036854775809", b"0.1", b"-0.3",
                     b"123456789012345678901234567890e-30", b"1." , b".5", b"01", b"-",
                     b"1e", b"1e+", b"NaN", b"Infinity", b"null", b"true", b"false", b"3.0",
                     b"2147483647", b"2147483648", b"-1", b"1.5"]),
)
valid_number = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False).flatmap(
        lambda x: st.sampled_from(_float_texts(x))),
    st.floats(-30, 0).map(lambda x: repr(float(np.float32(x))).encode()),
    st.integers(-(1 << 80), 1 << 80).map(lambda i: str(i).encode()))
ws = st.sampled_from([b"", b"", b"", b" ", b"\n", b"\t", b"\r", b"  "])
bad_ws = st.sampled_from([b"", b" ", b"\x0b", b"\x0c", b"\xa0", b"\x00"])


@st.composite
def segments(draw):
    """Top-logprob values: canonical ones (orjson's), with odd numbers and whitespace, and
    one structural edit sometimes."""
    t, k = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    w = draw(st.integers(0, 2))
    hostile = draw(st.integers(0, 2)) == 0  # else valid JSON numbers and whitespace
    rows = []
    for _ in range(t):
        entries = []
        for _ in range(k):
            lp = draw(number_text if hostile else valid_number | st.just(b"null"))
            tid = draw(st.integers(0, 200).map(lambda i: str(i).encode())
                       | (number_text if hostile else st.just(b"7.0")))
            text = b"null" if not hostile or draw(st.integers(0, 9)) else draw(number_text)
            pad = (lambda: draw(bad_ws if hostile else ws)) if w == 2 else (lambda: b"")
            entries.append(b"[" + pad() + lp + pad() + b"," + pad() + tid + pad() + b","
                           + pad() + text + pad() + b"]")
        rows.append(b"[" + b",".join(entries) + b"]")
    seg = b"[" + b",".join(rows) + b"]"
    edit = draw(st.integers(0, 5)) if hostile else 0
    if edit == 1:  # delete a byte
        i = draw(st.integers(0, len(seg) - 1))
        seg = seg[:i] + seg[i + 1:]
    elif edit == 2:  # insert a byte
        i = draw(st.integers(0, len(seg)))
        seg = seg[:i] + bytes([draw(st.integers(0, 255))]) + seg[i:]
    return seg


@FAST
@given(seg=segments())
def test_top_rows_match_the_python_parser(seg):
    check_top(seg)


def test_top_rows_on_orjson_output_bit_for_bit():
    rng = np.random.default_rng(0)
    lps = -np.abs(rng.standard_normal((64, 5))) * 10.0 ** rng.integers(-12, 3, (64, 5))
    lps[0, 0], lps[1, 1], lps[2, 2] = -np.inf, -0.0, -5e-324
    rows = [[[float(x) if math.isfinite(x) else None, int(i), None] for x, i in zip(r, ir)]
            for r, ir in zip(lps, rng.integers(0, 151936, (64, 5)))]
    got = check_top(orjson.dumps(rows))
    assert got is not None and got.logprobs.shape == (64, 5)
    assert np.isnan(got.logprobs[0, 0]) and struct.pack("<d", got.logprobs[1, 1]) == \
        struct.pack("<d", -0.0)


def test_top_rows_hard_roundings():
    # shortest reprs of float32 values as doubles (what SGLang writes), and halfway cases
    f32 = np.random.default_rng(1).standard_normal(4000).astype(np.float32).astype(float)
    texts = [repr(float(x)).encode() for x in f32] + [
        b"9007199254740993", b"9007199254740993.0", b"0.30000000000000004",
        b"1.00000000000000011102230246251565404236316680908203125",
        b"1.00000000000000011102230246251565404236316680908203124",
        b"2.2250738585072011e-308", b"-1.4e-45", b"123456789012345678e-5"]
    seg = b"[" + b",".join(b"[[" + x + b",1,null]]" for x in texts) + b"]"
    check_top(seg)


def test_every_truncation_of_a_segment():
    seg = orjson.dumps([[[-0.5, 3, None], [-1.25, 7, None]], [[-0.1, 2, None], [None, 9, None]]])
    for cut in range(len(seg) + 1):
        check_top(seg[:cut])
        check_top(seg[cut:])


def test_wrong_argument_types_raise_not_crash():
    with pytest.raises(TypeError):
        native.compiled().top_rows("[[[1,2,null]]]")
    with pytest.raises(TypeError):
        native.compiled().top_rows(None)
    with pytest.raises(TypeError):
        native.compiled().experts("AAAA", 0, 4, 8)
    for start, end, n in [(-1, 4, 8), (0, 5, 8), (3, 2, 8), (0, 4, 0), (0, 4, 1 << 40),
                          (5, -1, 8)]:
        with pytest.raises((ValueError, OverflowError)):
            native.compiled().experts(b"AAAA", start, end, n)


# ------------------------------------------------------------------ routed experts

def python_ids(text: bytes, n: int):
    try:
        return decode_experts._decode_python(text, 0, len(text), n)
    except Exception as exc:  # noqa: BLE001
        return exc


@FAST
@given(ids=st.lists(st.integers(-(1 << 31), (1 << 31) - 1) | st.integers(0, 300), max_size=40),
       n=st.sampled_from([1, 8, 128, 256, 257, 300, 1 << 20, (1 << 31) - 1]),
       edit=st.integers(0, 4), pos=st.integers(0, 10_000),
       byte=st.sampled_from(b"A=/+_- \n\x00\xffa"))
def test_experts_match_the_python_decoder(ids, n, edit, pos, byte):
    text = base64.b64encode(np.array(ids, "<i4").tobytes())
    if edit == 1 and text:
        i = pos % len(text)
        text = text[:i] + bytes([byte]) + text[i + 1:]
    elif edit == 2 and text:
        text = text[:pos % len(text)]
    elif edit == 3:
        text = text.rstrip(b"=")
    ref = python_ids(text, n)
    got, end = native.compiled().experts(text + b'"tail', 0, -1, n)
    assert end == len(text)
    if got is None:  # declined: the Python decoder then decides (an error or a result)
        assert isinstance(ref, Exception) or len(ids) == 0 or edit, (text, n)
        return
    arr = decode_experts._native_ids(got, n)
    assert not isinstance(ref, Exception), (text, n, ref)
    assert arr.dtype == ref.dtype and arr.tobytes() == ref.tobytes()
    got2, end2 = native.compiled().experts(b"xx" + text + b"yy", 2, 2 + len(text), n)
    assert end2 == 2 + len(text) and bytes(got2) == bytes(got)


def test_experts_fast_blocks_and_tails():
    rng = np.random.default_rng(2)
    for rows in [0, 1, 2, 3, 4, 5, 6, 7, 100, 1001, 20_000]:
        for n in (2, 128, 256, 300):
            ids = rng.integers(0, n, rows).astype("<i4")
            text = base64.b64encode(ids.tobytes())
            got, end = native.compiled().experts(text + b'"', 0, -1, n)
            assert end == len(text) and got is not None
            assert decode_experts._native_ids(got, n).tolist() == ids.tolist()
            if rows:  # one id out of range anywhere: declined
                bad = ids.copy()
                bad[rng.integers(0, rows)] = n
                t2 = base64.b64encode(bad.tobytes())
                assert native.compiled().experts(t2, 0, len(t2), n)[0] is None
    assert native.compiled().experts(b"AAAA", 0, -1, 8) == (None, -1)  # no quote


def test_the_quoted_decoder_without_pybase64_is_the_same_on_both_planes(monkeypatch):
    monkeypatch.setattr(decode_experts, "USE_PYBASE64", False)
    rng = np.random.default_rng(3)
    for text in [base64.b64encode(rng.integers(0, 128, 999).astype("<i4").tobytes()),
                 b"AAAA", b"AAA=", b"####", base64.b64encode(np.array([128], "<i4").tobytes())]:
        body = b'{"routed_experts":"' + text + b'"}'
        (ka, a), (kb, b) = both(decode_experts.decode_routed_experts_quoted, body, 19,
                                num_experts=128)
        assert ka == kb == "ok"
        assert a[1] == b[1]
        if isinstance(a[0], Exception):
            assert str(a[0]) == str(b[0])
        else:
            assert a[0].dtype == b[0].dtype and a[0].tobytes() == b[0].tobytes()


# ------------------------------------------------------------------ wiring

def test_version_reports_the_data_plane():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(native.ENV, None)
    out = subprocess.run([sys.executable, "-m", "rollout_gateway", "--version"], env=env,
                         capture_output=True, text=True, check=True, timeout=60).stdout
    out = " ".join(out.split())  # argparse wraps the line
    assert "data plane: native (compiled parsers)" in out
    env[native.ENV] = "python"
    out = subprocess.run([sys.executable, "-m", "rollout_gateway", "--version"], env=env,
                         capture_output=True, text=True, check=True, timeout=60).stdout
    out = " ".join(out.split())
    assert f"data plane: python (forced by {native.ENV}=python" in out


def test_the_setting_selects_the_plane_when_a_gateway_is_built():
    from rollout_gateway.gateway import Gateway
    from rollout_gateway.settings import GatewaySettings

    with native.using("auto"):
        Gateway(GatewaySettings(data_plane="python"))
        assert native.data_plane() == "python"
        Gateway(GatewaySettings(data_plane="auto"))
        assert native.data_plane() == "native"
    with pytest.raises(ValueError):
        GatewaySettings(data_plane="fast")


# ------------------------------------------------------------------ cut_columns

def _answer(**meta) -> dict:
    base = {"id": "r", "finish_reason": None, "prompt_tokens": 2, "completion_tokens": 2,
            "output_token_logprobs": [[-0.5, 7, None], [None, 9, None]]}
    return {"text": 'a\\"]}', "output_ids": [7, 9], "meta_info": {**base, **meta}}


def test_cut_columns_takes_canonical_columns_by_structure():
    cut = native.compiled().cut_columns
    body = orjson.dumps(_answer())
    (a, b, ids), (c, d, lps, tids), top = cut(body)
    assert top is None
    assert body[a:b] == b"[7,9]" and body[c:d] == b"[[-0.5,7,null],[null,9,null]]"
    assert np.frombuffer(ids, np.int32).tolist() == [7, 9]
    assert np.frombuffer(tids, np.int64).tolist() == [7, 9]
    assert np.isnan(np.frombuffer(lps)[1]) and np.frombuffer(lps)[0] == -0.5
    # only the answer's own keys: the same keys elsewhere are never cut
    nested = orjson.dumps({"text": "x", "meta_info": {"extra": {"output_ids": [1],
                           "output_token_logprobs": [[-0.5, 1, None]]}}, "x": {"output_ids": [2]}})
    assert cut(nested) is None
    assert cut(orjson.dumps([_answer()])) is None  # batches: the Python path
    # not canonical: whitespace, an int logprob, a text, a negative or huge id
    for rows in ([[0, 7, None]], [[-0.5, 7, "t"]], [[-0.5, -7, None]],
                 [[-0.5, 1 << 31, None]]):
        got = cut(orjson.dumps(_answer(output_token_logprobs=rows)))
        assert got is not None and got[1] is None
    assert cut(b'{"output_ids": [1, 2]}') is None
    assert cut(b'{"output_ids":[01]}') is None and cut(b'{"output_ids":[1,]}') is None
    assert cut(b'{"output_ids":[2147483648]}') is None
    assert cut(b'{"output_ids":[2147483647],"meta_info":{}}')[0][2] == \
        np.array([2147483647], np.int32).tobytes()


def test_cut_columns_on_every_truncation_and_duplicate_keys():
    body = orjson.dumps(_answer())
    for cut in range(len(body) + 1):
        native.compiled().cut_columns(body[:cut])
        native.compiled().cut_columns(body[cut:])
    from rollout_gateway.engines.decode import DecodeOptions, decode_generate
    dup = body[:-1] + b',"output_ids":[1,2]}'  # orjson keeps the last value
    (ka, a), (kb, b) = both(decode_generate, dup, DecodeOptions(check_logprob_ids=False))
    assert ka == kb == "ok" and a[0].output_ids.tolist() == b[0].output_ids.tolist() == [1, 2]
    mark = body[:-1] + b',"output_ids":"#col:0000000000000000i"}'  # a guessed mark: no effect
    (ka, a), (kb, b) = both(decode_generate, mark)
    assert ka == kb == "EngineError" and a == b


# ------------------------------------------------------------------ rows_json (the writer)

@FAST
@given(t=st.integers(0, 6), k=st.integers(0, 4), two_d=st.booleans(),
       values=st.lists(st.floats(allow_nan=True, allow_infinity=True) | st.just(-0.0),
                       min_size=24, max_size=24),
       ids=st.lists(st.integers(0, (1 << 31) - 1), min_size=24, max_size=24))
def test_rows_written_from_columns_are_the_same_bytes(t, k, two_d, values, ids):
    from rollout_gateway.engines.decode_toplogprobs import LogprobRows
    shape = (t, k) if two_d else (t,)
    size = t * k if two_d else t
    rows = LogprobRows(np.array(values[:size], np.float64).reshape(shape),
                       np.array(ids[:size], np.int64).reshape(shape))
    (ka, a), (kb, b) = both(rows.to_json)
    assert ka == kb == "ok" and a == b
    assert orjson.loads(b) == orjson.loads(orjson.dumps(rows.to_rows()))


def test_rows_json_declines_mismatched_texts():
    rj = native.compiled().rows_json
    assert rj(b"[1.5,2.5]", b"[1,2]", 0) == b"[[1.5,1,null],[2.5,2,null]]"
    assert rj(b"[1.5,2.5]", b"[1,2]", 2) == b"[[[1.5,1,null],[2.5,2,null]]]"
    assert rj(b"[1.5,2.5]", b"[1,2]", 1) == b"[[[1.5,1,null]],[[2.5,2,null]]]"
    for args in [(b"[1.5]", b"[1,2]", 0), (b"[1,2,3]", b"[1,2,3]", 2), (b"[]", b"[]", 0),
                 (b"1,2", b"[1,2]", 0), (b"[1,2]", b"[1,2]", -1)]:
        assert rj(*args) is None
    with pytest.raises(TypeError):
        rj("[1]", b"[1]", 0)
