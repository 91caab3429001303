"""The byte-level output_top_logprobs fast path gives exactly what the general path gives."""

from __future__ import annotations

import json

import numpy as np
import orjson
import pytest

from rollout_gateway.engines import decode as decode_mod
from rollout_gateway.engines import decode_toplogprobs
from rollout_gateway.engines.decode import DecodeOptions, decode_generate
from rollout_gateway.engines.decode_toplogprobs import (
    LogprobRows,
    cut_top,
    parse_top_segment,
    splice_top,
)
from rollout_gateway.errors import EngineError

@pytest.fixture(autouse=True)
def fast_for_any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_toplogprobs, "MIN_BYTES", 0)


def test_small_values_keep_the_nested_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_toplogprobs, "MIN_BYTES", 8192)
    small = b'{"meta_info":{"output_top_logprobs":[[[-0.1,1,null]],[[-0.2,2,null]]]}}'
    assert splice_top(small) == (small, [])
    rows = [[[-0.5, 1, None]]] * 600
    big = b'{"meta_info":{"output_top_logprobs":' + orjson.dumps(rows) + b"}}"
    assert len(splice_top(big)[1]) == 1


SPECIALS = [float("-inf"), 1e-05, -1e-05, -0.0, 0.0, -5e-324, -2.2250738585072014e-308,
            -1.0000000000000002, -0.1, -87.33654475055310898657, -3.4028234663852886e38]


def _rows(rng: np.random.Generator, t: int, k: int) -> list:
    vals = np.log(rng.dirichlet(np.ones(k + 3), size=t)[:, :k])
    vals = vals.astype(np.float32).astype(float) if rng.random() < 0.5 else vals
    rows = []
    for r in vals.tolist():
        row = []
        for lp in r:
            if rng.random() < 0.1:
                lp = SPECIALS[int(rng.integers(len(SPECIALS)))]
            row.append([lp, int(rng.integers(0, 200_000)), None])
        rows.append(row)
    return rows


def _general(rows: list) -> np.ndarray:
    """What the orjson path computes: float() of each parsed logprob, None -> NaN."""
    flat = [np.nan if e[0] is None else float(e[0]) for row in rows for e in row]
    return np.array(flat, dtype=np.float64).reshape(len(rows), -1)


def _same_bits(a: np.ndarray | LogprobRows, b: np.ndarray) -> bool:
    if isinstance(a, LogprobRows):
        a = a.logprobs
    return a.shape == b.shape and a.dtype == b.dtype and bytes(a.tobytes()) == bytes(b.tobytes())


@pytest.mark.parametrize("seed", range(12))
def test_random_segments_bit_identical(seed: int) -> None:
    rng = np.random.default_rng(seed)
    t, k = int(rng.integers(1, 40)), int(rng.integers(1, 8))
    seg = orjson.dumps(_rows(rng, t, k))
    got = parse_top_segment(seg)
    assert got is not None
    want = _general(orjson.loads(seg))
    assert _same_bits(got, want)
    ids = [[e[1] for e in row] for row in orjson.loads(seg)]
    assert got.ids.tolist() == ids
    # forwarded whole: the engine's bytes; written from the columns: the same bytes
    assert got.raw == seg and got[:].to_json() == seg
    assert LogprobRows(got.logprobs, got.ids).to_json() == seg == orjson.dumps(got.to_rows())
    assert got[3:].to_json() == orjson.dumps(orjson.loads(seg)[3:])
    assert cut_top(got, 2).to_json() == orjson.dumps([r[:2] for r in orjson.loads(seg)])


def test_columns_concat_and_mixed_pieces() -> None:
    a = parse_top_segment(b"[[[-0.5,1,null],[null,2,null]]]")
    b = parse_top_segment(b"[[[-0.25,3,null],[-1.5,4,null]],[[-2.0,5,null],[-3.0,6,null]]]")
    assert a is not None and b is not None
    both = LogprobRows.concat([a, b])
    assert isinstance(both, LogprobRows) and len(both) == 3
    assert both.raw is not None  # spliced from the engine's bytes
    assert both.to_json() == LogprobRows(both.logprobs, both.ids).to_json() == (b"[[[-0.5,1,null],[null,2,null]],[[-0.25,3,null],[-1.5,4,null]],"
                              b"[[-2.0,5,null],[-3.0,6,null]]]")
    # a piece with plain rows (texts, ragged rows): everything becomes plain rows
    mixed = LogprobRows.concat([a, [[[-0.1, 7, "x"]]]])
    assert mixed == [[[-0.5, 1, None], [None, 2, None]], [[-0.1, 7, "x"]]]
    assert LogprobRows.concat([a[:0], a]).to_json() == a.to_json()


