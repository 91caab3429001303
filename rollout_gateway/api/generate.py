"""``POST /generate``: SGLang-compatible pass-through that still stamps and publishes.

Existing rollout workers (slime, verl, AReaL style) point at the gateway unchanged. The
request is SGLang's (``text`` or ``input_ids``, ``sampling_params`` with ``n``, ``rid``,
``return_logprob``, ``top_logprobs_num``, ``return_routed_experts``, ``stream``); the answer
is SGLang's shape plus the gateway's stamps in ``meta_info``: ``policy_versions``,
``kv_versions``, ``trajectory_id``, ``segments``, ``entropy_kind``. Not forwarded:
input-token logprobs (``logprob_start_len >= 0``) and top-k logprob rows (the gateway asks
engines for what it stamps); batched prompts (one prompt per call, ``n`` samples).
"""

from __future__ import annotations

import math

try:  # SIMD base64 (a base dependency); the stdlib is the fallback
    from pybase64 import b64encode
except ImportError:  # pragma: no cover
    from base64 import b64encode
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from orjson import Fragment
from pydantic import ValidationError

from rollout_gateway.api.errors import ORJSONResponse
from rollout_gateway.api.routes import gateway, sse
from rollout_gateway.api.serialize import segment_to_json
from rollout_gateway.api.state import Gateway
from rollout_gateway.core.trajectory import Trajectory
from rollout_gateway.errors import InvalidArgument
from rollout_gateway.rollouts.models import SAMPLING_KEYS, RolloutRequest

router = APIRouter(tags=["sglang"])

_PASSED_KEYS = {"text", "input_ids", "sampling_params", "rid", "return_logprob",
                "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "stream",
                "return_routed_experts", "routed_experts_start_len", "return_entropy",
                "group_id", "session_id", "metadata"}


def to_rollout_request(body: Any) -> tuple[RolloutRequest, dict[str, Any]]:
    """Map an SGLang /generate body onto a RolloutRequest (+ the output options)."""
    if not isinstance(body, dict):
        raise InvalidArgument("the body must be a JSON object (batched requests are not "
                              "supported; send one prompt per request, n samples each)")
    unknown = set(body) - _PASSED_KEYS
    if unknown:
        raise InvalidArgument(f"unsupported /generate field(s): {sorted(unknown)}")
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list)):
        raise InvalidArgument("batched /generate is not supported; send one prompt per request")
    sp = dict(body.get("sampling_params") or {})
    if not isinstance(sp, dict):
        raise InvalidArgument("sampling_params must be an object")
    n = sp.pop("n", 1)
    bad = set(sp) - SAMPLING_KEYS
    if bad:
        raise InvalidArgument(f"unknown sampling_params key(s): {sorted(bad)}")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise InvalidArgument("rid must be a string")
    try:
        req = RolloutRequest(
            prompt=text, input_ids=ids, n=n, sampling_params=sp,
            group_id=body.get("group_id"), session_id=body.get("session_id"),
            request_id=rid, metadata=body.get("metadata") or {},
            return_routed_experts=bool(body.get("return_routed_experts", False)))
    except ValidationError as exc:
        msgs = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise InvalidArgument(f"invalid /generate request: {msgs}") from None
    opts = {"return_logprob": bool(body.get("return_logprob", False)),
            "top": int(body.get("top_logprobs_num") or 0),
            "routed": bool(body.get("return_routed_experts", False)),
            "stream": bool(body.get("stream", False)), "rid": rid}
    return req, opts


def _f(x: float) -> float | None:
    return x if math.isfinite(x) else None


