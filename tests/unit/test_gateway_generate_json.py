"""The SGLang pass-through's JSON: routed experts as SGLang's int32 base64, and
output_token_logprobs as [logprob, token_id, null] rows (non-finite logprobs as null)."""

from __future__ import annotations

import base64
import math
from dataclasses import replace

import numpy as np
import orjson


def test_sglang_output_routed_experts_and_logprob_pairs():
    from rollout_gateway.api.generate import GenerateOptions, sglang_output
    from doubles.trajectories import make_trajectory

    t = make_trajectory("t", num_tokens=5, prompt_len=3, num_layers=4, top_k=2)
    from rollout_gateway.api.serialize import dumps

    out = orjson.loads(dumps(sglang_output(
        t, "txt", GenerateOptions(return_logprob=True, routed=True), 0)))
    meta = out["meta_info"]
    want = np.ascontiguousarray(t.routed_experts.data, dtype="<i4")
    assert base64.b64decode(meta["routed_experts"]) == want.tobytes()
    lps = t.tokens.logprobs.tolist()
    assert meta["output_token_logprobs"] == [
        [lp if math.isfinite(lp) else None, tok, None]
        for lp, tok in zip(lps, t.tokens.token_ids.tolist())]


def test_the_engines_routed_experts_text_is_forwarded_when_it_is_the_answer():
    from rollout_gateway.api.generate import GenerateOptions, sglang_output
    from rollout_gateway.api.serialize import dumps
    from doubles.trajectories import make_trajectory

    t = make_trajectory("t", num_tokens=5, prompt_len=3, num_layers=4, top_k=2)
    engine_text = base64.b64encode(np.ascontiguousarray(t.routed_experts.data, dtype="<i4"))
    body = b'{"routed_experts":"' + engine_text + b'"}'
    view = memoryview(body)[len(b'{"routed_experts":"'):-2]
    opts = GenerateOptions(return_logprob=False, routed=True)
    out = orjson.loads(dumps(sglang_output(t, "", opts, 0, {"routed_experts": view})))
    assert out["meta_info"]["routed_experts"].encode() == engine_text
    # from a later position (routed_experts_start_len): cut and re-encoded from the columns
    out = orjson.loads(dumps(sglang_output(t, "", replace(opts, routed_start=2), 0,
                                           {"routed_experts": view})))
    want = np.ascontiguousarray(t.routed_experts.data[2:], dtype="<i4")
    assert base64.b64decode(out["meta_info"]["routed_experts"]) == want.tobytes()


def test_raw_strings_are_spliced_once_and_text_that_looks_like_a_placeholder_stays():
    from rollout_gateway.api.serialize import RawString, dumps, json_default

    body = b'{"routed_experts":"QUJDRA=="}'
    view = memoryview(body)[19:-2]
    obj = {"meta": [{"r": RawString(view)}, {"r": RawString(b"Zg==")}],
           "text": "\x00" + "0" * 16 + ":0", "n": np.arange(3)}
    out = dumps(obj)
    assert orjson.loads(out) == {"meta": [{"r": "QUJDRA=="}, {"r": "Zg=="}],
                                 "text": "\x00" + "0" * 16 + ":0", "n": [0, 1, 2]}
    # with plain orjson and the shared default: the same JSON
    assert orjson.loads(orjson.dumps(obj, default=json_default,
                                     option=orjson.OPT_SERIALIZE_NUMPY)) == orjson.loads(out)


def test_the_answer_is_sent_as_its_parts_with_the_whole_length():
    """ORJSONResponse sends dumps_parts' pieces (the engine's text as a view, never joined)
    under one Content-Length; what arrives is exactly dumps(obj)."""
    import asyncio

    from rollout_gateway.api.errors import ORJSONResponse
    from rollout_gateway.api.serialize import RawString, dumps

    body = b'{"routed_experts":"' + b"QUJD" * 5000 + b'"}'
    text = memoryview(body)[19:-2]
    obj = {"meta_info": {"routed_experts": RawString(text), "id": "r"}, "text": "x"}
    resp = ORJSONResponse(obj, headers={"x-a": "1"})
    sent: list[dict] = []

    async def send(msg):
        sent.append(msg)

    asyncio.run(resp({"type": "http"}, None, send))
    start, *bodies = sent
    headers = dict(start["headers"])
    whole = b"".join(bytes(m["body"]) for m in bodies)
    assert whole == dumps(obj) and int(headers[b"content-length"]) == len(whole)
    assert headers[b"x-a"] == b"1" and headers[b"content-type"] == b"application/json"
    assert [m["more_body"] for m in bodies] == [True] * (len(bodies) - 1) + [False]
    assert any(m["body"] is text for m in bodies)  # the engine's text itself, not a copy
    assert all(k != b"content-length"
               for k, _ in ORJSONResponse({"a": 1}, status_code=204).raw_headers)
