"""Fast path for ``output_top_logprobs``: cut it out of the raw body, parse it flat,
keep it as columns (:class:`LogprobRows`) and write it back as JSON from the columns.

Parsed as JSON, top-k logprobs cost ``T * (k + 1)`` Python lists plus ``3 T k`` scalars
(and as much again to free them): most of the gateway's time when it asks for top-k. Here
the value is cut out of the raw bytes before ``orjson`` sees the body, and accepted only
when it has exactly the canonical shape SGLang (orjson) writes: no whitespace, no strings,
``T`` rows of ``k`` ``[logprob, id, text]`` triples. Its skeleton (the ``[``, ``]`` and
``,`` characters in order) must equal the skeleton that shape implies; then the brackets
are deleted and the remaining scalars parsed as one flat JSON array. The logprobs come out
exactly as ``orjson`` + ``float()`` would give them (same parser, same conversion), so the
result is bit-identical to the general path. Anything else -- ragged rows, whitespace,
text strings, empty values, non-numbers -- is left in the body untouched and takes the
general path, which gives the same values or the same error as before.

A ``/generate`` caller that asked for ``top_logprobs_num`` gets the rows back: they travel
through the gateway as :class:`LogprobRows` (sliced, concatenated and cut to k as arrays)
and are written with :meth:`LogprobRows.to_json`, which gives the exact bytes orjson writes for the
rows (``[[[logprob, id, null], ...], ...]``, -inf as null) without building them as
Python lists, or, when the rows are forwarded whole, the engine's own bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import orjson

from rollout_gateway import native

_KEY = b'"output_top_logprobs":[[['
_PLACEHOLDER = "#tk:"  # never valid as a top-logprobs value, so never confused with one
_STRUCT = b"[],"
#: below this many bytes (~60 tokens of top-5) nested parsing is as fast: leave it be,
#: unless the rows are forwarded (then columns save building them, whatever the size)
MIN_BYTES = 8192
_I32_LIMIT = float(1 << 31)
_NON_STRUCT = bytes(c for c in range(256) if c not in _STRUCT)
#: brackets to spaces (a translate table is ~2x cheaper than deleting them)
_BRACKETS_TO_SPACE = bytes(range(256)).replace(b"[", b" ").replace(b"]", b" ")


@lru_cache(maxsize=256)
def _skeleton(t: int, k: int) -> bytes:
    row = b"[" + b",".join([b"[,,]"] * k) + b"]"
    return b"[" + b",".join([row] * t) + b"]"


class LogprobRows:
    """SGLang's logprob rows without token texts, as columns.

    1-D (``output_token_logprobs``: ``[[logprob, id, null], ...]``) or 2-D
    (``output_top_logprobs``: ``[[[logprob, id, null], ...k], ...]``): ``logprobs``
    float64 [T] or [T, k] (NaN or -inf where the engine wrote null: orjson writes -inf as
    null, and so does :meth:`to_json`), ``ids`` int64 of the same shape.
    """

    # not a dataclass: orjson would write a dataclass as an object of its fields, where
    # every answer must go through api.serialize.json_default (a TypeError without it)
    __slots__ = ("logprobs", "ids", "raw")

    def __init__(self, logprobs: np.ndarray, ids: np.ndarray, raw: bytes | None = None) -> None:
        self.logprobs = logprobs
        self.ids = ids
        #: the JSON the engine wrote for exactly these rows, forwarded as it is (kept
        #: through whole slices and concatenation; a cut or partial slice drops it)
        self.raw = raw

    def __repr__(self) -> str:
        return f"LogprobRows(shape={self.logprobs.shape})"

    def __len__(self) -> int:
        return int(self.logprobs.shape[0])

    def __getitem__(self, key: slice) -> LogprobRows:
        if not isinstance(key, slice):
            raise TypeError("LogprobRows takes slices of rows only")
        whole = key.indices(len(self)) == (0, len(self), 1)
        return LogprobRows(self.logprobs[key], self.ids[key], self.raw if whole else None)

    @property
    def k(self) -> int:
        """Entries per row (0 for 1-D token rows)."""
        return int(self.logprobs.shape[1]) if self.logprobs.ndim == 2 else 0

    def cut(self, k: int) -> LogprobRows:
        """The first ``k`` entries of every row (SGLang's rows are sorted best first)."""
        return self if k >= self.k else LogprobRows(self.logprobs[:, :k], self.ids[:, :k])

    def to_rows(self) -> list:
        """The rows as SGLang's JSON parses (logprob None where it is not finite)."""
        def row(lp: float, i: int) -> list:
            return [lp if lp == lp and lp != -np.inf else None, i, None]
        lps, ids = self.logprobs.tolist(), self.ids.tolist()
        if self.logprobs.ndim == 1:
            return [row(lp, i) for lp, i in zip(lps, ids)]
        return [[row(lp, i) for lp, i in zip(lr, ir)] for lr, ir in zip(lps, ids)]

    def to_json(self) -> bytes:
        """The engine's own bytes when kept, else exactly ``orjson.dumps(self.to_rows())``
        written from the columns (no Python rows)."""
        if self.raw is not None:
            return self.raw
        n = self.logprobs.size
        if n == 0:
            return orjson.dumps(self.to_rows())
        if native.impl is not None:  # the same number texts, joined in C
            got = native.impl.rows_json(_text(self.logprobs), _text(self.ids),
                                        self.k if self.logprobs.ndim == 2 else 0)
            if got is not None:
                return got
        k = max(self.k, 1)
        seps = [b",null],["] * n  # between two entries
        if self.logprobs.ndim == 2:
            seps[k - 1::k] = [b",null]],[["] * (n // k)  # between two rows
            seps[-1], head = b",null]]]", b"[[["
        else:
            seps[-1], head = b",null]]", b"[["
        parts = [b","] * (4 * n)
        parts[0::4] = _numbers(self.logprobs)
        parts[2::4] = _numbers(self.ids)
        parts[3::4] = seps
        return head + b"".join(parts)

    @staticmethod
    def concat(parts: Sequence[LogprobRows | list]) -> LogprobRows | list:
        """Rows of consecutive pieces, in order: columns when every piece has them (with
        the same row shape), else plain rows."""
        cols = [p for p in parts if isinstance(p, LogprobRows)]
        if len(cols) == len(parts) and len({p.logprobs.shape[1:] for p in cols if len(p)}) <= 1:
            if len(cols) == 1:
                return cols[0]
            if cols:
                raw = None
                if all(p.raw is not None for p in cols):
                    raw = b"[" + b",".join([p.raw[1:-1] for p in cols if len(p)]) + b"]"
                return LogprobRows(np.concatenate([p.logprobs for p in cols]),
                                   np.concatenate([p.ids for p in cols]), raw)
        return [r for p in parts for r in (p.to_rows() if isinstance(p, LogprobRows) else p)]


def cut_top(rows: LogprobRows | list, k: int) -> LogprobRows | list:
    """Top-logprob rows (columns or plain rows, None rows kept) cut to ``k`` per token."""
    if isinstance(rows, LogprobRows):
        return rows.cut(k)
    return [r[:k] if r is not None else None for r in rows]


def _text(arr: np.ndarray) -> bytes:
    """The flat array's JSON, as orjson writes it (floats: shortest repr, -inf null)."""
    return orjson.dumps(np.ascontiguousarray(arr).reshape(-1), option=orjson.OPT_SERIALIZE_NUMPY)


def _numbers(arr: np.ndarray) -> list[bytes]:
    """Each element's JSON text, as orjson writes it (floats: shortest repr, -inf null)."""
    return _text(arr)[1:-1].split(b",")


def parse_top_segment(seg: bytes) -> LogprobRows | None:
    """Columns of a canonical top-logprobs array (null logprobs -> NaN), else None.

    ``seg`` is the whole JSON value, starting with ``[[[``. None means "not canonical":
    the caller must then use the general JSON path. Canonical also means: every text is
    null and every id an integer in [0, 2^31). The native data plane parses it in one
    pass (``_native.top_rows``, same results); this function is the pure-Python reference.
    """
    if native.impl is not None:
        got = native.impl.top_rows(seg)
        if got is None:
            return None
        lps, ids, t, k = got
        return LogprobRows(np.frombuffer(lps, np.float64).reshape(t, k),
                           np.frombuffer(ids, np.int64).reshape(t, k), seg)
    if len(seg) < 10 or not seg.startswith(b"[[[") or not seg.endswith(b"]]]"):
        return None
    if b'"' in seg:  # text strings may hold brackets and commas
        return None
    first = seg.find(b"]]")
    k = seg.count(b"[", 0, first) - 2  # the outer '[' and the first row's '['
    skel = seg.translate(None, _NON_STRUCT)
    row = 4 * k + (k - 1) + 2  # '[' + k '[,,]' joined by ',' + ']'
    if k < 1 or (len(skel) - 1) % (row + 1):
        return None
    t = (len(skel) - 1) // (row + 1)
    if skel != _skeleton(t, k):
        return None
    try:
        flat = orjson.loads(b"[" + seg.translate(_BRACKETS_TO_SPACE) + b"]")
    except orjson.JSONDecodeError:
        return None
    n = t * k
    if len(flat) != 3 * n or flat[2::3].count(None) != n:
        return None
    try:
        lps = np.fromiter(flat[0::3], dtype=np.float64, count=n)
        ids = np.fromiter(flat[1::3], dtype=np.float64, count=n)
    except (TypeError, ValueError, OverflowError):
        return None
    # ids must be integral token ids (a bool would not survive the round trip: no
    # true/false may appear; an id written 3.0 comes back as 3)
    if not ((ids >= 0) & (ids < _I32_LIMIT) & (ids == np.floor(ids))).all() \
            or b"t" in seg or b"f" in seg:
        return None
    return LogprobRows(lps.reshape(t, k), ids.astype(np.int64).reshape(t, k), seg)


def splice_top(body: bytes, min_bytes: int | None = None) -> tuple[bytes, list[LogprobRows]]:
    """Replace each canonical ``output_top_logprobs`` value with a placeholder string.

    Returns the smaller JSON and the parsed columns, indexed by the placeholder number.
    Values that are not canonical, or shorter than ``min_bytes`` (default
    :data:`MIN_BYTES`), stay in the body for the general path.
    """
    if min_bytes is None:
        min_bytes = MIN_BYTES
    pos = body.find(_KEY)
    if pos < 0:
        return body, []
    parts: list[bytes] = []
    mats: list[LogprobRows] = []
    last = 0
    while pos >= 0:
        i = pos + len(_KEY) - 3  # start of the value
        # a canonical value holds no '"': it ends at the last ']]]' before the next '"'
        # (a reverse search over a few bytes instead of a forward one over the value);
        # a quote-free prefix that is a whole canonical array is the whole value
        q = body.find(b'"', i)
        end = body.rfind(b"]]]", i, q if q >= 0 else len(body))
        if end < 0:
            pos = body.find(_KEY, i)
            continue
        end += 3
        mat = parse_top_segment(body[i:end]) if end - i >= min_bytes else None
        if mat is not None:
            parts.append(body[last:i])
            parts.append(f'"{_PLACEHOLDER}{len(mats)}"'.encode())
            mats.append(mat)
            last = end
        pos = body.find(_KEY, end)
    if not mats:
        return body, []
    parts.append(body[last:])
    return b"".join(parts), mats


def placeholder_index(value: object, count: int) -> int | None:
    """The matrix index a spliced placeholder refers to, or None if ``value`` is not one."""
    if isinstance(value, str) and value.startswith(_PLACEHOLDER):
        try:
            idx = int(value[len(_PLACEHOLDER):])
        except ValueError:
            return None
        return idx if 0 <= idx < count else None
    return None
