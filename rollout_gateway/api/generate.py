"""``POST /generate``: a drop-in for SGLang 0.5.23's, that still stamps and publishes.

Existing rollout workers (slime, verl, AReaL) point at the gateway unchanged. Every field
of SGLang's ``GenerateReqInput`` is either forwarded with SGLang's meaning and answer
shape, or refused with a 400 that names it:

- forwarded: ``text`` / ``input_ids`` (one prompt or a batch list), ``sampling_params``
  (one object or one per prompt; ``n > 1`` gives n samples per prompt), ``rid`` (string,
  or one per prompt), ``return_logprob`` -> ``output_token_logprobs``,
  ``logprob_start_len`` -> ``input_token_logprobs`` (from that prompt position),
  ``top_logprobs_num`` -> ``output_top_logprobs`` and ``input_top_logprobs``,
  ``return_text_in_logprobs`` (token texts in those rows, as the engine detokenized them),
  ``return_routed_experts`` / ``routed_experts_start_len``, ``stream`` (SGLang's SSE, then
  ``[DONE]``: cumulative chunks, or deltas when every engine runs
  ``--incremental-streaming-output`` as SGLang itself would), ``session_id`` (also the routing stickiness key),
  ``return_entropy`` (SGLang's is a stub; here ``output_token_entropy`` is returned);
- accepted only at their default value (each a no-op then; anything else is a 400 naming
  it): the multimodal, LoRA, disaggregation, hidden-state, custom-processor and other
  fields in :data:`NOOP_AT_DEFAULT`;
- gateway extensions: ``group_id``, ``metadata``, ``version_policy`` (which engine
  versions may serve: ``rollout_gateway.api.version_policy``).

Answers: a dict for one prompt with n = 1, else a list, prompt-major (prompt i, sample j
at ``i * n + j``), each element SGLang's ``{"text", "output_ids", "meta_info"}`` plus the
gateway's stamps in ``meta_info`` (``policy_versions``, ``kv_versions``,
``trajectory_id``, ``segments``, ``entropy_kind``, ``entropy_error_bound``,
``spanning_versions``: tokens of more than one weight version); each
element is a published trajectory.
"""

from __future__ import annotations

import asyncio
import math

try:  # SIMD base64 (a base dependency); the stdlib is the fallback
    from pybase64 import b64encode
except ImportError:  # pragma: no cover
    from base64 import b64encode
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import ValidationError

from rollout_gateway.api.deps import Pool, Rollouts
from rollout_gateway.api.errors import ORJSONResponse, validation_text
from rollout_gateway.api.routes import sse
from rollout_gateway.api.schemas import generate_openapi_body
from rollout_gateway.api.security import caller, keep_pending, require_client
from rollout_gateway.api.serialize import RawString, segment_to_json
from rollout_gateway.api.version_policy import apply_body_policy, versions_header
from rollout_gateway.core.trajectory import Trajectory, Transition
from rollout_gateway.engines.decode_toplogprobs import LogprobRows, cut_top
from rollout_gateway.engines.pool import EnginePool
from rollout_gateway.errors import EngineError, InvalidArgument
from rollout_gateway.rollouts.models import SAMPLING_KEYS, RolloutRequest
from rollout_gateway.rollouts.rollout import RolloutService
from rollout_gateway.rollouts.sample import PassThrough

router = APIRouter(tags=["sglang"])

#: GenerateReqInput fields forwarded with SGLang's meaning (+ the gateway's extensions)
FORWARDED = frozenset({
    "text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "return_text_in_logprobs", "stream", "return_routed_experts",
    "routed_experts_start_len", "return_entropy", "session_id", "group_id", "metadata",
    "log_metrics", "conversation_id", "custom_labels", "no_logs", "received_time",
    "external_trace_header",  # bookkeeping of SGLang's own: nothing to forward
    "version_policy",  # the gateway's: which engine versions may serve (api.version_policy)
})
#: GenerateReqInput fields the gateway cannot honour: accepted at these defaults only
NOOP_AT_DEFAULT: dict[str, Any] = {
    "input_embeds": None, "image_data": None, "video_data": None, "audio_data": None,
    "mm_hashes": None, "mm_content_hashes": None, "use_audio_in_video": False,
    "video_config": None, "token_ids_logprob": None, "return_sampling_mask": None,
    "return_flat_raw_top_logprobs": False, "return_flat_raw_top_logprobs_b64": False,
    "return_hidden_states": False, "return_indexer_topk": False, "modalities": None,
    "session_params": None, "lora_path": None, "lora_id": None,
    "custom_logit_processor": None, "positional_embed_overrides": None,
    "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None,
    "bootstrap_pair_key": None, "decode_tp_size": None, "routed_dp_rank": None,
    "data_parallel_rank": None, "disagg_prefill_dp_rank": None, "kv_router_hint": None,
    "routing_key": None, "background": False, "require_reasoning": False,
    "max_thinking_tokens": None, "priority": None, "extra_key": None, "return_bytes": False,
    "return_prompt_token_ids": False, "need_wait_for_mm_inputs": None,
    "num_items_assigned": None, "encoder_urls": None, "max_dynamic_patch": None,
    "min_dynamic_patch": None, "image_max_dynamic_patch": None,
    "video_max_dynamic_patch": None, "images_config": None,
    "multi_item_delimiter_indices": None, "cache_salt": None, "http_worker_ipc": None,
}


