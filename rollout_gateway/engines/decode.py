"""Decode SGLang ``/generate`` response bytes into columnar numpy: the gateway's hot path.

One call per response body (a dict, or a list for batches and n > 1) or per SSE ``data:``
payload (see :mod:`rollout_gateway.engines.decode_stream`). Per-token data never becomes
per-token Python objects beyond what the JSON parser itself creates: routed experts are
cut out of the raw bytes before parsing and decoded straight from them, in one pass that
also finds the string's end (:mod:`~rollout_gateway.engines.decode_experts`); top-k
logprobs in SGLang's canonical layout are cut out too and parsed as one flat array
(:mod:`~rollout_gateway.engines.decode_toplogprobs`); the other logprob columns are pulled
from the parsed lists with C-level iterators. Every fast path gives bit-identical results
to plain ``orjson`` parsing (tests/unit/test_decode_fastpath.py).

Field shapes follow SGLang 0.5.23 ``tokenizer_manager``: ``output_token_logprobs`` is
``[[logprob, token_id, text|null], ...]`` (orjson writes -inf as null),
``output_top_logprobs`` a list per position of k such triples, ``weight_versions``
``[{"version": str, "start": int, "end": int}]`` output-index spans (0.5.21+),
``routed_experts`` base64 LE int32 of shape
``(prompt_tokens + completion_tokens - 1 - routed_experts_start_len, layers, top_k)``.
``output_token_entropy`` (float per output token) is our reference engine's extension.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter
from typing import Any

import numpy as np
import orjson

from rollout_gateway import native
from rollout_gateway.core.trajectory import EntropyKind, RoutedExperts
from rollout_gateway.engines.decode_entropy import (
    DEFAULT_VOCAB_UPPER,
    check_top_logprobs,
    topk_entropy,
)
from rollout_gateway.engines.decode_experts import (
    decode_routed_experts_quoted,
    decode_routed_experts_str,
)
from rollout_gateway.engines.decode_toplogprobs import LogprobRows, placeholder_index, splice_top
from rollout_gateway.errors import EngineError, InvalidArgument

_KEY = b'"routed_experts"'
_PLACEHOLDER = "#re:"  # '#' is not base64, so a placeholder never collides with a payload
#: meta_info keys holding per-token columns (decoded, then left out of ``Decoded.meta``)
_COLUMN_KEYS = frozenset({
    "output_token_logprobs", "output_top_logprobs", "output_token_entropy", "routed_experts",
    "input_token_logprobs", "input_top_logprobs", "weight_versions", "output_token_ids_logprobs",
    "input_token_ids_logprobs", "finish_reason", "hidden_states",
})
_lp = itemgetter(0)
_id = itemgetter(1)
_I32_MAX = int(np.iinfo(np.int32).max)


@dataclass(frozen=True, slots=True)
class RoutingSpec:
    """The engine's MoE routing shape, for validating and narrowing ``routed_experts``."""

    num_layers: int
    top_k: int
    num_experts: int


@dataclass(frozen=True, slots=True)
class DecodeOptions:
    """What the caller asked the engine for (needed to validate what came back)."""

    routing: RoutingSpec | None = None
    routed_experts_start_len: int = 0
    #: routing was asked for: a finished (not aborted) output without it is an engine error
    require_routing: bool = False
    #: meta_info lists kept verbatim in ``Decoded.extra`` for a caller that asked for them
    #: (``/generate`` pass-through: output_top_logprobs, input_token_logprobs, ...)
    passthrough: frozenset[str] = frozenset()
    vocab_size: int = DEFAULT_VOCAB_UPPER  # an upper bound keeps the entropy bound valid
    check_logprob_ids: bool = True
    #: a top-k entropy estimate is left for :meth:`StreamDecoder.result` to compute once
    #: over the whole output (the rows are checked here, so a bad chunk still fails where
    #: it arrives): a stream whose deltas nobody reads one by one pays the ~25 numpy calls
    #: of the estimate once, not per chunk. Same bits (the estimate is row by row).
    defer_entropy: bool = False