def test_token_rows_write_like_orjson() -> None:
    lps = np.array([-0.10000000149011612, -np.inf, np.nan, -0.0, -3e-300])
    rows = LogprobRows(lps, np.array([5, 6, 7, 8, 2**31 - 1]))
    assert rows.to_json() == orjson.dumps(rows.to_rows()) == (
        b"[[-0.10000000149011612,5,null],[null,6,null],[null,7,null],[-0.0,8,null],"
        b"[-3e-300,2147483647,null]]")
    assert rows[1:2].to_json() == b"[[null,6,null]]"
    assert LogprobRows(lps[:0], lps[:0].astype(np.int64)).to_json() == b"[]"


@pytest.mark.parametrize("seg", [
    b"[[[-0.1,true,null]]]",  # a bool id would come back as 1
    b"[[[-0.1,1.5,null]]]",  # not a token id
    b"[[[-0.1,-1,null]]]",
    b"[[[-0.1,4294967296,null]]]",
    b"[[[-0.1,1,2]]]",  # a text that is not null
])
def test_ids_and_texts_outside_the_canonical_form(seg: bytes) -> None:
    assert parse_top_segment(seg) is None


def test_hand_written_number_forms() -> None:
    seg = (b"[[[-1E-5,1,null],[-0,2,null],[-0.0,3,null]],"
           b"[[-1.5e+2,4,null],[null,5,null],[-2e0,6,null]]]")
    got = parse_top_segment(seg)
    assert got is not None
    assert _same_bits(got, _general(orjson.loads(seg)))
    # JSON -0 is the integer 0 (orjson), -0.0 a negative zero: both paths agree
    lp = got.logprobs
    assert not np.signbit(lp[0, 1]) and np.signbit(lp[0, 2]) and np.isnan(lp[1, 1])


def test_whitespace_between_values_is_fine() -> None:
    seg = b"[[[ -0.1 , 1 ,null]],[[-0.2,2, null ]]]"
    got = parse_top_segment(seg)
    assert got is not None and _same_bits(got, _general(orjson.loads(seg)))


@pytest.mark.parametrize("seg", [
    b'[[[-0.1,1,"a]],[b"]]]',  # text strings (may hold brackets): general path
    b"[[[-0.1,1,null] ],[[-0.2,2,null]]]",  # whitespace between brackets
    b"[[[-0.1,1,null]],[[-0.2,2,null],[-0.3,3,null]]]",  # ragged rows
    b"[[[-0.1,1]]]",  # pairs, not triples
    b"[[[-0.1,1,null,4]]]",
    b"[[[,1,null]]]",  # empty value
    b"[[[NaN,1,null]]]",  # not JSON
    b"[[[-0.1,1,null]],[[-0.2,2,null]]",  # truncated
    b"[[[{},1,null]]]",  # not a number
    b"[[[[-0.1],1,null]]]",  # nested deeper
])
def test_non_canonical_segments_are_left_to_the_general_path(seg: bytes) -> None:
    assert parse_top_segment(seg) is None
    body = b'{"meta_info":{"output_top_logprobs":' + seg + b"}}"
    assert splice_top(body) == (body, [])


def _body(rng: np.random.Generator, t: int, k: int, *, n: int = 1, pretty: bool = False) -> bytes:
    outs = []
    for _ in range(n):
        rows = _rows(rng, t, k)
        ids = [int(rng.integers(0, 1000)) for _ in range(t)]
        meta = {"id": "r", "finish_reason": {"type": "length", "length": t},
                "prompt_tokens": 3, "completion_tokens": t, "weight_version": "2",
                "output_token_logprobs": [[-0.5, i, None] for i in ids],
                "output_top_logprobs": rows}
        outs.append({"text": "x", "output_ids": ids, "meta_info": meta})
    obj = outs if n > 1 else outs[0]
    if pretty:  # json.dumps writes -inf as -Infinity, which is not JSON: use null like orjson
        return json.dumps(orjson.loads(orjson.dumps(obj)), indent=1).encode()
    return orjson.dumps(obj)


