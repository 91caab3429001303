"""``RawResponse.iter_events``' in-place parser (``rawhttp._dechunk_events``): the SSE
payloads of a chunked body, however the body is cut into chunks and the chunks into socket
reads, equal the SSE splitter's over the de-chunked body; malformed framing stops it after
the complete events (which are kept), never with a Python exception of its own."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _sse_support import chunked

from rollout_gateway.engines.rawconn import RawConnection
from rollout_gateway.engines.rawhttp import _dechunk_events
from rollout_gateway.engines.sse import SSEPayloads


def _receive(conn: RawConnection, data: bytes) -> None:
    """What the transport does with bytes arriving on the socket."""
    while data:
        buf = conn.get_buffer(len(data))
        n = min(len(buf), len(data))
        buf[:n] = data[:n]
        conn.buffer_updated(n)
        data = data[n:]


def _parse_all(wire: bytes, reads: list[int]) -> tuple[list[bytes], bool]:
    conn = RawConnection(1 << 16)
    split = SSEPayloads()
    got: list[bytes] = []
    last = False
    prev = 0
    for c in sorted({min(r, len(wire)) for r in reads} | {len(wire)}):
        _receive(conn, wire[prev:c])
        prev = c
        out, need, last, err = _dechunk_events(conn, split)
        assert err is None and need >= 1 or last
        got += out
        if last:
            break
    return got, last


payload = st.binary(min_size=1, max_size=40).map(
    lambda b: b.replace(b"\n", b"x").replace(b"\r", b"y").strip() or b"p")
line_end = st.sampled_from([b"\n", b"\r\n"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(payload, line_end), min_size=1, max_size=8),
       st.lists(st.integers(0, 600), max_size=6), st.lists(st.integers(0, 800), max_size=8))
def test_events_however_chunked_and_read(events, chunk_cuts, read_cuts):
    body = b"".join(b"data: " + p + le + le for p, le in events)
    wire = chunked(body, chunk_cuts)
    got, last = _parse_all(wire, read_cuts)
    assert last
    assert got == SSEPayloads().feed(body) == [p for p, _ in events]


def test_one_event_per_chunk_is_sliced_once_and_a_large_payload_waits_whole():
    big = b"{" + b"7" * (3 << 20) + b"}"
    wire = chunked(b"data: " + big + b"\n\n", [])
    conn = RawConnection(1 << 16)
    split = SSEPayloads()
    _receive(conn, wire[:1000])
    out, need, last, err = _dechunk_events(conn, split)
    assert (out, last, err) == ([], False, None)
    assert need == len(wire) - len(b"0\r\n\r\n") - 1000  # the rest of the chunk, at once
    _receive(conn, wire[1000:])
    out, need, last, err = _dechunk_events(conn, split)
    assert out == [big] and last and err is None and split.pending == 0


@pytest.mark.parametrize("bad", [b"zz\r\ndata\r\n", b"-5\r\nhello\r\n", b"3\r\nabcXY",
                                 b"x" * 70_000])
def test_malformed_framing_keeps_the_events_before_it(bad):
    good = b"%x\r\n%b\r\n" % (len(b"data: 1\n\n"), b"data: 1\n\n")
    conn = RawConnection(1 << 16)
    _receive(conn, good + bad)
    out, _, last, err = _dechunk_events(conn, SSEPayloads())
    assert out == [b"1"] and not last
    assert isinstance(err, (ValueError, asyncio.LimitOverrunError))