@dataclass(slots=True)
class Decoded:
    """One /generate output (or one streamed delta), columnar."""

    output_ids: np.ndarray  # int32 [T]
    logprobs: np.ndarray | None  # float32 [T]; None when logprobs were not returned
    entropy: np.ndarray  # float32 [T]; NaN when entropy_kind is NONE
    entropy_kind: EntropyKind
    entropy_error: np.ndarray | None  # float32 [T] per-token bound (topk_estimate only)
    entropy_error_bound: float  # max over tokens; 0.0 for exact, inf for none
    weight_version: int | None  # meta_info.weight_version as int (None if absent/non-int)
    weight_version_raw: str | None
    spans: list[tuple[int, int, int]]  # (version, start, end) output-index spans; [] if none
    finish_reason: dict[str, Any] | None  # raw SGLang dict; None while running
    prompt_tokens: int | None
    completion_tokens: int
    cached_tokens: int | None
    rid: str | None
    index: int | None  # top-level "index" (n > 1 streaming)
    text: str | None
    input_token_ids: np.ndarray | None  # int32, from input_token_logprobs when returned
    routed_experts: np.ndarray | None  # flat ids: uint8 if num_experts <= 256 else int32
    routed: RoutedExperts | None  # validated [R, L, K] when DecodeOptions.routing is set
    #: the engine's routed_experts base64 text (a view of the response body) the ids were
    #: decoded from: an answer in SGLang's own form can forward it instead of re-encoding
    routed_b64: memoryview | None = None
    meta: dict[str, Any] = field(default_factory=dict)  # the rest of meta_info
    extra: dict[str, Any] = field(default_factory=dict)  # DecodeOptions.passthrough values
    offset: int = 0  # index of output_ids[0] in the whole output (streaming deltas)
    #: DecodeOptions.defer_entropy: the checked top-k logprob rows (float64 [T, k], -inf
    #: for nulls) whose estimate is still to come; ``entropy`` is NaN until then
    entropy_rows: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.output_ids.shape[0])

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


Region = tuple[np.ndarray | EngineError, memoryview]  # decoded ids (or error), base64 text


def _splice(body: bytes, num_experts: int | None) -> tuple[bytes, list[Region]]:
    """Cut every routed_experts base64 value out of the raw JSON, leaving placeholders.

    The key with an unescaped quote cannot occur inside a JSON string, so a match is a
    real key. Each value is decoded while its closing quote is searched for (one pass over
    the text); a decoding error is kept, to be raised only if that value is used. Returns
    the smaller JSON and, per placeholder number, the ids or the error, and the text.
    """
    pos = body.find(_KEY)
    if pos < 0:
        return body, []
    parts: list[bytes] = []
    decoded: list[Region] = []
    last = 0
    n = len(body)
    while pos >= 0:
        i = pos + len(_KEY)
        while i < n and body[i] in b" \t\r\n":
            i += 1
        if i < n and body[i] == 0x3A:  # ':'
            i += 1
            while i < n and body[i] in b" \t\r\n":
                i += 1
            if i < n and body[i] == 0x22:  # '"'
                ids, end = decode_routed_experts_quoted(body, i + 1, num_experts=num_experts)
                parts.append(body[last:i])
                parts.append(f'"{_PLACEHOLDER}{len(decoded)}"'.encode())
                decoded.append((ids, memoryview(body)[i + 1:end]))
                last = end + 1
                pos = body.find(_KEY, last)
                continue
        pos = body.find(_KEY, i)
    parts.append(body[last:])
    return b"".join(parts), decoded


