"""The chunked pybase64 routed-experts path equals a straightforward whole-string decode."""

from __future__ import annotations

import base64
import binascii

import numpy as np
import pytest

from rollout_gateway.engines import decode_experts
from rollout_gateway.engines.decode_experts import decode_routed_experts
from rollout_gateway.errors import EngineError

pytestmark = pytest.mark.skipif(decode_experts.pybase64 is None, reason="pybase64 missing")


def _reference(text: bytes, num_experts: int) -> np.ndarray:
    ids = np.frombuffer(binascii.a2b_base64(text, strict_mode=True), "<i4")
    assert ids.size == 0 or (ids.min() >= 0 and ids.max() < num_experts)
    return ids.astype(np.uint8 if num_experts <= 256 else np.int32)


@pytest.fixture(params=[64, 1 << 18])
def chunk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(decode_experts, "_PY_CHUNK", request.param)
    return request.param


@pytest.mark.parametrize("num_experts", [128, 256, 300])
def test_chunked_equals_whole_decode_around_chunk_boundaries(chunk: int,
                                                             num_experts: int) -> None:
    rng = np.random.default_rng(num_experts)
    # int32 counts whose base64 ends just before, at, and after chunk boundaries, with
    # and without '=' padding (counts not divisible by 3)
    base = chunk // 16 * 3
    for count in sorted({1, base - 1, base, base + 1, base + 2, 2 * base, 2 * base + 1,
                         3 * base + 2}):
        ids = rng.integers(0, num_experts, count).astype("<i4")
        text = base64.b64encode(ids.tobytes())
        got = decode_routed_experts(b"xx" + text + b"yy", 2, 2 + len(text),
                                    num_experts=num_experts)
        want = _reference(text, num_experts)
        assert got.dtype == want.dtype and np.array_equal(got, want), count


def _text_with(chunk: int, value: int, at: int, count: int) -> bytes:
    ids = np.zeros(count, "<i4")
    ids[at] = value
    return base64.b64encode(ids.tobytes())


@pytest.mark.parametrize("value", [128, 255, 256, -1, 1 << 30])
def test_out_of_range_in_a_later_chunk_is_an_engine_error(chunk: int, value: int) -> None:
    count = chunk // 16 * 3 * 3
    text = _text_with(chunk, value, count - 2, count)
    with pytest.raises(EngineError, match="outside"):
        decode_routed_experts(text, 0, len(text), num_experts=128)


def test_padding_inside_the_text_is_rejected(chunk: int) -> None:
    first = base64.b64encode(b"\x01" * (chunk // 4 * 3 - 2))
    assert len(first) == chunk and first.endswith(b"==")
    text = first + base64.b64encode(b"\x00\x00\x00" + b"\x03\x00\x00\x00" * 30)
    with pytest.raises(binascii.Error):
        binascii.a2b_base64(text, strict_mode=True)  # the reference rejects it too
    with pytest.raises(EngineError, match="padding inside the text"):
        decode_routed_experts(text, 0, len(text), num_experts=128)


@pytest.mark.parametrize("bad", [b"!", b'"', b"A", b"AA", b"A===", b" "])
def test_malformed_base64_in_the_last_chunk_is_an_engine_error(chunk: int, bad: bytes) -> None:
    text = base64.b64encode(np.ones(chunk // 16 * 3 * 2, "<i4").tobytes())
    bad_text = text[:-4] + bad
    with pytest.raises(EngineError, match="routed_experts"):
        decode_routed_experts(bad_text, 0, len(bad_text), num_experts=128)


def test_bytes_not_a_whole_number_of_int32(chunk: int) -> None:
    text = base64.b64encode(np.ones(chunk // 16 * 3 * 2, "<i4").tobytes() + b"\x00\x00")
    with pytest.raises(EngineError, match="whole number of int32"):
        decode_routed_experts(text, 0, len(text), num_experts=128)
