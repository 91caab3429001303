"""A minimal keep-alive HTTP/1.1 client: the transport to a plain-http engine.

httpx spends ~6 ms of CPU reading a 2.8 MB /generate body (64 KiB reads through
httpcore/anyio/h11); receiving it straight into a connection's buffer
(:mod:`~rollout_gateway.engines.rawconn`) costs under 1 ms. This client does only what
engines answer: Content-Length or chunked bodies (uvicorn), plain http. It implements
:class:`~rollout_gateway.engines.transport.Transport` (https engines use httpx instead).

Keep-alive: engines close idle connections (uvicorn, hence SGLang, after 5 s). A pooled
connection idle for ``keep_alive_s`` or longer is closed, not reused, and one is reused
only if nothing arrived on it since its last answer (no EOF, no reset, no stray byte, in
the protocol's state or still waiting in the socket). A request sent on a reused
connection that the peer closes or resets before any byte of the answer (it closed the
idle connection just as the request went out) is sent again once, on a freshly dialled
connection; on a fresh connection, or once any answer byte arrived, that is a failure.

Errors: connection problems and malformed framing raise :class:`EngineError` with
``details["dropped"] = True`` once any response byte arrived; a read stalled longer than
``read_timeout`` (``first_timeout`` for the first body read) raises :class:`Timeout`,
unless ``patience()`` says the silence is expected (the engine is paused for a swap). A
connection that failed, was cancelled mid-way or was told ``Connection: close`` is never
reused. :meth:`RawHttpPool.abort_active` breaks off every request in flight (an engine
that stopped answering health probes): their reads fail at once as dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from rollout_gateway.engines import rawconn
from rollout_gateway.engines.rawconn import RawConnection
from rollout_gateway.engines.sse import _WS, SSEPayloads, _stripped
from rollout_gateway.errors import EngineError, Timeout

#: a connection's limit: the longest head / chunk-size line, and how much of a body held
#: back by ``before_read`` is buffered (reading pauses past 2x this until the body is read
#: on: the rest waits in the socket, not in the gateway: TCP backpressure)
_BUFFER_LIMIT = 1 << 16
#: the limit while a body is read on (fewer event-loop rounds per multi-MB answer), and
#: the largest single read
_READ_MAX = 1 << 22
_IDLE_BUFFER = 1 << 20  # receive buffer an idle keep-alive connection may keep


@dataclass(slots=True, eq=False)
class _Conn:
    io: RawConnection  # reads and writes
    reused: bool = False
    aborted: str | None = None  # why abort_active broke it off
    idle_since: float = 0.0  # monotonic time it went back to the pool
    abortable: bool = True  # abort_active breaks it off (a /generate, not a control call)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.io.close()


class RawResponse:
    """Status, lower-cased headers and a body iterator bound to one connection."""

    def __init__(self, pool: RawHttpPool, conn: _Conn, status: int, headers: dict[bytes, bytes],
                 read_timeout: float, first_timeout: float | None = None,
                 patience: Callable[[], bool] | None = None) -> None:
        self._pool = pool
        self._conn = conn
        self.status = status
        self.headers = headers
        self._timeout = read_timeout
        self._first = first_timeout if first_timeout is not None else read_timeout
        self._patience = patience
        self._done = False

    async def _read(self, fn, *args):
        """``fn(*args)`` (a RawConnection read: cancel-safe, so it can be retried)."""
        conn = self._conn
        while True:
            limit = self._first
            try:  # asyncio.timeout: no Task per read, as wait_for would create
                async with asyncio.timeout(limit):
                    data = await fn(*args)
                self._first = self._timeout  # silence on the stream from now on
                return data
            except TimeoutError as exc:
                if self._patience is not None and self._patience():
                    continue  # paused for a swap: silence is expected
                raise Timeout(f"engine {self._pool.name}: no data for {limit:g}s",
                              details={"engine_id": self._pool.name, "dropped": True,
                                       "silent_s": limit}) from exc
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError,
                    OSError, ValueError) as exc:
                why = f"broken off: {conn.aborted}" if conn.aborted else \
                    f"connection broke mid-response ({type(exc).__name__})"
                raise EngineError(f"engine {self._pool.name}: {why}",
                                  details={"engine_id": self._pool.name, "dropped": True}) from exc

    @property
    def buffered(self) -> int:
        """Bytes received and not read yet (at most ~2 x 64 KiB plus one socket read while
        held back: the connection stops reading past that until they are read)."""
        conn = self._conn
        return conn.io.unread if conn is not None else 0

    async def iter_bytes(self, before_read: Callable[[int], Awaitable[bool]] | None = None
                         ) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked framing removed; a chunk whole, as uvicorn sends
        one per SSE event). ``before_read(bytes)`` is awaited before each read once the
        previous piece was taken (this frame holds no reference to it then), with the
        bytes the read will hold (received and not read yet; for a chunk, its size): a
        caller may hold the body back there; it returns whether the body may be buffered
        freely for now (else the connection stops reading past ~2 x 64 KiB: the rest
        waits in the socket). Without ``before_read`` it always may."""
        r = self._conn.io
        r.limit = _BUFFER_LIMIT if before_read is not None else _READ_MAX
        try:
            te = self.headers.get(b"transfer-encoding", b"").lower()
            if self.status < 200 or self.status in (204, 304):
                pass  # no body
            elif b"chunked" in te:
                while True:
                    size = _chunk_size(await self._read(r.readuntil, b"\r\n"))
                    if size == 0:
                        while (await self._read(r.readuntil, b"\r\n")) != b"\r\n":
                            pass  # trailers
                        break
                    await self._ask(before_read, max(self.buffered, size))  # may wait
                    data = await self._read(r.readexactly, size)
                    yield data
                    data = None
                    if await self._read(r.readexactly, 2) != b"\r\n":
                        raise EngineError(f"engine {self._pool.name}: malformed chunked body",
                                          details={"engine_id": self._pool.name,
                                                   "dropped": True})
            elif b"content-length" in self.headers:
                if not self.headers[b"content-length"].isdigit():
                    raise EngineError(f"engine {self._pool.name}: bad Content-Length "
                                      f"{self.headers[b'content-length'][:40]!r}",
                                      details={"engine_id": self._pool.name})
                left = int(self.headers[b"content-length"])
                while left > 0:
                    await self._ask(before_read, self.buffered)
                    data = await self._read(r.read, min(left, _READ_MAX))
                    if not data:
                        raise EngineError(f"engine {self._pool.name}: body cut short",
                                          details={"engine_id": self._pool.name, "dropped": True})
                    left -= len(data)
                    yield data
                    data = None
            else:  # delimited by close
                while True:
                    await self._ask(before_read, self.buffered)
                    data = await self._read(r.read, _READ_MAX)
                    if not data:
                        break
                    yield data
                    data = None
                self.headers[b"connection"] = b"close"
            self._done = True
        finally:
            self.release()

    async def iter_events(self, before_read: Callable[[int], Awaitable[bool]] | None = None
                          ) -> AsyncIterator[list[bytes]]:
        """The SSE payloads of the body (:class:`~rollout_gateway.engines.sse.SSEPayloads`'
        framing), in batches: every event already received comes in one batch, parsed in
        place. A chunked body (uvicorn: one chunk per event) is de-chunked in the
        connection's buffer without an await per chunk, and the payload of a one-event
        chunk is copied out once (a multi-MB final payload with routed experts is not
        copied again by a splitter); the wait for more bytes is the only await per batch.
        ``before_read(held)`` as for :meth:`iter_bytes`, ``held`` counting the event still
        incomplete. A stream that breaks raises after the complete events were yielded."""
        te = self.headers.get(b"transfer-encoding", b"").lower()
        split = SSEPayloads()
        if b"chunked" not in te or self.status < 200 or self.status in (204, 304):
            async def ask(unread: int) -> bool:  # the splitter holds the incomplete event
                return await before_read(unread + split.pending)  # type: ignore[misc]

            async for data in self.iter_bytes(ask if before_read is not None else None):
                out = split.feed(data)
                del data
                if out:
                    yield out
                out = None
            return
        r = self._conn.io
        r.limit = _BUFFER_LIMIT if before_read is not None else _READ_MAX
        try:
            while True:
                out, need, last, err = _dechunk_events(r, split)
                if err is not None:
                    if out:
                        yield out  # the events before the damage
                    raise EngineError(f"engine {self._pool.name}: malformed chunked body",
                                      details={"engine_id": self._pool.name,
                                               "dropped": True}) from err
                if last:
                    if out:
                        yield out
                        out = None
                    while (await self._read(r.readuntil, b"\r\n")) != b"\r\n":
                        pass  # trailers
                    break
                if out:
                    yield out
                    out = None
                    continue  # what arrived meanwhile (or nothing: then need > 0)
                if before_read is not None:
                    seen = r.unread
                    await self._ask(before_read, max(seen + split.pending, need))
                    if r.unread != seen:
                        continue  # bytes arrived while it waited: parse them first
                spot = _landing_spot(r, split)
                if spot is not None:  # a large one-line event: its payload lands whole
                    out = await self._land_event(r, split, *spot)
                    if out:
                        yield out
                        out = None
                    continue
                await self._read(r.wait_more, need)
            self._done = True
        finally:
            self.release()

    async def _land_event(self, r: RawConnection, split: SSEPayloads, head: bytes,
                          n: int) -> list[bytes]:
        """The chunk at the head of ``r`` from its payload's first byte on (``head``, its
        ``data:`` prefix, already consumed): the payload's ``n`` bytes land in their own
        bytes object (:meth:`RawConnection.land`), then the event's end and the chunk's
        CRLF are read. What is not a one-line event after all goes through ``split``."""
        payload = await self._read(r.land, n)
        tail = await self._read(r.readexactly, 4)
        if tail[2:] != b"\r\n":
            raise EngineError(f"engine {self._pool.name}: malformed chunked body",
                              details={"engine_id": self._pool.name, "dropped": True})
        if tail[:2] == b"\n\n" and payload[-1] not in _WS and payload.find(b"\n") < 0:
            return [payload]
        return split.feed(head + payload + tail[:2])

    async def _ask(self, before_read: Callable[[int], Awaitable[bool]] | None,
                   held: int) -> None:
        """Before a read: may the body be buffered freely (``before_read(held)``, which
        may wait for it)? The connection's limit follows the answer."""
        if before_read is not None:
            self._conn.io.limit = _READ_MAX if await before_read(held) else _BUFFER_LIMIT

    @property
    def content_length(self) -> int | None:
        """The body's size when the head announced it (not chunked), else None."""
        length = self.headers.get(b"content-length", b"")
        te = self.headers.get(b"transfer-encoding", b"").lower()
        return int(length) if length.isdigit() and b"chunked" not in te else None

    async def read(self) -> bytes:
        """The whole body. A Content-Length body is taken in one read once it is all
        there (one copy out of the stream buffer, instead of a copy per arriving piece
        plus a join); the read timeout then bounds the whole transfer."""
        length = self.content_length
        if length is None or self.status < 200 or self.status in (204, 304):
            return b"".join([c async for c in self.iter_bytes()])
        try:
            data = await self._read(self._conn.io.readexactly, length)
            self._done = True
            return data
        finally:
            self.release()

    async def aclose(self) -> None:
        """Done with this answer (read or not): its connection goes back or is closed."""
        self.release()

    def release(self) -> None:
        conn, self._conn = self._conn, None  # type: ignore[assignment]
        if conn is None:
            return
        conn.io.limit = _BUFFER_LIMIT  # the next head is read narrow
        keep = self._done and self.headers.get(b"connection", b"").lower() != b"close"
        self._pool._give_back(conn, keep)


