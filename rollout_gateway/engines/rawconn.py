"""One engine connection as a buffered protocol: bytes land in a buffer kept across
requests, and leave it with one copy.

asyncio's ``StreamReader`` receives each socket read as a fresh ``bytes``, appends it to
its buffer (a copy) and hands out another copy per ``read``; for a 2.8 MB ``/generate``
body with routed experts that is most of the gateway's time in the event loop. Here the
transport receives straight into this connection's buffer (``recv_into``); a buffer grown
for a large body goes back to a small per-process pool when its connection is idle (at
most 64 MiB kept), so the next large body lands in memory already paged in; and
``readexactly`` of a whole body is the only copy. With the native data plane a large
``readexactly`` (from ``LAND_MIN`` bytes) is not even that: the socket receives the body
straight into the bytes object returned (:meth:`RawConnection.land`).

The reading API is the subset of ``StreamReader`` that :mod:`rawhttp` uses, with its
errors: ``IncompleteReadError`` at end of stream, ``LimitOverrunError`` for a separator
not found within ``limit``, the connection's error when it was lost with one. Reads are
cancel-safe (nothing is consumed until a read returns), so a timed-out read can be retried.
"""

from __future__ import annotations

import asyncio
import select
from dataclasses import dataclass
from typing import Any

from rollout_gateway import native

_MIN_FREE = 1 << 16  # free space offered to each socket read
_SMALL = _MIN_FREE * 4  # a connection's buffer to begin with (and when idle)
_MAX_RESERVE = 64 << 20  # readexactly reserves the rest of a body up to this at once
#: a read of this many bytes or more lands in its own bytes object (native data plane)
LAND_MIN = 1 << 18


def lands(n: int) -> bool:
    """Whether a read of ``n`` bytes lands in its own bytes object (:meth:`RawConnection.land`)."""
    return n >= LAND_MIN and native.impl is not None


@dataclass(slots=True, eq=False)
class _Landing:
    """A read being received straight into ``data`` (through ``view``, its storage)."""

    data: bytes
    view: memoryview
    got: int  # bytes of data received so far