@dataclass(frozen=True, slots=True)
class GenerateOptions:
    """How one prompt's answer is written, read once from the body (:func:`parse_generate`)."""

    return_logprob: bool = False  # output_token_logprobs (and the rows passed through)
    top: int = 0  # top_logprobs_num: output_top_logprobs rows of streamed chunks
    routed: bool = False  # return_routed_experts
    routed_start: int = 0  # routed_experts_start_len: the routed rows from this position
    stream: bool = False  # SGLang's SSE stream instead of one answer
    rid: str | None = None  # the answer's meta_info.id when n == 1
    n: int = 1  # samples of this prompt
    entropy: bool = False  # output_token_entropy (return_entropy, or return_logprob)
    text_in_logprobs: bool = False  # return_text_in_logprobs: token texts in the rows


@dataclass(slots=True)
class Item:
    """One prompt of a (possibly batched) /generate call."""

    req: RolloutRequest
    opts: GenerateOptions
    passthrough: PassThrough


def _per(body: dict[str, Any], key: str, i: int, n_items: int, batched: bool,
         default: Any = None) -> Any:
    """SGLang's per-prompt fields: a scalar for all prompts, or one entry per prompt."""
    v = body.get(key, default)
    if batched and isinstance(v, list):
        if len(v) != n_items:
            raise InvalidArgument(f"{key} has {len(v)} entries for {n_items} prompts")
        return v[i]
    return v


def _int(v: Any, name: str, default: int) -> int:
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not -(1 << 31) <= v < (1 << 31):
        raise InvalidArgument(f"{name} must be a 32-bit integer, got {v!r:.40}")
    return v


def _flag(v: Any, name: str, default: bool = False) -> bool:
    """A boolean field (strict: ``[null, null]`` or ``"yes"`` is a 400, not "truthy")."""
    if v is None:
        return default
    if not isinstance(v, bool):
        raise InvalidArgument(f"{name} must be true or false (or one per prompt of a "
                              f"batch), got {type(v).__name__}")
    return v