def _chunk_size(line: bytes) -> int:
    """A chunk-size line's size (its extensions ignored); ValueError if it is no hex."""
    return int(line.split(b";", 1)[0].strip(), 16)


def _dechunk_events(r: RawConnection, split: SSEPayloads
                    ) -> tuple[list[bytes], int, bool, Exception | None]:
    """The SSE payloads of the complete chunks buffered in ``r`` (consumed); returns
    (payloads, bytes still needed for the next chunk, whether the last chunk (size 0) was
    read, the framing error that stopped the parse (ValueError / LimitOverrunError) after
    those payloads, if any). A chunk holding exactly one one-line event
    (``data: ...\\n\\n``, as uvicorn sends each event) has its payload copied out of the
    buffer once; any other chunk goes through ``split``."""
    buf, start, end = r.unread_bytes()
    pos, out, need, last, err = start, [], 1, False, None
    with memoryview(buf) as mv:
        try:
            while True:
                nl = buf.find(b"\r\n", pos, end)
                if nl < 0:
                    if end - pos > r.limit:
                        raise asyncio.LimitOverrunError("chunk size line too long", end - pos)
                    break
                size = _chunk_size(bytes(mv[pos:nl]))
                if size < 0:
                    raise ValueError(f"negative chunk size {size}")
                if size == 0:
                    pos, last = nl + 2, True
                    break
                d0 = nl + 2
                d1 = d0 + size
                if d1 + 2 > end:
                    need = d1 + 2 - end
                    break
                if mv[d1:d1 + 2] != b"\r\n":
                    raise ValueError("chunk not followed by CRLF")
                if not split.pending and size > 7 and buf.startswith(b"data:", d0) \
                        and buf[d1 - 1] == 0x0A and buf.find(b"\n", d0, d1) == d1 - 2:
                    a, e = _stripped(buf, d0 + 5, d1 - 2)
                    out.append(bytes(mv[a:e]))
                else:
                    out += split.feed(bytes(mv[d0:d1]))
                pos = d1 + 2
        except (ValueError, asyncio.LimitOverrunError) as exc:
            err = exc
    r.consume(pos - start)
    return out, need, last, err


