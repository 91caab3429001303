"""Request parsing, SGLang's span rule and response shapes (pure, no engine)."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from reference_engine.protocol import ProtocolError, format_output, parse_generate
from reference_engine.request import GenParams, Request, VersionEvent
from reference_engine.scheduler_spans import weight_version_spans
from reference_engine.tokenizer import VOCAB_SIZE, ByteTokenizer

TOK = ByteTokenizer()


def parse(body):
    return parse_generate(body, TOK, VOCAB_SIZE, 4096)


def test_spans_follow_sglang_rule():
    assert weight_version_spans([], "3", 5) == [{"version": "3", "start": 0, "end": 5}]
    ev = [VersionEvent("0", 2), VersionEvent("1", 2), VersionEvent("2", 4)]
    assert weight_version_spans(ev, "3", 6) == [
        {"version": "0", "start": 0, "end": 2}, {"version": "2", "start": 2, "end": 4},
        {"version": "3", "start": 4, "end": 6}]
    assert weight_version_spans([VersionEvent("a", 3)], "a", 5) == [
        {"version": "a", "start": 0, "end": 5}]
    assert weight_version_spans([], "0", 0) == [{"version": "0", "start": 0, "end": 0}]


def test_parse_single_batch_and_n():
    p = parse({"text": "hi", "sampling_params": {"max_new_tokens": 3, "top_k": 1073741824}})
    assert not p.is_list and p.items[0][1] == [104, 105]
    assert p.items[0][2].max_new_tokens == 3 and p.items[0][2].top_k == -1
    p = parse({"input_ids": [[1], [2, 3]], "rid": ["a", "b"]})
    assert p.is_list and [i[0] for i in p.items] == ["a", "b"]
    p = parse({"input_ids": [1], "rid": "x", "sampling_params": {"n": 3}})
    assert p.is_list and len({i[0] for i in p.items}) == 3 and "x" not in {i[0] for i in p.items}


@pytest.mark.parametrize("body,schema", [
    ({"input_ids": [1], "sampling_params": {"seed": 1}}, True),
    ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, False),
    ({"input_ids": [[1], [2]], "rid": ["a"]}, False),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 1.5}}, False),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, False),
    ({"input_ids": [1], "sampling_params": {"n": 0}}, False),
    ({"input_ids": [1] * 5000}, False),
    ([1, 2], False),
])
def test_parse_errors(body, schema):
    with pytest.raises(ProtocolError) as e:
        parse(body)
    assert e.value.schema is schema
    body_json = e.value.body()
    assert isinstance(body_json["error"], str if schema else dict)


def test_format_output_shapes():
    g = GenParams(max_new_tokens=3, return_logprob=True, logprob_start_len=0,
                  return_routed_experts=True, return_entropy=True, return_text_in_logprobs=True)
    r = Request("r1", [256, 104], g, num_layers=2, top_k=2)
    r.output = [105, 33]
    r.out_logprobs, r.out_entropy = [-0.5, -1.0], [1.5, 2.0]
    r.input_logprobs = [None, -3.0]
    r.admitted = True
    r.set_routing(0, np.arange(12, dtype=np.int32).reshape(3, 2, 2))
    r.finish = {"type": "stop", "matched": 257}
    r.final_spans = weight_version_spans([VersionEvent("0", 1)], "1", 2)
    out = format_output(r, 2, "9", TOK, final=True)
    m = out["meta_info"]
    assert out["text"] == "i!" and out["output_ids"] == [105, 33]
    assert m["output_token_logprobs"] == [[-0.5, 105, "i"], [-1.0, 33, "!"]]
    assert m["input_token_logprobs"] == [[None, 256, "<|bos|>"], [-3.0, 104, "h"]]
    assert m["weight_versions"] == [{"version": "0", "start": 0, "end": 1},
                                    {"version": "1", "start": 1, "end": 2}]
    assert m["weight_version"] == "1"
    routed = np.frombuffer(base64.b64decode(m["routed_experts"]), "<i4").reshape(-1, 2, 2)
    np.testing.assert_array_equal(routed, np.arange(12).reshape(3, 2, 2))
    partial = format_output(r, 1, "9", TOK, final=False)
    assert partial["meta_info"]["finish_reason"] is None
    assert "weight_versions" not in partial["meta_info"] and "routed_experts" not in partial["meta_info"]
    delta = format_output(r, 2, "9", TOK, since=1, final=False, incremental=True)
    assert delta["output_ids"] == [33] and delta["text"] == "!"
    assert delta["meta_info"]["output_token_logprobs"] == [[-1.0, 33, "!"]]


def test_incremental_text_deltas_concatenate_to_final_text():
    g = GenParams(max_new_tokens=8)
    r = Request("r2", [256], g, num_layers=1, top_k=1)
    r.output = TOK.encode("a✓é!")
    r.out_logprobs = [0.0] * len(r.output)
    r.out_entropy = [0.0] * len(r.output)
    sent, parts = 0, []
    for n in range(1, len(r.output)):
        parts.append(format_output(r, n, "0", TOK, since=sent, final=False, incremental=True)["text"])
        sent = n
    r.finish = {"type": "length", "length": 8}
    parts.append(format_output(r, len(r.output), "0", TOK, since=sent, final=True,
                               incremental=True)["text"])
    assert "".join(parts) == "a✓é!"
    assert all("\ufffd" not in p for p in parts)


async def test_stream_pump_ends_on_the_final_count_when_older_counts_are_queued():
    """An abort can finish a request while counts of earlier steps still wait in its queue
    (the abort processes the in-flight step, then finishes): the stream must still get the
    final count, or it never sends its last chunk and stays open."""
    import asyncio

    from reference_engine.server import _pump

    r = Request("a", [1, 2], GenParams(max_new_tokens=8), 2, 2)
    q: asyncio.Queue = asyncio.Queue()
    r.listeners.append(q)
    r.output = [5, 6, 7]
    for n in (1, 2, 3):  # a step's count, the in-flight step's, the abort's
        q.put_nowait(n)
    r.finish = {"type": "abort", "message": "Aborted"}
    merged: asyncio.Queue = asyncio.Queue()
    await asyncio.wait_for(_pump(0, r, merged), 5)
    got = [merged.get_nowait() for _ in range(merged.qsize())]
    assert got == [(0, 3)]
