"""Trajectories as JSON for HTTP clients.

Per-token columns stay numpy arrays here and are written by orjson with
``OPT_SERIALIZE_NUMPY`` (C speed, no per-token Python objects; NaN/inf become null).
Routed experts travel as base64 of the narrow-dtype array; SGLang logprob rows kept as
columns (:class:`~rollout_gateway.engines.decode_toplogprobs.LogprobRows`) are written from
them by :func:`json_default`."""

from __future__ import annotations

import math
import secrets
from typing import Any

import numpy as np
import orjson

from rollout_gateway.core.trajectory import Segment, TokenColumns, Trajectory
from rollout_gateway.engines.decode_toplogprobs import LogprobRows

try:  # SIMD base64 (a base dependency); the stdlib is the fallback
    from pybase64 import b64encode
except ImportError:  # pragma: no cover
    from base64 import b64encode


JSON_OPTS = orjson.OPT_SERIALIZE_NUMPY


class RawString:
    """A JSON string's content given as bytes (or a view of them, e.g. of an engine's
    response body) that need no escaping (base64, ASCII digits): :func:`dumps` writes it
    between quotes with one copy, where an ``orjson.Fragment`` costs two (its own bytes,
    then orjson's output buffer). Only for content the gateway validated as such."""

    __slots__ = ("data",)

    def __init__(self, data: bytes | memoryview) -> None:
        self.data = data


def json_default(obj: Any) -> Any:
    """orjson's ``default`` for the gateway's answers: logprob rows kept as columns."""
    if isinstance(obj, LogprobRows):
        return orjson.Fragment(obj.to_json())
    if isinstance(obj, RawString):  # outside dumps(): a plain copy
        return orjson.Fragment(b'"%b"' % obj.data)
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def dumps(obj: Any) -> bytes:
    """JSON of an answer; each :class:`RawString` is spliced into orjson's output by a
    placeholder (a per-call nonce that no content can guess), in one join."""
    parts = dumps_parts(obj)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def dumps_parts(obj: Any) -> list[bytes | memoryview]:
    """:func:`dumps` as the pieces that joined make it: orjson's output between the
    :class:`RawString` values, and those values (views, not copies). A response sends them
    as they are: a multi-MB routed-experts text is not copied once more to join it."""
    raws: list[bytes | memoryview] = []
    nonce = secrets.token_hex(8)

    def default(o: Any) -> Any:
        if isinstance(o, RawString):
            raws.append(o.data)
            return f"\x00{nonce}:{len(raws) - 1}"
        return json_default(o)

    out = orjson.dumps(obj, default=default, option=JSON_OPTS)
    if not raws:
        return [out]
    parts: list[bytes | memoryview] = []
    view = memoryview(out)
    pos = 0
    for i, data in enumerate(raws):
        mark = b'"\\u0000%b:%d"' % (nonce.encode(), i)
        at = out.find(mark, pos)
        parts += [view[pos:at + 1], data]  # up to and with the opening quote, the text
        pos = at + len(mark) - 1  # the closing quote starts the next piece
    parts.append(view[pos:])
    return parts


def segment_to_json(s: Segment) -> dict[str, Any]:
    return {"start": s.start, "end": s.end, "policy_version": s.policy_version,
            "engine_id": s.engine_id, "began": s.began.value, "ended": s.ended.value,
            "started_at": s.started_at, "ended_at": s.ended_at}


def columns_to_json(c: TokenColumns) -> dict[str, Any]:
    return {"token_ids": c.token_ids, "logprobs": c.logprobs, "entropy": c.entropy,
            "policy_version": c.policy_version, "kv_version": c.kv_version}


def trajectory_to_json(t: Trajectory) -> dict[str, Any]:
    out: dict[str, Any] = {
        "trajectory_id": t.trajectory_id, "group_id": t.group_id,
        "sample_index": t.sample_index, "prompt_token_ids": t.prompt_token_ids,
        "finish_reason": t.finish_reason.to_dict(), "num_tokens": t.num_tokens,
        **columns_to_json(t.tokens),
        "entropy_kind": t.entropy_kind.value,
        "entropy_error_bound": t.entropy_error_bound if math.isfinite(t.entropy_error_bound) else None,
        "segments": [segment_to_json(s) for s in t.segments],
        "engine_ids": t.engine_ids, "min_version": t.min_version, "max_version": t.max_version,
        "spanning_versions": t.min_version != t.max_version,
        "created_at": t.created_at, "finished_at": t.finished_at,
        "metadata": t.metadata,
    }
    if t.tokens.old_logprobs is not None:  # exact old logits (old_logits.mode)
        out["old_logprobs"] = t.tokens.old_logprobs
    r = t.routed_experts
    if r is not None:
        out["routed_experts"] = {"shape": list(r.data.shape), "dtype": r.data.dtype.str,
                                 "num_experts": r.num_experts, "start": r.start,
                                 "data_b64": b64encode(np.ascontiguousarray(r.data)).decode()}
    return out