def _landing_spot(r: RawConnection, split: SSEPayloads) -> tuple[bytes, int] | None:
    """Whether the incomplete chunk at the head of ``r``'s unread bytes should land (its
    payload received straight into its own bytes object, not copied out of the buffer):
    a size that lands (:func:`rawconn.lands`), nothing pending in ``split``, within what
    the reader may buffer now (2 x its limit), and what arrived of it is ``data:`` and the
    payload's first byte. If so, consumes the chunk up to that byte and returns (what it
    consumed of the chunk, the payload's length up to the chunk's last 2 bytes)."""
    if split.pending:
        return None
    buf, start, end = r.unread_bytes()
    nl = buf.find(b"\r\n", start, end)
    if nl < 0:
        return None
    try:
        size = _chunk_size(bytes(buf[start:nl]))
    except ValueError:
        return None  # the parse that reads the chunk will say so
    d0 = nl + 2
    if not rawconn.lands(size) or size > 2 * r.limit or d0 + size + 2 <= end \
            or not buf.startswith(b"data:", d0, end):
        return None
    a, _ = _stripped(buf, d0 + 5, end)  # the payload's first byte, if it arrived
    if a >= end or a > d0 + size - 2:
        return None  # the payload's first byte has not arrived (or the chunk is odd)
    head = bytes(buf[d0:a])
    r.consume(a - start)
    return head, d0 + size - 2 - a