def parse_generate(body: Any, max_top: int = 100) -> list[Item]:
    """Map an SGLang /generate body onto one RolloutRequest per prompt."""
    if not isinstance(body, dict):
        raise InvalidArgument("the body must be a JSON object (SGLang's GenerateReqInput)")
    unknown = sorted(set(body) - FORWARDED - set(NOOP_AT_DEFAULT))
    if unknown:
        raise InvalidArgument(f"unsupported /generate field(s): {unknown} (not fields of "
                              f"SGLang's GenerateReqInput)", details={"fields": unknown})
    refused = sorted(k for k, d in NOOP_AT_DEFAULT.items()
                     if k in body and body[k] is not None and body[k] != d)
    if refused:
        raise InvalidArgument(f"/generate field(s) {refused} are not supported by the gateway "
                              f"(only their default value is accepted)",
                              details={"fields": refused})
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise InvalidArgument("give exactly one of text or input_ids")
    if text is not None:
        batched = isinstance(text, list)
        prompts: list[Any] = text if batched else [text]
    else:
        batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        prompts = ids if batched else [ids]
    if not prompts:
        raise InvalidArgument("the batch of prompts is empty")
    rid = body.get("rid")
    if batched and rid is not None and not isinstance(rid, list):
        if not isinstance(rid, str):
            raise InvalidArgument("rid must be a string or a list of strings")
        rid = [f"{rid}_{i}" for i in range(len(prompts))]  # SGLang: a prefix per item
    text_in = _flag(body.get("return_text_in_logprobs"), "return_text_in_logprobs")
    stream = _flag(body.get("stream"), "stream")
    entropy = _flag(body.get("return_entropy"), "return_entropy")
    items: list[Item] = []
    for i, prompt in enumerate(prompts):
        sp = _per(body, "sampling_params", i, len(prompts), batched) or {}
        if not isinstance(sp, dict):
            raise InvalidArgument("sampling_params must be an object (or one per prompt)")
        sp = dict(sp)
        n = sp.pop("n", 1)
        bad = set(sp) - SAMPLING_KEYS
        if bad:
            raise InvalidArgument(f"unknown sampling_params key(s): {sorted(bad)}")
        r = rid[i] if batched and isinstance(rid, list) else rid
        if batched and isinstance(rid, list) and len(rid) != len(prompts):
            raise InvalidArgument(f"rid has {len(rid)} entries for {len(prompts)} prompts")
        if r is not None and not isinstance(r, str):
            raise InvalidArgument("rid must be a string (or one per prompt)")
        routed = _flag(_per(body, "return_routed_experts", i, len(prompts), batched),
                       "return_routed_experts")
        try:
            req = RolloutRequest(
                prompt=prompt if text is not None else None,
                input_ids=prompt if text is None else None, n=n, sampling_params=sp,
                group_id=body.get("group_id"), session_id=body.get("session_id"),
                request_id=r, metadata=body.get("metadata") or {},
                return_routed_experts=True if routed else None)
        except ValidationError as exc:
            raise InvalidArgument("invalid /generate request: "
                                  + validation_text(exc.errors())) from None
        lp = _flag(_per(body, "return_logprob", i, len(prompts), batched), "return_logprob")
        top = _int(_per(body, "top_logprobs_num", i, len(prompts), batched), "top_logprobs_num", 0)
        start = _int(_per(body, "logprob_start_len", i, len(prompts), batched),
                     "logprob_start_len", -1)
        rs = _int(body.get("routed_experts_start_len"), "routed_experts_start_len", 0)
        if not 0 <= top <= max_top:
            raise InvalidArgument(f"top_logprobs_num must be in [0, {max_top}], got {top}")
        if start < -1 or rs < 0:
            raise InvalidArgument("logprob_start_len must be >= -1 and "
                                  "routed_experts_start_len >= 0")
        if req.input_ids is not None and (start > len(req.input_ids) or rs > len(req.input_ids)):
            raise InvalidArgument(f"logprob_start_len / routed_experts_start_len must be at "
                                  f"most the prompt length {len(req.input_ids)}")
        pt = PassThrough()  # at least meta_info.cached_tokens comes from the engine
        if lp and (top > 0 or start >= 0 or text_in):
            pt = PassThrough(top_logprobs_num=top, logprob_start_len=start,
                             return_text_in_logprobs=text_in)
        if routed and rs == 0:  # the engine's routed_experts text is the answer's
            pt.routed_experts = True
        opts = GenerateOptions(
            return_logprob=lp, top=top, routed=routed, routed_start=rs,
            stream=stream, rid=r, n=req.n, entropy=entropy or lp, text_in_logprobs=text_in)
        items.append(Item(req, opts, pt))
    return items


def to_rollout_request(body: Any) -> tuple[RolloutRequest, GenerateOptions]:
    """One-prompt form of :func:`parse_generate` (the request and its output options)."""
    items = parse_generate(body)
    if len(items) != 1:
        raise InvalidArgument("expected one prompt")
    return items[0].req, items[0].opts


