"""A minimal keep-alive HTTP/1.1 client for the one hot call: POST /generate.

httpx spends ~6 ms of CPU reading a 2.8 MB /generate body (64 KiB reads through
httpcore/anyio/h11); reading it straight from an asyncio stream costs ~1.3 ms. This client
does only what engines answer: Content-Length or chunked bodies (uvicorn), plain http.
Everything else the gateway sends (control, weights, health) stays on httpx.

Errors: connection problems and malformed framing raise :class:`EngineError` with
``details["dropped"] = True`` once any response byte arrived; a read stalled longer than
``read_timeout`` raises :class:`Timeout`. A connection that failed, was cancelled mid-way
or was told ``Connection: close`` is never reused.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from rollout_gateway.errors import EngineError, Timeout

_HEAD_LIMIT = 1 << 16  # status line + headers
_STREAM_LIMIT = 1 << 22  # asyncio StreamReader buffer


@dataclass(slots=True)
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    reused: bool = False

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class RawResponse:
    """Status, lower-cased headers and a body iterator bound to one connection."""

    def __init__(self, pool: RawHttpPool, conn: _Conn, status: int, headers: dict[bytes, bytes],
                 read_timeout: float) -> None:
        self._pool = pool
        self._conn = conn
        self.status = status
        self.headers = headers
        self._timeout = read_timeout
        self._done = False

    async def _read(self, coro):
        try:
            return await asyncio.wait_for(coro, self._timeout)
        except asyncio.TimeoutError as exc:
            raise Timeout(f"engine {self._pool.name}: no data for {self._timeout}s") from exc
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError,
                OSError, ValueError) as exc:
            raise EngineError(f"engine {self._pool.name}: connection broke mid-response "
                              f"({type(exc).__name__})",
                              details={"engine_id": self._pool.name, "dropped": True}) from exc

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked framing removed)."""
        r = self._conn.reader
        try:
            te = self.headers.get(b"transfer-encoding", b"").lower()
            if b"chunked" in te:
                while True:
                    line = await self._read(r.readuntil(b"\r\n"))
                    size = int(line.split(b";", 1)[0].strip(), 16)
                    if size == 0:
                        while (await self._read(r.readuntil(b"\r\n"))) != b"\r\n":
                            pass  # trailers
                        break
                    data = await self._read(r.readexactly(size))
                    await self._read(r.readexactly(2))
                    yield data
            elif b"content-length" in self.headers:
                left = int(self.headers[b"content-length"])
                while left > 0:
                    data = await self._read(r.read(min(left, _STREAM_LIMIT)))
                    if not data:
                        raise EngineError(f"engine {self._pool.name}: body cut short",
                                          details={"engine_id": self._pool.name, "dropped": True})
                    left -= len(data)
                    yield data
            else:  # delimited by close
                while data := await self._read(r.read(_STREAM_LIMIT)):
                    yield data
                self.headers[b"connection"] = b"close"
            self._done = True
        finally:
            self.release()

    async def read(self) -> bytes:
        return b"".join([c async for c in self.iter_bytes()])

    def release(self) -> None:
        conn, self._conn = self._conn, None  # type: ignore[assignment]
        if conn is None:
            return
        keep = self._done and self.headers.get(b"connection", b"").lower() != b"close"
        self._pool._give_back(conn, keep)


class RawHttpPool:
    """Keep-alive connections to one ``http://host:port``."""

    def __init__(self, name: str, host: str, port: int, *, connect_timeout: float,
                 max_idle: int = 64, headers: dict[str, str] | None = None) -> None:
        self.name = name
        self._extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.host = host
        self.port = port
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self._idle: list[_Conn] = []

    async def _connect(self) -> _Conn:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, limit=_STREAM_LIMIT),
                self.connect_timeout)
        except asyncio.TimeoutError as exc:
            raise Timeout(f"engine {self.name}: connect timed out") from exc
        except OSError as exc:
            raise EngineError(f"engine {self.name}: cannot connect: {exc}",
                              details={"engine_id": self.name}) from exc
        return _Conn(reader, writer)

    def _give_back(self, conn: _Conn, keep: bool) -> None:
        if keep and len(self._idle) < self.max_idle and not conn.writer.is_closing():
            conn.reused = True
            self._idle.append(conn)
        else:
            conn.close()

    async def post(self, path: str, body: bytes, *, read_timeout: float) -> RawResponse:
        """Send a JSON POST; returns once the status line and headers arrived."""
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                f"Accept: */*\r\n{self._extra}\r\n").encode()
        for attempt in (0, 1):
            conn = self._idle.pop() if self._idle else await self._connect()
            try:
                conn.writer.write(head + body)
                await conn.writer.drain()
                raw = await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), read_timeout)
            except asyncio.IncompleteReadError as exc:
                conn.close()
                if conn.reused and not exc.partial and attempt == 0:
                    continue  # the server closed an idle keep-alive connection: retry fresh
                raise EngineError(f"engine {self.name}: connection closed before a response",
                                  details={"engine_id": self.name}) from exc
            except asyncio.TimeoutError as exc:
                conn.close()
                raise Timeout(f"engine {self.name}: no response for {read_timeout}s") from exc
            except (ConnectionError, OSError, asyncio.LimitOverrunError) as exc:
                conn.close()
                if conn.reused and attempt == 0:
                    continue
                raise EngineError(f"engine {self.name}: {type(exc).__name__}: {exc}",
                                  details={"engine_id": self.name}) from exc
            except BaseException:
                conn.close()
                raise
            return self._parse_head(conn, raw, read_timeout)
        raise EngineError(f"engine {self.name}: could not send the request")  # pragma: no cover

    def _parse_head(self, conn: _Conn, raw: bytes, read_timeout: float) -> RawResponse:
        lines = raw.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            conn.close()
            raise EngineError(f"engine {self.name}: not an HTTP/1.1 response: {lines[0][:80]!r}",
                              details={"engine_id": self.name})
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            if b":" in line:
                k, v = line.split(b":", 1)
                headers[k.strip().lower()] = v.strip()
        return RawResponse(self, conn, int(parts[1]), headers, read_timeout)

    def close(self) -> None:
        for c in self._idle:
            c.close()
        self._idle.clear()
