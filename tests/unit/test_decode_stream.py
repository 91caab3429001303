"""Streamed /generate (SSE): cumulative and incremental chunks, any byte split."""

from __future__ import annotations

import base64

import numpy as np
import orjson
import pytest

from rollout_gateway.core.trajectory import EntropyKind
from rollout_gateway.engines.decode import DecodeOptions, RoutingSpec
from rollout_gateway.engines.decode_stream import StreamDecoder
from rollout_gateway.errors import EngineError

IDS = [11, 22, 33, 44, 55]
LPS = [-0.1, -0.2, -0.3, -0.4, -0.5]
ENT = [1.0, 0.5, 0.25, 2.0, 0.0]
PROMPT = 4
ROUTED = (np.arange((PROMPT + len(IDS) - 1) * 2 * 2) % 8).astype("<i4")


def _chunks(incremental: bool) -> list[dict]:
    out, prev = [], 0
    for end in (2, 3, 5):
        lo = prev if incremental else 0
        meta = {"id": "r1", "finish_reason": None, "prompt_tokens": PROMPT,
                "weight_version": "2", "num_retractions": 0,
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(LPS[lo:end],
                                                                          IDS[lo:end])],
                "output_token_entropy": ENT[lo:end],
                "completion_tokens": end, "cached_tokens": 0}
        if end == 5:
            meta["finish_reason"] = {"type": "length", "length": 5}
            meta["routed_experts"] = base64.b64encode(ROUTED.tobytes()).decode()
            meta["weight_versions"] = [{"version": "2", "start": 0, "end": 5}]
        out.append({"text": None, "output_ids": IDS[lo:end], "meta_info": meta})
        prev = end
    return out


