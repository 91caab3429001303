"""Helpers of the SSE / chunked-body tests."""

from __future__ import annotations


def chunked(body: bytes, cuts: list[int]) -> bytes:
    """``body`` as an HTTP/1.1 chunked body cut at ``cuts`` (duplicates and cuts past the
    end ignored), ended by the zero-size chunk."""
    out, prev = [], 0
    for c in sorted({min(c, len(body)) for c in cuts} | {len(body)}):
        if c > prev:
            out.append(b"%x\r\n%b\r\n" % (c - prev, body[prev:c]))
            prev = c
    return b"".join(out) + b"0\r\n\r\n"
