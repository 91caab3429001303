"""SGLang 0.5.23 ``/generate`` request parsing and response shapes (no torch).

Errors raise :class:`ProtocolError`; the server answers HTTP 400 with SGLang's bodies:
``{"error": "<serde text>"}`` for schema violations (unknown sampling key) and
``{"error": {"message": ...}}`` for value errors (empty input, bad ranges, duplicate rid).
"""

from __future__ import annotations

import base64
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from reference_engine.request import GenParams, Request
from reference_engine.scheduler_spans import weight_version_spans
from reference_engine.tokenizer import ByteTokenizer

#: sglang.api.v1.SamplingParams fields, in schema order (unknown keys are rejected).
SAMPLING_FIELDS: tuple[str, ...] = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)
#: Accepted by SGLang but not implemented here: refused unless left at their default.
UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "stop_regex": None, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "json_schema": None, "regex": None, "ebnf": None,
    "structural_tag": None, "logit_bias": {}, "custom_params": None, "beam_width": None,
    "watermark": None, "choice": [],
}
TOP_K_DISABLED = 1 << 30


class ProtocolError(ValueError):
    """A bad request. ``schema`` errors use SGLang's contract body (a bare string)."""

    def __init__(self, message: str, *, schema: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.schema = schema

    def body(self) -> dict[str, Any]:
        return {"error": self.message} if self.schema else {"error": {"message": self.message}}


def unknown_field(key: str) -> ProtocolError:
    listed = ", ".join(f"`{f}`" for f in SAMPLING_FIELDS)
    return ProtocolError(f"unknown field `{key}`, expected one of {listed}", schema=True)


@dataclass
class ParsedGenerate:
    items: list[tuple[str, list[int], GenParams]]
    is_list: bool  # respond with a list (batch input or n > 1)
    stream: bool


def _num(v: Any, name: str, *, integer: bool = False) -> Any:
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or (not integer and not math.isfinite(v)):
        raise ProtocolError(f"{name} must be {'an integer' if integer else 'a finite number'}, "
                            f"got {v!r}.")
    return v


def _pick(value: Any, i: int, n_items: int, name: str) -> Any:
    if isinstance(value, list):
        if len(value) != n_items:
            raise ProtocolError(f"{name} has {len(value)} entries for {n_items} inputs.")
        return value[i]
    return value


def parse_sampling(sp: Any, vocab_size: int) -> tuple[GenParams, int]:
    """Validate one sampling_params object -> (params, n)."""
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise ProtocolError("sampling_params must be a JSON object.")
    for k in sp:
        if k not in SAMPLING_FIELDS:
            raise unknown_field(k)
    for k, default in UNSUPPORTED_DEFAULTS.items():
        if sp.get(k) is not None and sp.get(k) != default:
            raise ProtocolError(f"sampling_params.{k} is not supported by the reference engine.")
    g = GenParams()
    if sp.get("max_new_tokens") is not None:
        g.max_new_tokens = _num(sp["max_new_tokens"], "max_new_tokens", integer=True)
        if g.max_new_tokens < 0:
            raise ProtocolError(f"max_new_tokens must be at least 0, got {g.max_new_tokens}.")
    if sp.get("temperature") is not None:
        g.temperature = float(_num(sp["temperature"], "temperature"))
        if g.temperature < 0:
            raise ProtocolError(
                f"temperature must be a non-negative finite number, got {g.temperature}.")
    if sp.get("top_p") is not None:
        g.top_p = float(_num(sp["top_p"], "top_p"))
        if not 0 < g.top_p <= 1:
            raise ProtocolError(f"top_p must be in (0, 1], got {g.top_p}.")
    if sp.get("top_k") is not None:
        k = _num(sp["top_k"], "top_k", integer=True)
        if k != -1 and k < 1:
            raise ProtocolError(f"top_k must be -1 (disable) or at least 1, got {k}.")
        g.top_k = -1 if k >= TOP_K_DISABLED else k
    if sp.get("min_p") is not None:
        g.min_p = float(_num(sp["min_p"], "min_p"))
        if not 0 <= g.min_p <= 1:
            raise ProtocolError(f"min_p must be in [0, 1], got {g.min_p}.")
    if sp.get("min_new_tokens") is not None:
        g.min_new_tokens = _num(sp["min_new_tokens"], "min_new_tokens", integer=True)
        if not 0 <= g.min_new_tokens <= g.max_new_tokens:
            raise ProtocolError(f"min_new_tokens must be in [0, max_new_tokens], got "
                                f"{g.min_new_tokens}.")
    stop = sp.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ProtocolError("stop must be a string or a list of strings.")
        g.stop = stop
    if sp.get("stop_token_ids") is not None:
        ids = sp["stop_token_ids"]
        if not isinstance(ids, list):
            raise ProtocolError("stop_token_ids must be a list of integers.")
        g.stop_token_ids = [_num(t, "stop_token_ids entry", integer=True) for t in ids]
    for flag in ("ignore_eos", "no_stop_trim", "skip_special_tokens"):
        if sp.get(flag) is not None:
            if not isinstance(sp[flag], bool):
                raise ProtocolError(f"{flag} must be a boolean.")
            setattr(g, flag, sp[flag])
    if sp.get("sampling_seed") is not None:
        g.sampling_seed = _num(sp["sampling_seed"], "sampling_seed", integer=True)
    if sp.get("stream_interval") is not None:
        g.stream_interval = _num(sp["stream_interval"], "stream_interval", integer=True)
    n = 1
    if sp.get("n") is not None:
        n = _num(sp["n"], "n", integer=True)
        if not 1 <= n <= 64:
            raise ProtocolError(f"n must be in [1, 64], got {n}.")
    return g, n


def parse_generate(body: Any, tok: ByteTokenizer, vocab_size: int, max_len: int) -> ParsedGenerate:
    if not isinstance(body, dict):
        raise ProtocolError("The request body must be a JSON object.")
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise ProtocolError("Either text or input_ids should be provided.")
    if text is not None:
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not all(isinstance(t, str) for t in texts):
            raise ProtocolError("text must be a string or a list of strings.")
        prompts = [tok.encode(t) for t in texts]
    else:
        is_batch = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        prompts = input_ids if is_batch else [input_ids]
        for p in prompts:
            if not isinstance(p, list) or any(isinstance(t, bool) or not isinstance(t, int)
                                              for t in p):
                raise ProtocolError("input_ids must be a list of integers or a list of lists.")
    if not prompts:
        raise ProtocolError("input_ids cannot be empty.")
    for p in prompts:
        if not p:
            raise ProtocolError("input_ids cannot be empty." if text is None else
                                "The input text cannot be empty.")
        bad = next((t for t in p if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ProtocolError(f"Input token id {bad} is out of vocabulary; valid range is "
                                f"[0, {vocab_size}).")
        if len(p) >= max_len:
            raise ProtocolError(f"The input ({len(p)} tokens) is longer than the model's context "
                                f"length ({max_len} tokens).")
    stream = bool(body.get("stream", False))
    rids = body.get("rid")
    items: list[tuple[str, list[int], GenParams]] = []
    any_n = False
    for i, prompt in enumerate(prompts):
        g, n = parse_sampling(_pick(body.get("sampling_params"), i, len(prompts),
                                    "sampling_params"), vocab_size)
        g.stream = stream
        g.return_logprob = bool(_pick(body.get("return_logprob", False), i, len(prompts),
                                      "return_logprob") or False)
        ls = _pick(body.get("logprob_start_len", -1), i, len(prompts), "logprob_start_len")
        g.logprob_start_len = -1 if ls is None else _num(ls, "logprob_start_len", integer=True)
        tn = _pick(body.get("top_logprobs_num", 0), i, len(prompts), "top_logprobs_num")
        g.top_logprobs_num = 0 if tn is None else _num(tn, "top_logprobs_num", integer=True)
        if g.top_logprobs_num < 0 or g.top_logprobs_num > vocab_size:
            raise ProtocolError(f"top_logprobs_num must be in [0, {vocab_size}].")
        g.return_text_in_logprobs = bool(body.get("return_text_in_logprobs", False))
        g.return_routed_experts = bool(body.get("return_routed_experts", False))
        rs = body.get("routed_experts_start_len", 0) or 0
        g.routed_experts_start_len = _num(rs, "routed_experts_start_len", integer=True)
        if g.routed_experts_start_len < 0:
            raise ProtocolError("routed_experts_start_len must be at least 0.")
        g.return_entropy = bool(body.get("return_entropy", False))
        if len(prompt) + g.max_new_tokens > max_len:
            g.max_new_tokens = max_len - len(prompt)
        rid = _pick(rids, i, len(prompts), "rid")
        if rid is not None and not isinstance(rid, str):
            raise ProtocolError("rid must be a string or a list of strings.")
        if n > 1:
            any_n = True
            items += [(uuid.uuid4().hex, list(prompt), _copy(g)) for _ in range(n)]
        else:
            items.append((rid or uuid.uuid4().hex, list(prompt), g))
    seen: set[str] = set()
    for rid, _, _ in items:
        if rid in seen:
            raise ProtocolError(f"Duplicate request ID detected: {rid}")
        seen.add(rid)
    return ParsedGenerate(items=items, is_list=is_batch or any_n, stream=stream)


def _copy(g: GenParams) -> GenParams:
    return GenParams(**{k: (list(v) if isinstance(v, list) else v) for k, v in vars(g).items()})


def _triples(vals: list, ids: list[int], tok: ByteTokenizer, with_text: bool) -> list[list]:
    return [[v, t, tok.token_text(t) if with_text else None] for v, t in zip(vals, ids)]


def _top(entries: list, tok: ByteTokenizer, with_text: bool) -> list:
    return [None if e is None else [[v, t, tok.token_text(t) if with_text else None] for v, t in e]
            for e in entries]


def format_output(req: Request, n_out: int, current_version: str, tok: ByteTokenizer, *,
                  since: int = 0, final: bool, incremental: bool = False,
                  with_spans: bool = True) -> dict[str, Any]:
    """One response object (or streaming chunk) for ``req`` with ``n_out`` output tokens.

    ``with_spans=False`` (SGLang before 0.5.21): no ``weight_versions``, and weight_version is
    the engine's current one.
    ``incremental``: output_ids, text and per-token lists are deltas from index ``since``
    (incremental streaming); text is cut at whole UTF-8 characters until the final chunk,
    so the concatenated deltas equal the final text."""
    p = req.params
    ids = req.output[:n_out]
    text = tok.decode(ids, skip_special_tokens=p.skip_special_tokens)
    if final and req.stop_trim:
        text = text[: len(text) - req.stop_trim]
    if incremental:
        skip = p.skip_special_tokens
        if not final:
            text = tok.decode(ids[:tok.complete_prefix_len(ids)], skip_special_tokens=skip)
        prev = ids[:since]
        text = text[len(tok.decode(prev[:tok.complete_prefix_len(prev)],
                                   skip_special_tokens=skip)):]
    finish = req.finish if final else None
    aborted_queued = final and finish is not None and finish.get("type") == "abort" and not req.admitted
    meta: dict[str, Any] = {"id": req.rid, "finish_reason": finish}
    if not aborted_queued:
        meta["prompt_tokens"] = len(req.prompt)
        meta["cached_tokens"] = req.cached_tokens
    meta.update(completion_tokens=n_out, weight_version=current_version,
                num_retractions=req.num_retractions,
                e2e_latency=((req.finished_at or time.monotonic()) - req.created))
    if p.return_logprob:
        meta["output_token_logprobs"] = _triples(req.out_logprobs[since:n_out], ids[since:], tok,
                                                 p.return_text_in_logprobs)
        if not since:
            inp = req.input_logprobs or []
            s = max(p.logprob_start_len, 0)
            meta["input_token_logprobs"] = _triples(inp, req.prompt[s:s + len(inp)], tok,
                                                    p.return_text_in_logprobs)
        if p.top_logprobs_num > 0:
            meta["output_top_logprobs"] = _top(req.out_top[since:n_out], tok,
                                               p.return_text_in_logprobs)
            if not since:
                meta["input_top_logprobs"] = _top(req.input_top or [], tok,
                                                  p.return_text_in_logprobs)
    if p.return_entropy:
        meta["output_token_entropy"] = req.out_entropy[since:n_out]
    if final and finish is not None:
        spans = req.final_spans or weight_version_spans(req.version_events, current_version, n_out)
        visible = [s for s in spans if s["start"] < n_out or s["start"] == 0]
        if with_spans:
            meta["weight_versions"] = [{**s, "end": min(s["end"], n_out)} for s in visible]
            meta["weight_version"] = visible[-1]["version"]
        if p.return_routed_experts and req.admitted:
            total = len(req.prompt) + n_out - 1
            rows = req.routed[p.routed_experts_start_len:max(total, p.routed_experts_start_len)]
            meta["routed_experts"] = base64.b64encode(
                np.ascontiguousarray(rows, dtype="<i4").tobytes()).decode("ascii")
    return {"text": text, "output_ids": ids[since:], "meta_info": meta}