def _sse(chunks: list[dict]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize("split", [1, 7, 100, 10_000])
def test_deltas_cover_each_token_exactly_once(incremental, split):
    raw = _sse(_chunks(incremental))
    dec = StreamDecoder(DecodeOptions(routing=RoutingSpec(2, 2, 8)))
    got = []
    for i in range(0, len(raw), split):
        got.extend(dec.feed(raw[i:i + split]))
    assert dec.done and dec.finished
    assert [d.offset for d in got] == [0, 2, 3]
    np.testing.assert_array_equal(np.concatenate([d.output_ids for d in got]), IDS)
    np.testing.assert_allclose(np.concatenate([d.logprobs for d in got]), LPS, rtol=1e-6)
    np.testing.assert_allclose(np.concatenate([d.entropy for d in got]), ENT)
    assert all(d.entropy_kind == EntropyKind.EXACT for d in got)
    last = got[-1]
    assert last.finish_reason == {"type": "length", "length": 5}
    assert last.routed.data.shape == (PROMPT + len(IDS) - 1, 2, 2)
    np.testing.assert_array_equal(last.routed.data.reshape(-1), ROUTED)
    assert got[0].routed is None


def test_crlf_framing_and_comments():
    raw = _sse(_chunks(True)).replace(b"\n\n", b"\r\n\r\n")
    dec = StreamDecoder()
    got = dec.feed(b": keep-alive\r\n\r\n" + raw)
    assert sum(d.num_tokens for d in got) == 5 and dec.done


def test_error_event_is_engine_error():
    dec = StreamDecoder()
    with pytest.raises(EngineError, match="boom"):
        dec.feed(b'data: {"error": {"message": "boom", "code": 500}}\n\n')


def test_inconsistent_chunk_lengths_are_rejected():
    chunks = _chunks(True)
    chunks[1]["meta_info"]["completion_tokens"] = 4  # claims 2 new tokens, sends 1
    dec = StreamDecoder()
    with pytest.raises(EngineError, match="expected"):
        dec.feed(_sse(chunks))


def test_going_backwards_is_rejected():
    chunks = _chunks(False)
    dec = StreamDecoder()
    dec.feed(_sse(chunks[1:2])[: -len(b"data: [DONE]\n\n")])
    with pytest.raises(EngineError, match="backwards"):
        dec.feed(_sse(chunks[0:1]))


def test_truncated_stream_close_flushes_last_event():
    raw = _sse(_chunks(True)[:2])[: -len(b"\n\ndata: [DONE]\n\n")]
    dec = StreamDecoder()
    got = dec.feed(raw)
    got += dec.close()
    assert sum(d.num_tokens for d in got) == 3 and not dec.finished


@pytest.mark.parametrize("incremental", [False, True])
def test_result_merges_the_whole_output(incremental):
    chunks = _chunks(incremental)
    for i, c in enumerate(chunks):
        c["text"] = "abcde"[: c["meta_info"]["completion_tokens"]] if not incremental else \
            "abcde"[[0, 2, 3][i]:c["meta_info"]["completion_tokens"]]
    dec = StreamDecoder(DecodeOptions(routing=RoutingSpec(2, 2, 8)), keep=True)
    dec.feed(_sse(chunks))
    d = dec.result()
    assert d.output_ids.tolist() == IDS and d.offset == 0
    np.testing.assert_allclose(d.logprobs, LPS, rtol=1e-6)
    np.testing.assert_allclose(d.entropy, ENT)
    assert d.text == "abcde" and d.finished and d.spans == [(2, 0, 5)]
    assert d.routed.data.shape == (PROMPT + len(IDS) - 1, 2, 2)


def test_result_of_a_stream_cut_short():
    dec = StreamDecoder(keep=True)
    dec.feed(_sse(_chunks(True)[:2])[: -len(b"data: [DONE]\n\n")])
    d = dec.result()
    assert d.output_ids.tolist() == IDS[:3] and not d.finished
    assert StreamDecoder(keep=True).result() is None
    with pytest.raises(ValueError):
        StreamDecoder().result()


def test_big_event_in_many_pieces_is_linear():
    """A 5 MB final event fed in 4 KiB pieces must not be rescanned per piece."""
    import time

    big = {"text": "", "output_ids": [1], "meta_info": {
        "id": "r", "finish_reason": {"type": "length", "length": 1}, "completion_tokens": 1,
        "prompt_tokens": 1, "routed_experts": "AAAA" * 1_300_000}}
    raw = b"data: " + orjson.dumps(big) + b"\n\ndata: [DONE]\n\n"
    dec = StreamDecoder()
    t0 = time.thread_time()
    got = []
    for i in range(0, len(raw), 4096):
        got.extend(dec.feed(raw[i:i + 4096]))
    elapsed = time.thread_time() - t0
    assert len(got) == 1 and got[0].routed_experts.size == 1_300_000 * 3 // 4 and dec.done
    assert elapsed < 0.5  # rescanning the buffer per piece took 4.4 s here (0.02 s now)


def test_separator_split_across_pieces():
    raw = _sse(_chunks(True))
    cut = raw.index(b"\n\n") + 1  # between the two newlines
    dec = StreamDecoder()
    got = dec.feed(raw[:cut]) + dec.feed(raw[cut:])
    assert sum(d.num_tokens for d in got) == 5


def test_multiline_data_and_mixed_separators():
    payload = orjson.dumps(_chunks(True)[0])
    half = payload.index(b'"meta_info"')  # split between two keys: the newline is whitespace
    # one event whose data spans two data: lines (joined with a newline, valid JSON whitespace)
    raw = (b"data: " + payload[:half] + b"\ndata: " + payload[half:] + b"\r\n\r\n"
           + b"event: ping\n\n" + b"data: [DONE]\n\n")
    dec = StreamDecoder()
    got = dec.feed(raw)
    assert [d.num_tokens for d in got] == [2] and dec.done


@pytest.mark.parametrize("incremental", [False, True])
def test_feed_payload_takes_unframed_data(incremental):
    dec = StreamDecoder(DecodeOptions(routing=RoutingSpec(2, 2, 8)), keep=True)
    got = []
    for c in _chunks(incremental):
        got += dec.feed_payload(orjson.dumps(c))
    assert dec.feed_payload(b"[DONE]") == [] and dec.done
    assert [d.offset for d in got] == [0, 2, 3]
    assert dec.result().output_ids.tolist() == IDS
    with pytest.raises(EngineError, match="boom"):
        StreamDecoder().feed_payload(b'{"error": {"message": "boom"}}')


def _top_chunks(rows: np.ndarray, cuts: list[int], incremental: bool) -> list[bytes]:
    """SGLang-shaped payloads carrying top-k rows (no exact entropy): one per cut."""
    out, prev = [], 0
    t = rows.shape[0]
    for i, end in enumerate([*cuts, t]):
        lo = prev if incremental else 0
        top = [[[None if lp == -np.inf else float(lp), 100 + j, None]
                for j, lp in enumerate(r)] for r in rows[lo:end]]
        meta = {"id": "r1", "prompt_tokens": 3, "completion_tokens": end,
                "finish_reason": {"type": "length", "length": t} if end == t else None,
                "output_top_logprobs": top,
                "output_token_logprobs": [[min(float(r[0]), -0.01), 100, None]
                                          for r in rows[lo:end]]}
        out.append(orjson.dumps({"output_ids": [100] * (end - lo), "meta_info": meta}))
        prev = end
    return out


@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_deferred_entropy_is_the_per_chunk_estimate_bit_for_bit(incremental, seed):
    """DecodeOptions.defer_entropy (one estimate over the whole output at result()) gives
    the same entropy, per-token bounds and max bound as estimating every chunk; a chunk
    with impossible rows still fails where it arrives."""
    from dataclasses import replace

    rng = np.random.default_rng(seed)
    t, k = int(rng.integers(1, 300)), int(rng.integers(1, 8))
    p = rng.dirichlet(np.ones(k + int(rng.integers(0, 50))), t)[:, :k]
    rows = -np.sort(-np.log(p.astype(np.float32)), axis=1).astype(np.float64)
    if seed % 3 == 0:
        rows[rng.integers(0, t), -1] = -np.inf  # a probability-0 entry (null)
    cuts = sorted(set(rng.integers(1, t, int(rng.integers(0, 6))).tolist())) if t > 1 else []
    payloads = _top_chunks(rows, cuts, incremental)
    opts = DecodeOptions(vocab_size=1000)
    results = []
    for o in (opts, replace(opts, defer_entropy=True)):
        dec = StreamDecoder(o, keep=True)
        for pl in payloads:
            dec.feed_payload(pl)
        results.append(dec.result())
    now, later = results
    assert later.entropy_kind == now.entropy_kind == EntropyKind.TOPK_ESTIMATE
    assert later.entropy.tobytes() == now.entropy.tobytes()
    assert later.entropy_error.tobytes() == now.entropy_error.tobytes()
    assert later.entropy_error_bound == now.entropy_error_bound
    assert later.entropy_rows is None and not np.isnan(later.entropy).any()
    # rows no distribution has (probabilities summing to 2) fail at their chunk
    bad = rows.copy()
    bad[-1, :] = np.log(2.0 / k) if k > 1 else 0.5
    dec = StreamDecoder(replace(opts, defer_entropy=True), keep=True)
    *good, last = _top_chunks(bad, cuts, incremental)
    for pl in good:
        dec.feed_payload(pl)
    with pytest.raises(EngineError, match="NaN or positive|sum to"):
        dec.feed_payload(last)