def _both(body: bytes, monkeypatch: pytest.MonkeyPatch) -> tuple[object, object]:
    """decode_generate with the fast path, and with it switched off: (result or error)."""
    def run() -> object:
        try:
            return decode_generate(body, DecodeOptions(vocab_size=151936))
        except EngineError as exc:
            return exc
    fast = run()
    with monkeypatch.context() as m:
        m.setattr(decode_mod, "splice_top", lambda b, *_: (b, []))
        slow = run()
    return fast, slow


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("n", [1, 3])
def test_decode_generate_matches_general_path(seed: int, n: int,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(100 + seed)
    body = _body(rng, int(rng.integers(1, 30)), int(rng.integers(1, 6)), n=n,
                 pretty=seed % 4 == 3)
    # orjson's compact bodies take the fast path; indented ones the general path
    assert len(splice_top(body)[1]) == (0 if seed % 4 == 3 else n)
    fast, slow = _both(body, monkeypatch)
    if isinstance(slow, EngineError):  # random specials can make the top-k sum exceed 1
        assert isinstance(fast, EngineError) and fast.message == slow.message
        return
    assert isinstance(fast, list) and len(fast) == len(slow) == n
    for a, b in zip(fast, slow):
        assert a.entropy_kind == b.entropy_kind
        assert _same_bits(a.entropy, b.entropy)
        assert _same_bits(a.entropy_error, b.entropy_error)
        assert a.entropy_error_bound == b.entropy_error_bound
        assert "output_top_logprobs" not in a.meta


@pytest.mark.parametrize("top", [
    b"[[[-0.1,1,null]],[[-0.2,2,null]]]",  # 2 rows for 3 tokens
    b"[[[0.5,1,null]],[[-0.2,2,null]],[[-0.3,3,null]]]",  # positive logprob
    b'"#tk:0"',  # an engine sending our placeholder text: not a list
])
def test_malformed_top_logprobs_give_the_same_engine_error(
        top: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    body = (b'{"output_ids":[1,2,3],"meta_info":{"prompt_tokens":1,"completion_tokens":3,'
            b'"output_token_logprobs":[[-0.1,1,null],[-0.2,2,null],[-0.3,3,null]],'
            b'"output_top_logprobs":' + top + b"}}")
    fast, slow = _both(body, monkeypatch)
    assert isinstance(slow, EngineError) and isinstance(fast, EngineError)
    assert fast.message == slow.message


@pytest.mark.parametrize("tail", [
    b"}}",  # last key of the last object: no quote after the value
    b',"input_top_logprobs":[[[-0.4,9,null]]],"x":1}}',  # another canonical array follows
    b'},"text":"]]] [[["}',  # brackets inside a later string
    b',"input_top_logprobs":[[[-0.4,9,null]]]}}]',
])
def test_value_end_is_found_whatever_follows(tail: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    top = b"[[[-1.0,1,null],[-2.5,2,null]],[[-0.2,2,null],[null,3,null]]]"
    head = b'{"output_ids":[1,2],"meta_info":{"prompt_tokens":1,"completion_tokens":2,'
    body = head + b'"output_top_logprobs":' + top + tail
    if tail.endswith(b"]"):
        body = b"[" + body
    spliced, mats = splice_top(body)
    assert len(mats) == 1 and _same_bits(mats[0], _general(orjson.loads(top)))
    assert spliced.endswith(tail)
    fast, slow = _both(body, monkeypatch)
    assert isinstance(fast, list) and isinstance(slow, list)
    assert _same_bits(fast[0].entropy, slow[0].entropy)


def test_text_strings_with_brackets_take_the_general_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    top = b'[[[-1.0,1,"]]]"],[-2.5,2,"[[["]],[[-0.2,2,"a"],[-3.0,3,","]]]'
    body = (b'{"output_ids":[1,2],"meta_info":{"prompt_tokens":1,"completion_tokens":2,'
            b'"output_top_logprobs":' + top + b"}}")
    assert splice_top(body) == (body, [])
    fast, slow = _both(body, monkeypatch)
    assert isinstance(fast, list) and _same_bits(fast[0].entropy, slow[0].entropy)
