"""Trajectories as JSON for HTTP clients.

Per-token columns stay numpy arrays here and are written by orjson with
``OPT_SERIALIZE_NUMPY`` (C speed, no per-token Python objects; NaN/inf become null).
Routed experts travel as base64 of the narrow-dtype array; SGLang logprob rows kept as
columns (:class:`~rollout_gateway.engines.decode_toplogprobs.LogprobRows`) are written from
them by :func:`json_default`."""

from __future__ import annotations

import math
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


def json_default(obj: Any) -> Any:
    """orjson's ``default`` for the gateway's answers: logprob rows kept as columns."""
    if isinstance(obj, LogprobRows):
        return orjson.Fragment(obj.to_json())
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj, default=json_default, option=JSON_OPTS)


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
        "engine_ids": t.engine_ids, "created_at": t.created_at, "finished_at": t.finished_at,
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