def _f(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _rows(rows: list, with_text: bool) -> list:
    return rows if with_text else [None if r is None else [r[0], r[1], None] for r in rows]


def _top_rows(rows: LogprobRows | list, with_text: bool) -> LogprobRows | list:
    if with_text or isinstance(rows, LogprobRows):  # columns hold no texts
        return rows
    return [None if r is None else [[e[0], e[1], None] for e in r] for r in rows]


def sglang_output(t: Trajectory, text: str, opts: GenerateOptions, index: int,
                  passed: dict[str, Any] | None = None) -> dict[str, Any]:
    c = t.tokens
    with_text = opts.text_in_logprobs
    spans = [{"version": str(s.policy_version), "start": s.start, "end": s.end} for s in t.segments]
    meta: dict[str, Any] = {
        "id": opts.rid if opts.rid is not None and opts.n == 1 else t.trajectory_id,
        "finish_reason": t.finish_reason.to_dict(),
        "prompt_tokens": int(t.prompt_token_ids.shape[0]), "completion_tokens": t.num_tokens,
        # the engine's (summed over the sample's engine requests; 0 for a stored replay)
        "cached_tokens": int((passed or {}).get("cached_tokens", 0)),
        "weight_version": str(int(c.policy_version[-1])) if t.num_tokens else None,
        "weight_versions": spans,
        "trajectory_id": t.trajectory_id, "policy_versions": c.policy_version,
        "kv_versions": c.kv_version, "entropy_kind": t.entropy_kind.value,
        "entropy_error_bound": _f(float(t.entropy_error_bound)),
        "segments": [segment_to_json(s) for s in t.segments],
        "num_retractions": sum(1 for s in t.segments if s.began is Transition.RETRACT),
        "spanning_versions": t.min_version != t.max_version,
    }
    passed = passed or {}
    if opts.return_logprob:
        if "output_token_logprobs" in passed:  # the engine's rows, token texts included
            meta["output_token_logprobs"] = _rows(passed["output_token_logprobs"], with_text)
        else:  # written from the columns (float32 logprobs as the doubles SGLang writes)
            meta["output_token_logprobs"] = LogprobRows(c.logprobs.astype(np.float64),
                                                        c.token_ids)
        for key in ("input_token_logprobs",):
            if key in passed:
                meta[key] = _rows(passed[key], with_text)
        for key in ("output_top_logprobs", "input_top_logprobs"):
            if key in passed:
                meta[key] = _top_rows(passed[key], with_text)
    if opts.entropy:
        meta["output_token_entropy"] = c.entropy
    if opts.routed:
        if t.routed_experts is None:  # the runner refuses this earlier; never silently absent
            raise EngineError(f"trajectory {t.trajectory_id}: routed experts were requested "
                               f"but none were recorded")
        # a pre-serialized JSON string (base64 needs no escaping): orjson copies the bytes
        # as they are, instead of a bytes->str decode plus a re-scan of the multi-MB string;
        # the engine's own (validated) text when the answer is one engine request's
        b64 = passed.get("routed_experts")
        if b64 is None or opts.routed_start:
            b64 = b64encode(np.ascontiguousarray(
                t.routed_experts.data[opts.routed_start:], dtype="<i4"))
        meta["routed_experts"] = RawString(b64)
    out: dict[str, Any] = {"text": text, "output_ids": c.token_ids, "meta_info": meta}
    if t.sample_index or opts.n > 1:
        out["index"] = index
    return out


@router.post("/generate", dependencies=[Depends(require_client)],
             openapi_extra=generate_openapi_body())
async def generate(request: Request, rollouts: Rollouts, pool: Pool) -> Response:
    import orjson

    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as exc:
        raise InvalidArgument(f"body is not valid JSON: {exc}") from None
    items = parse_generate(body)
    apply_body_policy(body.get("version_policy"))
    tenant = caller(request).owner
    as_list = len(items) > 1 or items[0].req.n > 1
    if items[0].opts.stream:
        await rollouts.check_policy()  # none qualifying: a 503 before the stream begins
        return await sse(_stream(rollouts, pool, items, await _open(rollouts, items, tenant,
                                                              keep_pending(request))))
    results = await asyncio.gather(*(rollouts.run_with_text(it.req, it.passthrough,
                                                            tenant=tenant)
                                     for it in items))
    outs = []
    for it, res in zip(items, results):
        got = it.passthrough.out if it.passthrough is not None else {}
        outs += [sglang_output(t, text, it.opts, len(outs), got.get(j))
                 for j, (t, text) in enumerate(res)]
    if as_list:
        for k, o in enumerate(outs):
            o["index"] = k
    return ORJSONResponse(outs if as_list else outs[0],
                          headers=versions_header(t for res in results for t, _ in res))


async def _open(rollouts: RolloutService, items: list[Item], tenant: str,
                free: Callable[[], None]) -> list[AsyncIterator[dict[str, Any]]]:
    """Start every item's samples now (admission errors raise here); ``free`` is called
    once all of them have ended, whether or not the client stays to read them."""
    left = [len(items)]

    def one_done() -> None:
        left[0] -= 1
        if left[0] == 0:
            free()

    streams: list[AsyncIterator[dict[str, Any]]] = []
    try:
        for it in items:
            streams.append(await rollouts.open_stream(it.req, it.passthrough, tenant=tenant,
                                                      on_done=one_done))
    except BaseException:
        for _ in range(len(items) - len(streams)):
            one_done()
        raise
    return streams


async def _stream(rollouts: RolloutService, pool: EnginePool, items: list[Item],
                  streams: list[AsyncIterator[dict[str, Any]]]
                  ) -> AsyncIterator[dict[str, Any]]:
    """SGLang-style stream: each chunk carries the sample's whole output so far
    (``finish_reason`` null, ``text`` filled in the final chunk), stamps included; the final
    chunk per sample is the complete answer. When every engine streams incrementally, so
    does this: per-token lists are deltas (their concatenation is the whole answer). Elements of a batch / n > 1 carry ``index``
    (prompt-major). Then ``[DONE]``."""
    as_list = len(items) > 1 or items[0].req.n > 1
    # SGLang's engines stream deltas with --incremental-streaming-output: so does the
    # gateway when every engine does (a drop-in answers as the server it replaces)
    engines = pool.list()
    incremental = bool(engines) and all(e.client.info.incremental_stream for e in engines)
    sent: dict[int, int] = {}
    base = [0]
    for it in items[:-1]:
        base.append(base[-1] + it.req.n)
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k: int) -> None:
        try:
            async for ev in streams[k]:
                await queue.put((k, ev))
        finally:
            await queue.put((k, None))

    tasks = [asyncio.create_task(pump(k)) for k in range(len(items))]
    open_ = len(items)
    sofar: dict[int, dict[str, list]] = {}
    try:
        while open_:
            k, ev = await queue.get()
            if ev is None:
                open_ -= 1
                continue
            it = items[k]
            i = base[k] + ev["sample_index"]
            if ev["type"] == "chunk":
                acc = sofar.setdefault(i, {key: [] for key in ("ids", "lp", "ent", "pv", "kv",
                                                               "top")})
                acc["ids"].append(ev["token_ids"])
                acc["lp"].append(ev["logprobs"])
                acc["ent"].append(ev.get("entropy"))
                acc["pv"].append(ev["policy_version"])
                acc["kv"].append(ev["kv_version"])
                acc["top"].append(ev.get("top_logprobs"))
                out = _partial(acc, it.opts, ev["trajectory_id"], i, as_list)
                if incremental:
                    out = _delta(out, sent.get(i, 0))
                    sent[i] = sent.get(i, 0) + len(out["output_ids"])
                yield out
            elif ev["type"] == "trajectory":
                sofar.pop(i, None)
                got = it.passthrough.out if it.passthrough is not None else {}
                out = sglang_output(ev["trajectory"], ev["text"], it.opts, i,
                                    got.get(ev["sample_index"]))
                if as_list:
                    out["index"] = i
                if incremental:  # text was not sent before: the last delta carries all
                    out = _delta(out, sent.pop(i, 0), keep_text=True)
                yield out
            elif ev["type"] == "error":
                yield {"error": ev["error"], "index": i}
    finally:
        for t in tasks:
            t.cancel()


