"""Incremental decoding of SGLang's streamed /generate (Server-Sent Events).

Chunks are ``data: {json}\\n\\n``, ending with ``data: [DONE]``; errors come as
``data: {"error": ...}``. Chunks are cumulative by default (each carries the whole output
so far) and deltas with ``--incremental-streaming-output`` (0.5.13+). Each chunk is
classified by its length against ``meta_info.completion_tokens`` (the running total in
both modes), so no server flag needs to be known. ``feed`` returns only the new tokens, so
stamping never sees a token twice. ``routed_experts`` arrives in the final chunk only and covers
the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from rollout_gateway.engines.decode import Decoded, DecodeOptions, decode_generate
from rollout_gateway.engines.decode_entropy import topk_entropy
from rollout_gateway.engines.decode_toplogprobs import LogprobRows
from rollout_gateway.engines.sse import SSEPayloads
from rollout_gateway.errors import EngineError

#: per-output-token lists kept verbatim (DecodeOptions.passthrough), cut like the columns
OUTPUT_ROW_KEYS = ("output_top_logprobs", "output_token_logprobs")


@dataclass(slots=True)
class _State:
    seen: int = 0  # output tokens already emitted
    finished: bool = False
    parts: list[Decoded] = field(default_factory=list)  # kept deltas (keep=True)
    text: str = ""  # output text so far (cumulative chunks replace it, deltas extend it)


class StreamDecoder:
    """Feed raw response bytes in any split; get back new-token deltas as Decoded."""

    def __init__(self, opts: DecodeOptions | None = None, *, keep: bool = False,
                 max_event_bytes: int = 1 << 30) -> None:
        """``keep=True`` also keeps every delta so :meth:`result` can merge them."""
        self.opts = opts or DecodeOptions()
        self.keep = keep
        self._sse = SSEPayloads(limit=max_event_bytes)
        self._states: dict[object, _State] = {}
        self.done = False  # saw data: [DONE]

    @property
    def finished(self) -> bool:
        """True when [DONE] arrived or every output seen so far has a finish_reason."""
        return self.done or (bool(self._states)
                             and all(s.finished for s in self._states.values()))

    def feed(self, data: bytes) -> list[Decoded]:
        """Add raw SSE bytes (any split); return the deltas of every event they complete."""
        return [d for p in self._sse.feed(data) for d in self._payload(p)]

    def close(self) -> list[Decoded]:
        """Flush a final event not followed by a blank line (a stream cut short)."""
        return [d for p in self._sse.close() for d in self._payload(p)]

    def feed_payload(self, data: bytes) -> list[Decoded]:
        """Like :meth:`feed` for one already-unframed SSE ``data:`` payload (a JSON
        object/list, ``[DONE]`` or an ``{"error": ...}`` object): no framing, no copy."""
        return self._payload(data.strip())

    def _payload(self, payload: bytes) -> list[Decoded]:
        if payload == b"[DONE]":
            self.done = True
            return []
        if self.done:
            raise EngineError("engine stream has data after [DONE]")
        return [self._delta(d) for d in decode_generate(payload, self.opts)]

    def _delta(self, d: Decoded) -> Decoded:
        key = d.index if d.index is not None else d.rid
        st = self._states.setdefault(key, _State())
        if st.finished:
            raise EngineError(f"engine stream sent output after output {key!r} finished")
        total = d.completion_tokens
        new = total - st.seen
        if new < 0:
            raise EngineError(f"engine stream went backwards: {total} tokens after {st.seen}")
        cumulative = d.output_ids.shape[0] == total != new
        if d.text is not None:
            st.text = d.text if cumulative or st.seen == 0 else st.text + d.text
        d.output_ids = _tail(d.output_ids, st.seen, new, total, "output_ids")
        if d.logprobs is not None:
            d.logprobs = _tail(d.logprobs, st.seen, new, total, "output_token_logprobs")
        d.entropy = _tail(d.entropy, st.seen, new, total, "entropy")
        if d.entropy_rows is not None:
            d.entropy_rows = _tail(d.entropy_rows, st.seen, new, total, "output_top_logprobs")
        for k in OUTPUT_ROW_KEYS:
            rows = d.extra.get(k)
            if rows is not None:  # forwarded: rows or LogprobRows, cut like the columns
                d.extra[k] = _tail(rows, st.seen, new, total, k)
        if d.entropy_error is not None:
            d.entropy_error = _tail(d.entropy_error, st.seen, new, total, "entropy")
            d.entropy_error_bound = float(d.entropy_error.max()) if new else 0.0
        d.offset = st.seen
        st.seen = total
        st.finished = d.finish_reason is not None
        if self.keep:
            st.parts.append(d)
        return d

    def result(self, key: object = None) -> Decoded | None:
        """Everything received for one output, merged into one Decoded (``keep=True``).

        ``key`` is the output's index (n > 1) or rid; None picks the only output. Works
        for a stream cut short too (then ``finish_reason`` is None). None if nothing came.
        """
        if not self.keep:
            raise ValueError("StreamDecoder(keep=True) is needed for result()")
        if key is None:
            if len(self._states) > 1:
                raise ValueError("several outputs in this stream: pass the key")
            key = next(iter(self._states), None)
        st = self._states.get(key)
        if st is None or not st.parts:
            return None
        out = replace(merge(st.parts), text=st.text)
        if out.entropy_rows is not None:  # DecodeOptions.defer_entropy: once, for all rows
            if out.num_tokens:
                out.entropy, out.entropy_error = topk_entropy(out.entropy_rows,
                                                              self.opts.vocab_size)
                out.entropy_error_bound = float(out.entropy_error.max())
            out.entropy_rows = None
        return out


def _tail(col, seen: int, new: int, total: int, name: str):
    n = len(col)
    if n == new:
        return col
    if n == total:
        return col[seen:]
    raise EngineError(f"engine stream chunk has {n} {name} entries; expected {new} new or "
                      f"{total} cumulative")


def merge(parts: list[Decoded]) -> Decoded:
    """Concatenate consecutive deltas of one output (per-token columns joined, the rest
    taken from the last delta, which carries finish_reason, spans and routed_experts;
    ``text`` is the last delta's: use :meth:`StreamDecoder.result` for the whole text)."""
    if not parts:
        raise ValueError("nothing to merge")
    last = parts[-1]
    if len(parts) == 1:
        return replace(last, offset=parts[0].offset)

    def cat(name: str) -> np.ndarray | None:
        cols = [getattr(p, name) for p in parts]
        if any(c is None for c in cols):
            return None
        return np.concatenate(cols)

    kinds = {p.entropy_kind for p in parts if p.num_tokens}
    if len(kinds) > 1:
        raise EngineError(f"engine stream mixed entropy kinds {sorted(k.value for k in kinds)}")
    err = cat("entropy_error")
    # deferred top-k estimates: the rows of every part that has tokens (an empty delta of
    # an incremental stream carries no top-k rows)
    pending = [p.entropy_rows for p in parts if p.num_tokens]
    rows = np.concatenate(pending) if pending and all(r is not None for r in pending) \
        else None
    bound = max(p.entropy_error_bound for p in parts if p.num_tokens) if kinds else \
        last.entropy_error_bound
    extra = dict(last.extra)
    for k in OUTPUT_ROW_KEYS:
        got = [p.extra[k] for p in parts if k in p.extra]
        if got:
            extra[k] = LogprobRows.concat(got)
    for k in ("input_token_logprobs", "input_top_logprobs"):  # sent with the first chunk
        first = next((p.extra[k] for p in parts if k in p.extra), None)
        if first is not None:
            extra[k] = first
    return replace(last, output_ids=cat("output_ids"), logprobs=cat("logprobs"), extra=extra,
                   entropy=cat("entropy"), entropy_error=err, entropy_error_bound=bound,
                   entropy_rows=rows,
                   entropy_kind=next(iter(kinds)) if kinds else last.entropy_kind,
                   offset=parts[0].offset)