class RawHttpPool:
    """Keep-alive connections to one ``http://host:port`` (a path prefix of the engine's
    URL goes before every request's path)."""

    def __init__(self, name: str, host: str, port: int, *, connect_timeout: float,
                 keep_alive_s: float = 4.0, max_idle: int = 64,
                 headers: dict[str, str] | None = None, prefix: str = "") -> None:
        self.name = name
        self._extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.host = host
        self.port = port
        self.prefix = prefix.rstrip("/")
        self.connect_timeout = connect_timeout
        #: a pooled connection idle this long is closed instead of reused (keep it below
        #: the engine's own keep-alive: uvicorn's and SGLang's is 5 s)
        self.keep_alive_s = keep_alive_s
        self.max_idle = max_idle
        self._idle: deque[_Conn] = deque()  # oldest first
        self._busy: set[_Conn] = set()  # connections with a request in flight
        self._closed = False
        #: dialled: new connections; reused: requests sent on a pooled one; stale: pooled
        #: connections closed unused (idle too long, or the peer closed or wrote to them);
        #: resent: requests sent again on a fresh connection after a reused one was reset
        self.counters = {"dialled": 0, "reused": 0, "stale": 0, "resent": 0}

    async def _connect(self) -> _Conn:
        try:
            _, io = await asyncio.wait_for(asyncio.get_running_loop().create_connection(
                lambda: RawConnection(_BUFFER_LIMIT), self.host, self.port),
                self.connect_timeout)
        except TimeoutError as exc:
            raise Timeout(f"engine {self.name}: connect timed out") from exc
        except OSError as exc:
            raise EngineError(f"engine {self.name}: cannot connect: {exc}",
                              details={"engine_id": self.name}) from exc
        self.counters["dialled"] += 1
        return _Conn(io)

    def _expire(self, now: float) -> None:
        """Close the pooled connections idle for ``keep_alive_s`` or longer."""
        idle = self._idle
        while idle and now - idle[0].idle_since >= self.keep_alive_s:
            idle.popleft().close()
            self.counters["stale"] += 1

    def _pooled(self) -> _Conn | None:
        """The most recently used pooled connection that may be reused, else None
        (every one passed over is closed)."""
        self._expire(time.monotonic())
        while self._idle:
            conn = self._idle.pop()
            if conn.io.reusable():
                self.counters["reused"] += 1
                return conn
            conn.close()
            self.counters["stale"] += 1
        return None

    def _give_back(self, conn: _Conn, keep: bool) -> None:
        self._busy.discard(conn)
        if keep and not conn.aborted and not self._closed and len(self._idle) < self.max_idle \
                and not conn.io.is_closing():
            conn.io.trim(_IDLE_BUFFER)
            conn.reused = True
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
            self._expire(conn.idle_since)
        else:
            conn.close()

    def abort_active(self, why: str) -> int:
        """Break off every abortable request in flight (their reads fail at once, as
        dropped); returns how many."""
        gone = [c for c in self._busy if c.abortable]
        for c in gone:
            self._busy.discard(c)
            c.aborted = why
            with contextlib.suppress(Exception):
                c.io.abort()
        return len(gone)

    async def post(self, path: str, body: bytes, *, read_timeout: float,
                   first_timeout: float | None = None,
                   patience: Callable[[], bool] | None = None) -> RawResponse:
        """Send a JSON POST; returns once the status line and headers arrived (within
        ``first_timeout``, default ``read_timeout``)."""
        return await self.request("POST", path, body, read_timeout=read_timeout,
                                  first_timeout=first_timeout, patience=patience)

    async def request(self, method: str, path: str, body: bytes | None = None, *,
                      read_timeout: float, first_timeout: float | None = None,
                      patience: Callable[[], bool] | None = None,
                      abortable: bool = True) -> RawResponse:
        """Send ``method path`` (``body``: JSON); returns once the status line and headers
        arrived (within ``first_timeout``, default ``read_timeout``). ``abortable``: the
        request is broken off by :meth:`abort_active`."""
        head_timeout = first_timeout if first_timeout is not None else read_timeout
        head = f"{method} {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        msg = (head + f"Accept: */*\r\n{self._extra}\r\n").encode() + (body or b"")
        conn = self._pooled() or await self._connect()
        while True:
            conn.abortable = abortable
            self._busy.add(conn)
            try:
                conn.io.write(msg)
                await conn.io.drain()
                raw = await self._head(conn, head_timeout, patience)
            except TimeoutError as exc:  # (an OSError: caught first)
                self._drop(conn)
                raise Timeout(f"engine {self.name}: no response for {head_timeout:g}s",
                              details={"engine_id": self.name}) from exc
            except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
                self._drop(conn)
                if conn.aborted:
                    raise EngineError(f"engine {self.name}: broken off: {conn.aborted}",
                                      details={"engine_id": self.name}) from exc
                got = exc.partial if isinstance(exc, asyncio.IncompleteReadError) else \
                    conn.io.unread
                if conn.reused and not got:  # closed by the peer as the request went out
                    self.counters["resent"] += 1
                    conn = await self._connect()
                    continue
                what = "connection closed before a response" \
                    if isinstance(exc, asyncio.IncompleteReadError) else \
                    f"{type(exc).__name__}: {exc}"
                raise EngineError(f"engine {self.name}: {what}",
                                  details={"engine_id": self.name}) from exc
            except asyncio.LimitOverrunError as exc:
                self._drop(conn)
                raise EngineError(f"engine {self.name}: response head too long",
                                  details={"engine_id": self.name}) from exc
            except BaseException:
                self._drop(conn)
                raise
            return self._parse_head(conn, raw, read_timeout, first_timeout, patience)

    @staticmethod
    async def _head(conn: _Conn, timeout: float, patience: Callable[[], bool] | None) -> bytes:
        while True:
            try:  # readuntil is cancel-safe: a timed-out wait can be resumed
                async with asyncio.timeout(timeout):
                    return await conn.io.readuntil(b"\r\n\r\n")
            except TimeoutError:
                if patience is None or not patience():
                    raise

    def _drop(self, conn: _Conn) -> None:
        self._busy.discard(conn)
        conn.close()

    def _parse_head(self, conn: _Conn, raw: bytes, read_timeout: float,
                    first_timeout: float | None = None,
                    patience: Callable[[], bool] | None = None) -> RawResponse:
        lines = raw.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            self._drop(conn)
            raise EngineError(f"engine {self.name}: not an HTTP/1.1 response: {lines[0][:80]!r}",
                              details={"engine_id": self.name})
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            if b":" in line:
                k, v = line.split(b":", 1)
                headers[k.strip().lower()] = v.strip()
        return RawResponse(self, conn, int(parts[1]), headers, read_timeout, first_timeout,
                           patience)

    def close(self) -> None:
        self._closed = True
        for c in self._idle:
            c.close()
        self._idle.clear()
        for c in list(self._busy):
            c.close()

    async def aclose(self) -> None:
        self.close()
