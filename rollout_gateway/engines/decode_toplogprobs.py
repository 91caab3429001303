"""Fast path for ``output_top_logprobs``: cut it out of the raw body, parse it flat.

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
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import orjson

_KEY = b'"output_top_logprobs":[[['
_PLACEHOLDER = "#tk:"  # never valid as a top-logprobs value, so never confused with one
_STRUCT = b"[],"
#: below this many bytes (~60 tokens of top-5) nested parsing is as fast: leave it be
MIN_BYTES = 8192
_NON_STRUCT = bytes(c for c in range(256) if c not in _STRUCT)
#: brackets to spaces (a translate table is ~2x cheaper than deleting them)
_BRACKETS_TO_SPACE = bytes(range(256)).replace(b"[", b" ").replace(b"]", b" ")


@lru_cache(maxsize=256)
def _skeleton(t: int, k: int) -> bytes:
    row = b"[" + b",".join([b"[,,]"] * k) + b"]"
    return b"[" + b",".join([row] * t) + b"]"


def parse_top_segment(seg: bytes) -> np.ndarray | None:
    """[T, k] float64 logprobs (null -> NaN) of a canonical top-logprobs array, else None.

    ``seg`` is the whole JSON value, starting with ``[[[``. None means "not canonical":
    the caller must then use the general JSON path.
    """
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
    if len(flat) != 3 * t * k:
        return None
    try:
        lps = np.fromiter(flat[0::3], dtype=np.float64, count=t * k)
    except (TypeError, ValueError, OverflowError):
        return None
    return lps.reshape(t, k)


def splice_top(body: bytes) -> tuple[bytes, list[np.ndarray]]:
    """Replace each canonical ``output_top_logprobs`` value with a placeholder string.

    Returns the smaller JSON and the parsed [T, k] matrices, indexed by the placeholder
    number. Values that are not canonical stay in the body for the general path.
    """
    pos = body.find(_KEY)
    if pos < 0:
        return body, []
    parts: list[bytes] = []
    mats: list[np.ndarray] = []
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
        mat = parse_top_segment(body[i:end]) if end - i >= MIN_BYTES else None
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