class _BufferPool:
    """Grown receive buffers handed from connection to connection, up to ``cap`` bytes
    kept: a multi-megabyte body then lands in memory already paged in, instead of a fresh
    zero-filled allocation per response."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._free: list[bytearray] = []
        self._bytes = 0

    def take(self, need: int, want: int) -> bytearray:
        """A buffer of at least ``need`` bytes (a new one of ``max(need, want)`` if none)."""
        for i, b in enumerate(self._free):
            if len(b) >= need:
                self._bytes -= len(b)
                return self._free.pop(i)
        return bytearray(max(need, want))

    def give(self, buf: bytearray) -> None:
        if self._bytes + len(buf) <= self.cap:
            self._free.append(buf)
            self._bytes += len(buf)


#: per process, shared by every engine connection (the event loop is single-threaded)
_BUFFERS = _BufferPool(64 << 20)


class RawConnection(asyncio.BufferedProtocol):
    """Reader and writer of one TCP connection (created by ``loop.create_connection``)."""

    def __init__(self, limit: int) -> None:
        #: pause reading beyond 2x this many unread bytes (and the longest readuntil);
        #: the owner may change it between reads (as a StreamReader's limit)
        self.limit = limit
        self._buf = bytearray(_SMALL)
        self._start = 0  # unread bytes are _buf[_start:_end]
        self._end = 0
        self._eof = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._drain: asyncio.Future[None] | None = None  # set while writing is paused
        self.transport: asyncio.Transport | None = None
        self._poll: Any = None  # a select.poll of the socket, made at the first reuse
        self._land: _Landing | None = None  # a read landing in its own bytes object

    @property
    def unread(self) -> int:
        """Bytes received and not read yet (a landing read's included)."""
        land = self._land
        return self._end - self._start + (land.got if land is not None else 0)

    # ---- protocol ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def _landing(self) -> _Landing | None:
        """The landing read still receiving, if any: ``get_buffer`` hands the transport its
        storage (exactly the rest: what follows lands in ``_buf``), and the transport's
        ``buffer_updated`` right after counts what came there."""
        land = self._land
        return land if land is not None and land.got < len(land.data) else None

    def get_buffer(self, sizehint: int) -> memoryview:
        land = self._landing()
        if land is not None:
            return land.view[land.got:]
        # the transport's hint (often 256 KiB) is not a need: growing for it would copy
        # what is unread; 64 KiB free is enough for one read, the rest comes next round
        self._reserve(_MIN_FREE)
        return memoryview(self._buf)[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        land = self._landing()
        if land is not None:
            land.got += nbytes
            self._wake()
            return
        self._end += nbytes
        if not self._paused and self._end - self._start > 2 * self.limit \
                and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        self._exc = exc
        self._wake()
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(exc or ConnectionResetError("connection lost"))

    def pause_writing(self) -> None:
        if self._drain is None or self._drain.done():
            self._drain = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # ---- buffer ------------------------------------------------------------------------
    def _reserve(self, free: int) -> None:
        """At least ``free`` writable bytes after ``_end``, unread bytes kept in order.
        Never resizes the bytearray in place (a view handed to the transport may still be
        alive): compacts with an equal-length slice assignment, or moves to a new one."""
        buf, start, end = self._buf, self._start, self._end
        if len(buf) - end >= free:
            return
        unread = end - start
        if len(buf) - unread >= free:
            with memoryview(buf) as mv:
                buf[:unread] = mv[start:end]  # equal length: moves within, no resize
        else:
            new = _BUFFERS.take(unread + free, 2 * len(buf))
            with memoryview(buf) as mv:
                new[:unread] = mv[start:end]
            self._buf = new
            if len(buf) > _SMALL:
                _BUFFERS.give(buf)
        self._start, self._end = 0, unread

    def _reserve_rest(self, rest: int) -> None:
        """Room for the ``rest`` of a body (or chunk) of known length: it lands in place, in
        one buffer, not grown and copied in doublings (an absurd length, past
        ``_MAX_RESERVE``, is reserved as it comes). ``_MIN_FREE`` more than the rest: the
        transport asks ``get_buffer`` for that much free space before every socket read,
        and an exact reservation would be found short as the bytes after the body arrive,
        moving the whole body (megabytes) to a new buffer once per answer."""
        self._reserve(min(rest, _MAX_RESERVE) + _MIN_FREE)

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait(self) -> None:
        if self._exc is not None:
            raise self._exc
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _take(self, n: int) -> bytes:
        data = bytes(memoryview(self._buf)[self._start:self._start + n])
        self.consume(n)
        return data

    # ---- in place (a parser reading the buffer without copying it out first) ------------
    def unread_bytes(self) -> tuple[bytearray, int, int]:
        """(buffer, start, end): the unread bytes are ``buffer[start:end]``. Valid until the
        next await (the transport writes into the buffer, which may move)."""
        return self._buf, self._start, self._end

    def consume(self, n: int) -> None:
        """Mark the first ``n`` unread bytes read."""
        self._start += n
        if self._start == self._end:
            self._start = self._end = 0
        if self._paused and self._end - self._start <= self.limit and self.transport:
            self._paused = False
            self.transport.resume_reading()

    async def wait_more(self, need: int = 1) -> None:
        """Until more bytes arrive (room for ``need`` more is made at once, up to 64 MiB:
        a large body lands in one buffer). IncompleteReadError at end of stream."""
        if self._at_end():
            raise asyncio.IncompleteReadError(b"", None)
        self._reserve_rest(max(need, 1))
        await self._wait()

    def _at_end(self) -> bool:
        if self._exc is not None:
            raise self._exc
        return self._eof

    # ---- reading -----------------------------------------------------------------------
    async def readuntil(self, sep: bytes) -> bytes:
        scanned = self._start
        while True:
            i = self._buf.find(sep, scanned, self._end)
            if i >= 0:
                return self._take(i + len(sep) - self._start)
            if self._end - self._start > self.limit:
                raise asyncio.LimitOverrunError("separator not found within the limit",
                                                self._end - self._start)
            if self._at_end():
                raise asyncio.IncompleteReadError(self._take(self._end - self._start), None)
            scanned = max(self._start, self._end - len(sep) + 1)
            offset = scanned - self._start
            await self._wait()
            scanned = self._start + offset  # the buffer may have been compacted

    async def readexactly(self, n: int) -> bytes:
        if lands(n):
            return await self.land(n)
        while self._end - self._start < n:
            if self._at_end():
                raise asyncio.IncompleteReadError(self._take(self._end - self._start), n)
            self._reserve_rest(n - (self._end - self._start))
            await self._wait()
        return self._take(n)

    async def land(self, n: int) -> bytes:
        """The next ``n`` bytes (as ``readexactly``), received straight into the bytes
        object returned: what was already buffered is copied in, the socket writes the
        rest there (the transport is handed that object's storage, exactly the rest, so
        what follows lands in the connection's buffer). Native data plane only. Cancel-
        safe like every read: a read retried after a timeout goes on where it stopped
        (the same ``n``); anything else is refused while one is unfinished."""
        land = self._land
        if land is None:
            data, writer = native.compiled().land(n)
            land = _Landing(data, memoryview(writer), min(n, self._end - self._start))
            land.view[:land.got] = memoryview(self._buf)[self._start:self._start + land.got]
            self.consume(land.got)
            self._land = land
        elif len(land.data) != n:
            raise RuntimeError(f"a read of {len(land.data)} bytes is unfinished; "
                               f"cannot read {n}")
        while land.got < n:
            if self._at_end():
                self._land = None
                got = bytes(land.view[:land.got])
                land.view.release()
                raise asyncio.IncompleteReadError(got, n)
            await self._wait()
        self._land = None
        land.view.release()  # nothing writes into the bytes from here on
        return land.data

    async def read(self, n: int) -> bytes:
        """Up to ``n`` bytes, at least one unless at end of stream (then b"")."""
        while self._end == self._start:
            if self._at_end():
                return b""
            await self._wait()
        return self._take(min(n, self._end - self._start))

    def trim(self, keep: int) -> None:
        """Drop a buffer grown beyond ``keep`` bytes once nothing is unread (an idle
        keep-alive connection should not hold its largest body's worth of memory)."""
        if self._start == self._end and len(self._buf) > keep:
            _BUFFERS.give(self._buf)
            self._buf = bytearray(_SMALL)
            self._start = self._end = 0

    # ---- writing -----------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        """Send ``data``; ConnectionResetError when the peer already closed (a keep-alive
        connection the server dropped while idle: the caller retries on a fresh one)."""
        if self.transport is None or self.transport.is_closing() or self._eof:
            raise ConnectionResetError("connection closed by the peer")
        self.transport.write(data)

    async def drain(self) -> None:
        if self._exc is not None:
            raise self._exc
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("connection closed")
        if self._drain is not None and not self._drain.done():
            await self._drain

    def reusable(self) -> bool:
        """Nothing arrived since the last answer was read: no end of stream, no error, no
        unread byte, and none waiting in the socket for the event loop either (a peer
        that closed an idle keep-alive connection: its FIN may not have been read yet)."""
        t = self.transport
        if t is None or t.is_closing() or self._eof or self._exc is not None \
                or self._end != self._start or self._land is not None:
            return False
        try:
            if self._poll is None:
                sock = t.get_extra_info("socket")
                if sock is None:
                    return True
                self._poll = select.poll()
                self._poll.register(sock.fileno(), select.POLLIN | select.POLLPRI)
            return not self._poll.poll(0)  # readable while idle: EOF, a reset, stray bytes
        except (OSError, ValueError):
            return False

    def is_closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
