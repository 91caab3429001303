"""A small RESP (Redis protocol) reply reader for the two bulk reads of trajectory bytes.

redis-py + hiredis copy each multi-MB payload twice (hiredis' buffer, then a new bytes
object whose fresh pages fault in): about 3x the CPU per byte of receiving it once. This
reader runs on a socket redis-py connected (URL, AUTH, TLS, db are redis-py's) and, for
bulk strings of at least ``big`` bytes, either receives them straight into a buffer the
caller supplies (``sink(n)``: a writable buffer of >= n bytes; the learner's pooled
buffers: the reply is a read-only memoryview of exactly n bytes) or, without a sink, skips
them through a reused scratch buffer and returns :class:`Skipped` (the gateway leasing
entries it only references).

Why it lives in ``rollout_proto``: both programs read the same Redis stream of trajectory
bytes, ``learner_client.store`` (by-reference pulls) and
``rollout_gateway.store.redis_streams`` (by-reference leases), and neither may import the
other (tests/unit/test_layers.py); ``rollout_proto`` is the one package both import, the
home of what they share on the wire (the trajectory codec, and this reader of the store's
replies).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Replies", "RespError", "Skipped"]

_CRLF = b"\r\n"


class RespError(Exception):
    """An error reply (``-ERR ...``); the connection is still in sync."""


class Skipped(int):
    """A bulk string that was not kept: its length."""


class Replies:
    """RESP2/3 replies from a connected blocking socket, one :meth:`read` per reply."""

    def __init__(self, sock, sink: Callable[[int], Any] | None = None, *,
                 big: int = 64 << 10):
        self.sock, self.sink, self.big = sock, sink, big
        self.buf = bytearray(1 << 16)
        self.mv = memoryview(self.buf)
        self.lo = self.hi = 0

    def _fill(self) -> None:
        if self.lo == self.hi:
            self.lo = self.hi = 0
        elif self.hi == len(self.buf):
            n = self.hi - self.lo
            self.buf[:n] = self.buf[self.lo:self.hi]
            self.lo, self.hi = 0, n
        got = self.sock.recv_into(self.mv[self.hi:])
        if not got:
            raise ConnectionError("Redis closed the connection")
        self.hi += got

    def _line(self) -> bytes:
        while True:
            j = self.buf.find(_CRLF, self.lo, self.hi)
            if j >= 0:
                line = bytes(self.mv[self.lo:j])
                self.lo = j + 2
                return line
            self._fill()

    def _skip_crlf(self) -> None:
        while self.hi - self.lo < 2:
            self._fill()
        self.lo += 2

    def _bulk(self, n: int):
        have = self.hi - self.lo
        if n < self.big:
            while have < n + 2:
                self._fill()
                have = self.hi - self.lo
            out = bytes(self.mv[self.lo:self.lo + n])
            self.lo += n + 2
            return out
        got = min(have, n)
        if self.sink is None:  # skip: the rest passes through the scratch buffer
            self.lo += got
            while got < n:
                k = self.sock.recv_into(self.mv, min(n - got, len(self.buf)))
                if not k:
                    raise ConnectionError("Redis closed the connection")
                got += k
            self.lo = self.hi = 0
            self._skip_crlf()
            return Skipped(n)
        view = memoryview(self.sink(n))
        view[:got] = self.mv[self.lo:self.lo + got]
        self.lo += got
        while got < n:
            k = self.sock.recv_into(view[got:n])
            if not k:
                raise ConnectionError("Redis closed the connection")
            got += k
        self._skip_crlf()
        return view[:n].toreadonly()

    def read(self):
        """One reply: bytes, int, None, lists, dicts (RESP3 maps), memoryview / Skipped for
        big bulk strings. RespError for an error reply; ConnectionError / OSError /
        ValueError when the connection broke or spoke something else (drop it)."""
        line = self._line()
        t, rest = line[:1], line[1:]
        if t == b"$":
            n = int(rest)
            return None if n < 0 else self._bulk(n)
        if t in (b"*", b"~", b">"):
            n = int(rest)
            return None if n < 0 else [self.read() for _ in range(n)]
        if t == b"%":  # RESP3 map
            items = [self.read() for _ in range(2 * int(rest))]
            return dict(zip(items[::2], items[1::2]))
        if t == b":":
            return int(rest)
        if t == b"+":
            return rest
        if t == b"_":
            return None
        if t in (b"-", b"!"):
            raise RespError(rest.decode(errors="replace"))
        raise ConnectionError(f"unexpected Redis reply {line[:40]!r}")
