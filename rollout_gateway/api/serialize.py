"""Trajectories as JSON for HTTP clients (columns stay lists; routing is base64)."""

from __future__ import annotations

import base64
import math
from typing import Any

import numpy as np

from rollout_gateway.core.trajectory import Segment, TokenColumns, Trajectory


def _floats(a: np.ndarray) -> list[float | None]:
    """float32 column -> list; NaN/inf (not JSON) become None."""
    out = a.astype(np.float64).tolist()
    if not np.isfinite(a).all():
        out = [x if math.isfinite(x) else None for x in out]
    return out


def segment_to_json(s: Segment) -> dict[str, Any]:
    return {"start": s.start, "end": s.end, "policy_version": s.policy_version,
            "engine_id": s.engine_id, "began": s.began.value, "ended": s.ended.value,
            "started_at": s.started_at, "ended_at": s.ended_at}


def columns_to_json(c: TokenColumns) -> dict[str, Any]:
    return {"token_ids": c.token_ids.tolist(), "logprobs": _floats(c.logprobs),
            "entropy": _floats(c.entropy), "policy_version": c.policy_version.tolist(),
            "kv_version": c.kv_version.tolist()}


def trajectory_to_json(t: Trajectory) -> dict[str, Any]:
    out: dict[str, Any] = {
        "trajectory_id": t.trajectory_id, "group_id": t.group_id,
        "sample_index": t.sample_index, "prompt_token_ids": t.prompt_token_ids.tolist(),
        "finish_reason": t.finish_reason.to_dict(), "num_tokens": t.num_tokens,
        **columns_to_json(t.tokens),
        "entropy_kind": t.entropy_kind.value,
        "entropy_error_bound": t.entropy_error_bound if math.isfinite(t.entropy_error_bound) else None,
        "segments": [segment_to_json(s) for s in t.segments],
        "engine_ids": t.engine_ids, "created_at": t.created_at, "finished_at": t.finished_at,
        "metadata": t.metadata,
    }
    r = t.routed_experts
    if r is not None:
        out["routed_experts"] = {"shape": list(r.data.shape), "dtype": r.data.dtype.str,
                                 "num_experts": r.num_experts, "start": r.start,
                                 "data_b64": base64.b64encode(r.data.tobytes()).decode()}
    return out


def piece_event(sample_index: int, trajectory_id: str, piece: Any, offset: int) -> dict[str, Any]:
    """A stamped chunk: the tokens one engine request added to a sample."""
    return {"type": "chunk", "sample_index": sample_index, "trajectory_id": trajectory_id,
            "offset": offset, "engine_id": piece.engine_id, **columns_to_json(piece.cols),
            "segments": [segment_to_json(s) for s in piece.segments]}