def sglang_output(t: Trajectory, text: str, opts: dict[str, Any], rid: str | None,
                  index: int) -> dict[str, Any]:
    c = t.tokens
    spans = [{"version": str(s.policy_version), "start": s.start, "end": s.end} for s in t.segments]
    meta: dict[str, Any] = {
        "id": rid or t.trajectory_id, "finish_reason": t.finish_reason.to_dict(),
        "prompt_tokens": int(t.prompt_token_ids.shape[0]), "completion_tokens": t.num_tokens,
        "cached_tokens": 0,
        "weight_version": str(int(c.policy_version[-1])) if t.num_tokens else None,
        "weight_versions": spans,
        "trajectory_id": t.trajectory_id, "policy_versions": c.policy_version,
        "kv_versions": c.kv_version, "entropy_kind": t.entropy_kind.value,
        "segments": [segment_to_json(s) for s in t.segments],
        "num_retractions": sum(1 for s in t.segments if s.began == "retract"),
    }
    if opts["return_logprob"]:
        lps = c.logprobs.tolist()
        if not np.isfinite(c.logprobs).all():
            lps = [_f(x) for x in lps]
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(lps, c.token_ids.tolist())]
        meta["output_token_entropy"] = c.entropy
    if opts["routed"] and t.routed_experts is not None:
        # a pre-serialized JSON string (base64 needs no escaping): orjson copies the bytes
        # as they are, instead of a bytes->str decode plus a re-scan of the multi-MB string
        meta["routed_experts"] = Fragment(b'"%b"' % b64encode(
            np.ascontiguousarray(t.routed_experts.data, dtype="<i4")))
    out: dict[str, Any] = {"text": text, "output_ids": c.token_ids, "meta_info": meta}
    if t.sample_index or opts.get("n", 1) > 1:
        out["index"] = index
    return out


@router.post("/generate")
async def generate(request: Request, gw: Gateway = Depends(gateway)) -> Response:
    import orjson

    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as exc:
        raise InvalidArgument(f"body is not valid JSON: {exc}") from None
    req, opts = to_rollout_request(body)
    opts["n"] = req.n
    if opts["stream"]:
        return sse(_stream(gw, req, opts))
    results = await gw.rollouts.run_with_text(req)
    outs = [sglang_output(t, text, opts, opts["rid"], i) for i, (t, text) in enumerate(results)]
    return ORJSONResponse(outs if req.n > 1 else outs[0])


async def _stream(gw: Gateway, req: RolloutRequest, opts: dict[str, Any]
                  ) -> AsyncIterator[dict[str, Any]]:
    """SGLang-style cumulative stream: each chunk carries the sample's whole output so far
    (``finish_reason`` null, ``text`` filled in the final chunk), stamps included; the final
    chunk per sample is the complete answer. Then ``[DONE]``."""
    events = await gw.rollouts.open_stream(req)
    sofar: dict[int, dict[str, list]] = {}
    async for ev in events:
        i = ev["sample_index"]
        if ev["type"] == "chunk":
            acc = sofar.setdefault(i, {k: [] for k in ("ids", "lp", "pv", "kv")})
            acc["ids"].append(ev["token_ids"])
            acc["lp"].append(ev["logprobs"])
            acc["pv"].append(ev["policy_version"])
            acc["kv"].append(ev["kv_version"])
            yield _partial(acc, opts, ev["trajectory_id"], i, req.n)
        elif ev["type"] == "trajectory":
            sofar.pop(i, None)
            yield sglang_output(ev["trajectory"], ev["text"], opts, opts["rid"], i)
        elif ev["type"] == "error":
            yield {"error": ev["error"], "index": i}


def _partial(acc: dict[str, list], opts: dict[str, Any], tid: str, index: int, n: int
             ) -> dict[str, Any]:
    ids = np.concatenate(acc["ids"])
    pv = np.concatenate(acc["pv"])
    meta: dict[str, Any] = {"id": opts["rid"] or tid, "finish_reason": None,
                            "completion_tokens": int(ids.shape[0]),
                            "weight_version": str(int(pv[-1])), "trajectory_id": tid,
                            "policy_versions": pv, "kv_versions": np.concatenate(acc["kv"])}
    if opts["return_logprob"] and all(x is not None for x in acc["lp"]):
        lps = np.concatenate(acc["lp"]).tolist()
        meta["output_token_logprobs"] = [[_f(lp), tok, None]
                                         for lp, tok in zip(lps, ids.tolist())]
    out: dict[str, Any] = {"text": "", "output_ids": ids, "meta_info": meta}
    if n > 1:
        out["index"] = index
    return out