#: meta_info lists with one entry per output token (cut to deltas in incremental streams)
_PER_TOKEN_META = ("output_token_logprobs", "output_top_logprobs", "output_token_entropy",
                   "policy_versions", "kv_versions")


def _delta(out: dict[str, Any], since: int, keep_text: bool = False) -> dict[str, Any]:
    """The incremental form of a cumulative chunk: per-token lists from ``since`` on
    (``completion_tokens`` stays the running total, as in SGLang)."""
    meta = dict(out["meta_info"])
    for key in _PER_TOKEN_META:
        if meta.get(key) is not None:
            meta[key] = meta[key][since:]
    d = dict(out, output_ids=out["output_ids"][since:], meta_info=meta)
    if not keep_text:
        d["text"] = ""
    return d


def _partial(acc: dict[str, list], opts: GenerateOptions, tid: str, index: int,
             as_list: bool) -> dict[str, Any]:
    ids = np.concatenate(acc["ids"])
    pv = np.concatenate(acc["pv"])
    meta: dict[str, Any] = {"id": opts.rid if opts.rid is not None and opts.n == 1
                            else tid, "finish_reason": None,
                            "completion_tokens": int(ids.shape[0]),
                            "weight_version": str(int(pv[-1])), "trajectory_id": tid,
                            "policy_versions": pv, "kv_versions": np.concatenate(acc["kv"])}
    if opts.return_logprob and all(x is not None for x in acc["lp"]):
        meta["output_token_logprobs"] = LogprobRows(
            np.concatenate(acc["lp"]).astype(np.float64), ids)
        if opts.top > 0 and all(x is not None for x in acc["top"]):
            rows = LogprobRows.concat([cut_top(x, opts.top) for x in acc["top"]])
            meta["output_top_logprobs"] = _top_rows(rows, opts.text_in_logprobs)
    # as the final chunk has it: an incremental stream's final delta holds only the tokens
    # no chunk before it carried, so each chunk carries its own tokens' entropies
    if opts.entropy and all(x is not None for x in acc["ent"]):
        meta["output_token_entropy"] = np.concatenate(acc["ent"])
    out: dict[str, Any] = {"text": "", "output_ids": ids, "meta_info": meta}
    if as_list:
        out["index"] = index
    return out