def _loads(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise EngineError(f"engine returned invalid JSON: {exc}; starts with "
                          f"{bytes(data[:120]).decode('utf-8', 'replace')!r}") from exc


#: below this many bytes (~20 tokens with top-5) parsing the lists is as fast as cutting
CUT_MIN_BYTES = 4096


@dataclass(frozen=True, slots=True)
class _Cut:
    """Columns the native data plane cut out of one answer object before parsing it: each
    value was replaced by a string only this call knows (``mark``)."""

    mark: str
    output_ids: np.ndarray | None  # int32
    token_rows: LogprobRows | None  # output_token_logprobs (1-D rows, texts all null)
    #: output_top_logprobs when splice_top left it (below MIN_BYTES; ``raw``: its JSON)
    top_rows: LogprobRows | None


def _cut_columns(body: bytes) -> tuple[bytes, _Cut | None]:
    """Native data plane: the answer's ``output_ids``, ``meta_info.output_token_logprobs``
    and ``meta_info.output_top_logprobs`` (found by the JSON structure, canonical only) as
    columns, their places in the body taken by marks; the Python data plane parses them as
    lists (same results)."""
    if native.impl is None or len(body) < CUT_MIN_BYTES:
        return body, None
    got = native.impl.cut_columns(body)
    if got is None:
        return body, None
    ids, rows, top = got
    mark = f"#col:{os.urandom(8).hex()}"
    cuts = sorted((span[0], span[1], b'"%b%b"' % (mark.encode(), tag))
                  for span, tag in ((ids, b"i"), (rows, b"r"), (top, b"t")) if span is not None)
    parts: list[bytes] = []
    last = 0
    for a, b, text in cuts:
        parts += [body[last:a], text]
        last = b
    parts.append(body[last:])
    out_ids = np.frombuffer(ids[2], np.int32) if ids is not None else None
    token_rows = (LogprobRows(np.frombuffer(rows[2], np.float64), np.frombuffer(rows[3], np.int64))
                  if rows is not None else None)
    top_rows = (LogprobRows(np.frombuffer(top[2], np.float64).reshape(top[4], top[5]),
                            np.frombuffer(top[3], np.int64).reshape(top[4], top[5]),
                            body[top[0]:top[1]])
                if top is not None else None)
    return b"".join(parts), _Cut(mark, out_ids, token_rows, top_rows)


def decode_generate(body: bytes, opts: DecodeOptions | None = None) -> list[Decoded]:
    """Decode a /generate response body (or one SSE data payload) into Decoded outputs.

    A dict gives one output, a list one per element. Raises EngineError on anything
    malformed, including an SGLang error object (``{"error": ...}``).
    """
    opts = opts or DecodeOptions()
    routed, regions = _splice(body, opts.routing.num_experts if opts.routing else None)
    # rows forwarded to the caller travel as columns whatever their size
    spliced, tops = splice_top(routed, 0 if "output_top_logprobs" in opts.passthrough
                               else None)
    cut_body, cut = _cut_columns(spliced)
    try:
        obj = orjson.loads(cut_body)
    except orjson.JSONDecodeError:
        # the error (or, should a native cut ever be the cause, the value) of the body the
        # Python data plane parses: the same message, positions included
        obj, cut = _loads(spliced), None
    items = obj if isinstance(obj, list) else [obj]
    return [decode_output(item, opts, regions=regions, tops=tops, cut=cut) for item in items]


def decode_one(body: bytes, opts: DecodeOptions | None = None) -> Decoded:
    """decode_generate for a body that must hold exactly one output."""
    out = decode_generate(body, opts)
    if len(out) != 1:
        raise EngineError(f"expected one output from the engine, got {len(out)}")
    return out[0]


def decode_output(item: Any, opts: DecodeOptions, *,
                  regions: list[Region] | None = None,
                  tops: list[LogprobRows] | None = None, cut: _Cut | None = None) -> Decoded:
    """Decode one parsed output dict (``routed_experts`` and ``output_top_logprobs`` may
    be splice placeholders, resolved through ``regions`` / ``tops``; ``output_ids`` and
    ``output_token_logprobs`` marks of the native data plane through ``cut``)."""
    if not isinstance(item, dict):
        raise EngineError(f"engine output is a {type(item).__name__}, not an object")
    if "error" in item:
        raise EngineError(f"engine returned an error: {_short(item['error'])}")
    meta = item.get("meta_info")
    if not isinstance(meta, dict):
        raise EngineError("engine output has no meta_info object")
    out_ids = item.get("output_ids")
    lp_rows = meta.get("output_token_logprobs")
    if cut is not None:
        if cut.output_ids is not None and out_ids == cut.mark + "i":
            out_ids = cut.output_ids
        if cut.token_rows is not None and lp_rows == cut.mark + "r":
            lp_rows = cut.token_rows
    if out_ids is None and isinstance(lp_rows, (list, LogprobRows)):  # older engines
        output_ids = _ids_from_rows(lp_rows, "output_token_logprobs")
    elif isinstance(out_ids, np.ndarray):  # cut by the native data plane, validated
        output_ids = out_ids
    else:
        output_ids = _int_array(out_ids, "output_ids")
    t = output_ids.shape[0]

    logprobs = None
    if lp_rows is not None:
        logprobs = _logprob_column(lp_rows, t, output_ids if opts.check_logprob_ids else None)

    top_cut = cut.top_rows if cut is not None and cut.top_rows is not None \
        and meta.get("output_top_logprobs") == cut.mark + "t" else None
    entropy, kind, err, err_max, pending = _entropy(meta, t, opts, tops or [], top_cut)
    wv_raw = meta.get("weight_version")
    wv_raw = None if wv_raw is None else str(wv_raw)
    completion = _opt_int(meta, "completion_tokens")
    prompt = _opt_int(meta, "prompt_tokens")
    flat, b64 = _routed(meta.get("routed_experts"), regions or [], opts)
    if flat is None and opts.require_routing and meta.get("finish_reason") is not None \
            and _finish(meta).get("type") != "abort":
        raise EngineError("the engine finished without routed_experts although they were "
                          "requested (SGLang omits them silently when started without "
                          "--enable-return-routed-experts)")
    routed = None
    if flat is not None and opts.routing is not None:
        routed = _shape_routed(flat, opts, prompt, completion)
    input_ids = None
    in_rows = meta.get("input_token_logprobs")
    if in_rows:
        input_ids = _ids_from_rows(in_rows, "input_token_logprobs")
    text = item.get("text")
    index = item.get("index")
    return Decoded(
        output_ids=output_ids, logprobs=logprobs, entropy=entropy, entropy_kind=kind,
        entropy_error=err, entropy_error_bound=err_max,
        weight_version=_as_int(wv_raw), weight_version_raw=wv_raw,
        spans=_spans(meta.get("weight_versions")), finish_reason=_finish(meta),
        prompt_tokens=prompt, completion_tokens=completion if completion is not None else t,
        cached_tokens=_opt_int(meta, "cached_tokens"),
        rid=None if meta.get("id") is None else str(meta.get("id")),
        index=index if isinstance(index, int) else None,
        text=text if isinstance(text, str) else None, input_token_ids=input_ids,
        routed_experts=flat, routed=routed, routed_b64=b64,
        meta={k: v for k, v in meta.items() if k not in _COLUMN_KEYS},
        extra=_passthrough(meta, opts, tops or [], lp_rows, top_cut), entropy_rows=pending,
    )


def _passthrough(meta: dict, opts: DecodeOptions, tops: list[LogprobRows],
                 token_rows: Any = None, top_cut: LogprobRows | None = None
                 ) -> dict[str, Any]:
    """The forwarded meta_info values (spliced top-k rows as their columns; rows the
    native data plane cut as the lists the engine sent)."""
    out = {k: meta[k] for k in opts.passthrough if meta.get(k) is not None}
    if isinstance(token_rows, LogprobRows) and "output_token_logprobs" in out:
        out["output_token_logprobs"] = token_rows.to_rows()
    if top_cut is not None and "output_top_logprobs" in out:
        out["output_top_logprobs"] = orjson.loads(top_cut.raw)
    top = out.get("output_top_logprobs")
    if top is not None:
        idx = placeholder_index(top, len(tops))
        if idx is not None:
            out["output_top_logprobs"] = tops[idx]
    return out


def _short(obj: Any) -> str:
    s = obj if isinstance(obj, str) else orjson.dumps(obj).decode("utf-8", "replace")
    return s[:300]


def _int_array(values: Any, name: str) -> np.ndarray:
    if not isinstance(values, list):
        raise EngineError(f"engine output {name} is missing or not a list")
    try:
        arr = np.fromiter(values, dtype=np.int64, count=len(values))
    except (TypeError, ValueError, OverflowError) as exc:
        raise EngineError(f"engine output {name} holds non-integers") from exc
    if arr.size and (arr.min() < 0 or arr.max() > _I32_MAX):
        raise EngineError(f"engine output {name} has token ids outside int32")
    return arr.astype(np.int32)


def _logprob_column(rows: Any, t: int, ids: np.ndarray | None) -> np.ndarray:
    if not isinstance(rows, (list, LogprobRows)) or len(rows) != t:
        n = len(rows) if isinstance(rows, (list, LogprobRows)) else type(rows).__name__
        raise EngineError(f"output_token_logprobs has {n} entries for {t} output tokens")
    if isinstance(rows, LogprobRows):  # cut by the native data plane (null -> NaN)
        col = rows.logprobs.copy()
    else:
        try:
            col = np.fromiter(map(_lp, rows), dtype=np.float64, count=t)
        except (TypeError, IndexError, KeyError, ValueError) as exc:
            raise EngineError("output_token_logprobs rows are not [logprob, id, text]"
                              ) from exc
    _null_to_neg_inf(col)
    if (col > 1e-4).any():
        raise EngineError("output_token_logprobs has positive logprobs")
    if ids is not None:
        got = _ids_from_rows(rows, "output_token_logprobs")
        if got.shape != ids.shape or not (got == ids).all():
            bad = int(np.flatnonzero(got != ids)[0])
            raise EngineError(f"output_token_logprobs token id {int(got[bad])} at {bad} does "
                              f"not match output_ids {int(ids[bad])}")
    return col.astype(np.float32)


def _ids_from_rows(rows: list | LogprobRows, name: str) -> np.ndarray:
    if isinstance(rows, LogprobRows):
        return rows.ids.astype(np.int32)
    try:
        return np.fromiter(map(_id, rows), dtype=np.int64, count=len(rows)).astype(np.int32)
    except (TypeError, IndexError, KeyError, ValueError, OverflowError) as exc:
        raise EngineError(f"{name} rows are not [logprob, id, text]") from exc


def _entropy(meta: dict, t: int, opts: DecodeOptions, tops: list[LogprobRows],
             top_cut: LogprobRows | None = None
             ) -> tuple[np.ndarray, EntropyKind, np.ndarray | None, float, np.ndarray | None]:
    """(entropy, kind, per-token error bound, max bound, rows whose estimate is deferred)."""
    exact = meta.get("output_token_entropy")
    if exact is not None:
        if not isinstance(exact, list) or len(exact) != t:
            raise EngineError(f"output_token_entropy must be a list of {t} floats")
        try:
            col = np.array(exact, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise EngineError("output_token_entropy holds non-numbers") from exc
        if col.ndim != 1 or np.isnan(col).any() or (col < -1e-4).any():
            raise EngineError("output_token_entropy has NaN or negative values")
        return col, EntropyKind.EXACT, None, 0.0, None
    top = meta.get("output_top_logprobs")
    if top and t:
        idx = placeholder_index(top, len(tops))
        if top_cut is not None:  # cut by the native data plane (nulls are NaN)
            if len(top_cut) != t:
                raise EngineError(f"output_top_logprobs must have {t} rows")
            mat = _null_to_neg_inf(top_cut.logprobs)
        elif idx is None:
            mat = _top_matrix(top, t)
        elif len(tops[idx]) != t:
            raise EngineError(f"output_top_logprobs must have {t} rows")
        else:  # already parsed from the raw bytes (decode_toplogprobs); nulls are NaN
            mat = _null_to_neg_inf(tops[idx].logprobs)
        if opts.defer_entropy:
            check_top_logprobs(mat, opts.vocab_size)
            return np.full(t, np.nan, np.float32), EntropyKind.TOPK_ESTIMATE, None, 0.0, mat
        est, err = topk_entropy(mat, opts.vocab_size)
        return est, EntropyKind.TOPK_ESTIMATE, err, float(err.max()), None
    return np.full(t, np.nan, np.float32), EntropyKind.NONE, None, float("inf"), None


def _top_matrix(top: Any, t: int) -> np.ndarray:
    if not isinstance(top, list) or len(top) != t:
        raise EngineError(f"output_top_logprobs must have {t} rows")
    try:  # a null or non-list row fails in len() / iteration and lands in the except
        k = len(top[0])
        if k and sum(map(len, top)) == t * k:
            flat = np.fromiter(map(_lp, chain.from_iterable(top)), dtype=np.float64,
                               count=t * k)
            return _null_to_neg_inf(flat).reshape(t, k)
        if not all(top):
            raise EngineError("output_top_logprobs has an empty row")
        k = max(map(len, top))  # ragged rows (vocab smaller than k): pad with -inf
        mat = np.full((t, k), -np.inf)
        for i, row in enumerate(top):
            mat[i, :len(row)] = np.fromiter(map(_lp, row), dtype=np.float64, count=len(row))
        return _null_to_neg_inf(mat)
    except (TypeError, ValueError, IndexError, KeyError) as exc:
        raise EngineError("output_top_logprobs rows are not [[logprob, id, text], ...]") from exc


def _null_to_neg_inf(arr: np.ndarray) -> np.ndarray:
    """JSON has no NaN: a NaN here was a null, which is how orjson writes -inf."""
    np.copyto(arr, -np.inf, where=np.isnan(arr))
    return arr


def _routed(value: Any, regions: list[Region], opts: DecodeOptions
            ) -> tuple[np.ndarray | None, memoryview | None]:
    if value is None:
        return None, None
    if not isinstance(value, str):
        raise EngineError("routed_experts must be a base64 string")
    n_exp = opts.routing.num_experts if opts.routing else None
    idx = value[len(_PLACEHOLDER):] if value.startswith(_PLACEHOLDER) else ""
    if idx.isdigit() and int(idx) < len(regions):  # else: not ours ('#' is not base64)
        got, text = regions[int(idx)]
        if isinstance(got, EngineError):
            raise got
        return got, text
    return decode_routed_experts_str(value, num_experts=n_exp), None


def _shape_routed(flat: np.ndarray, opts: DecodeOptions, prompt: int | None,
                  completion: int | None) -> RoutedExperts:
    spec = opts.routing
    assert spec is not None
    per_row = spec.num_layers * spec.top_k
    if flat.size % per_row:
        raise EngineError(f"routed_experts has {flat.size} ids, not a multiple of "
                          f"layers*top_k={per_row}")
    rows = flat.size // per_row
    if prompt is not None and completion is not None:
        want = prompt + completion - 1 - opts.routed_experts_start_len
        if rows != max(want, 0):
            raise EngineError(f"routed_experts has {rows} rows, expected prompt {prompt} + "
                              f"output {completion} - 1 - start {opts.routed_experts_start_len}"
                              f" = {want}")
    try:
        return RoutedExperts(data=flat.reshape(rows, spec.num_layers, spec.top_k),
                             num_experts=spec.num_experts, start=opts.routed_experts_start_len)
    except InvalidArgument as exc:
        raise EngineError(f"routed_experts: {exc.message}") from exc


def _spans(value: Any) -> list[tuple[int, int, int]]:
    if not value:
        return []
    if not isinstance(value, list):
        raise EngineError("weight_versions must be a list of spans")
    out: list[tuple[int, int, int]] = []
    prev_end = 0
    for s in value:
        try:
            v, a, b = _as_int(s["version"]), int(s["start"]), int(s["end"])
        except (TypeError, KeyError, ValueError) as exc:
            raise EngineError(f"weight_versions span {s!r} is malformed") from exc
        if v is None:
            return []  # non-integer versions (e.g. SGLang's "default"): no usable spans
        if a != prev_end or b < a:
            raise EngineError(f"weight_versions spans are not contiguous: {value!r}")
        out.append((v, a, b))
        prev_end = b
    return out


def _finish(meta: dict) -> dict[str, Any] | None:
    fr = meta.get("finish_reason")
    if fr is None:
        return None
    if isinstance(fr, str):  # some versions/paths send a bare type string
        return {"type": fr}
    if not isinstance(fr, dict) or "type" not in fr:
        raise EngineError(f"finish_reason is malformed: {_short(fr)}")
    return fr


def _opt_int(meta: dict, key: str) -> int | None:
    v = meta.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise EngineError(f"meta_info.{key} must be a non-negative integer, got {v!r}")
    return v


def _as_int(v: Any) -> int | None:
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    try:
        return int(str(v).strip())
    except ValueError:
        return None
