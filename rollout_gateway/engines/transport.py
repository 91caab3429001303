"""How :class:`~rollout_gateway.engines.client.EngineClient` talks HTTP to one engine.

One small interface, :class:`Transport`, with two implementations chosen once, when the
client is built (:func:`open_transport`): :class:`~rollout_gateway.engines.rawhttp.RawHttpPool`
for plain http (the fast path: answers received straight into reused buffers) and
:class:`HttpxTransport` for https. Every failure leaves a transport as
:class:`EngineError` or :class:`Timeout`; nothing above it sees a transport's exceptions.

Keep-alive, both ways: a pooled connection idle for ``keep_alive_s`` is not reused
(engines close idle connections: uvicorn and SGLang after 5 s), nor is one the peer
closed while it was idle, and a request whose reused connection the peer closed before
any answer byte is sent again once on a fresh connection.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Protocol
from urllib.parse import urlsplit

import httpx

from rollout_gateway.engines.rawhttp import RawHttpPool
from rollout_gateway.engines.sse import SSEPayloads
from rollout_gateway.errors import EngineError, Timeout

#: ``before_read(unread)``: awaited before the body is read on; returns whether it may be
#: buffered freely for now (see :meth:`Response.iter_bytes`)
BeforeRead = Callable[[int], Awaitable[bool]]


class Response(Protocol):
    """An answer whose head arrived; its body is read once, whole or as it arrives."""

    status: int

    @property
    def content_length(self) -> int | None:
        """The body's size when the head announced it, else None."""

    async def read(self) -> bytes:
        """The whole body."""

    def iter_bytes(self, before_read: BeforeRead | None = None) -> AsyncIterator[bytes]:
        """The body as it arrives. ``before_read(unread)`` is awaited before each read once
        the previous piece was taken, with the bytes received and not read yet; it may
        hold the body back (the rest then waits in the socket) and returns whether the
        body may be buffered freely for now."""

    def iter_events(self, before_read: BeforeRead | None = None
                    ) -> AsyncIterator[list[bytes]]:
        """The body's SSE payloads (:mod:`~rollout_gateway.engines.sse` framing), in
        batches as they arrive (every event already received in one batch);
        ``before_read`` as for :meth:`iter_bytes`, counting the event still incomplete."""

    async def aclose(self) -> None:
        """Done with the answer (read or not); idempotent."""


class Transport(Protocol):
    """HTTP/1.1 to one engine: requests, breaking off those in flight, closing."""

    async def request(self, method: str, path: str, body: bytes | None = None, *,
                      read_timeout: float, first_timeout: float | None = None,
                      patience: Callable[[], bool] | None = None,
                      abortable: bool = True) -> Response:
        """Send ``method path`` with a JSON ``body``; return once the answer's head
        arrived. ``first_timeout`` (default ``read_timeout``) bounds the wait for the head
        and the first body read, ``read_timeout`` each later read; ``patience()`` true
        waives a deadline (the engine is paused for a swap). ``abortable``: broken off by
        :meth:`abort_active`."""

    def abort_active(self, why: str) -> int:
        """Break off every abortable request in flight (they fail at once, as dropped);
        returns how many."""

    async def aclose(self) -> None:
        """Close every connection."""


@contextlib.contextmanager
def _mapped(name: str, *, dropped: bool = False) -> Iterator[None]:
    """httpx's exceptions as ours (``dropped``: the answer had begun)."""
    details = {"engine_id": name, **({"dropped": True} if dropped else {})}
    try:
        yield
    except httpx.TimeoutException as exc:
        raise Timeout(f"engine {name}: timed out ({type(exc).__name__})",
                      details=details) from exc
    except httpx.HTTPError as exc:
        raise EngineError(f"engine {name}: {type(exc).__name__}: {exc}",
                          details=details) from exc


class _HttpxResponse:
    """An httpx answer opened with ``stream=True`` (``owner``: a one-off client closed
    with it)."""

    def __init__(self, name: str, resp: httpx.Response,
                 owner: httpx.AsyncClient | None = None) -> None:
        self._name = name
        self._resp = resp
        self._owner = owner
        self.status = resp.status_code

    @property
    def content_length(self) -> int | None:
        v = self._resp.headers.get("content-length", "")
        return int(v) if v.isdigit() else None

    async def read(self) -> bytes:
        try:
            with _mapped(self._name, dropped=True):
                return await self._resp.aread()
        finally:
            await self.aclose()

    async def iter_bytes(self, before_read: BeforeRead | None = None) -> AsyncIterator[bytes]:
        try:
            with _mapped(self._name, dropped=True):
                async for chunk in self._resp.aiter_bytes():
                    yield chunk
                    del chunk
                    if before_read is not None:
                        await before_read(0)  # httpx buffers on its own
        finally:
            await self.aclose()

    async def iter_events(self, before_read: BeforeRead | None = None
                          ) -> AsyncIterator[list[bytes]]:
        split = SSEPayloads()
        async for chunk in self.iter_bytes(before_read):
            out = split.feed(chunk)
            del chunk
            if out:
                yield out
            out = None

    async def aclose(self) -> None:
        await self._resp.aclose()
        if self._owner is not None:
            await self._owner.aclose()


#: httpx errors that mean "the peer closed or reset the connection" (not a timeout)
_CLOSED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class HttpxTransport:
    """httpx (https engines). httpcore reuses a pooled connection only if it is not
    readable while idle and younger than ``keep_alive_s``; a request that fails as closed
    by the peer before any answer byte on a reused connection (seen through httpcore's
    trace: no connect for it) is sent again once on a freshly dialled connection. No
    ``patience``: a paused engine's silence counts against the timeouts."""

    def __init__(self, name: str, url: str, *, connect_timeout: float, keep_alive_s: float,
                 headers: dict[str, str] | None = None) -> None:
        self.name = name
        self._connect_s = connect_timeout
        self._args = {"base_url": url, "headers": headers or {}}
        self._http = httpx.AsyncClient(**self._args, limits=httpx.Limits(
            max_connections=1024, max_keepalive_connections=256, keepalive_expiry=keep_alive_s))
        self.counters = {"resent": 0}

    def _timeout(self, first: float | None, read: float) -> httpx.Timeout:
        return httpx.Timeout(max(first or 0.0, read), connect=self._connect_s,
                             pool=self._connect_s)

    async def request(self, method: str, path: str, body: bytes | None = None, *,
                      read_timeout: float, first_timeout: float | None = None,
                      patience: Callable[[], bool] | None = None,
                      abortable: bool = True) -> Response:
        dialled: list[str] = []

        async def trace(event: str, info: dict) -> None:
            if event.startswith("connection.connect_tcp."):
                dialled.append(event)

        req = self._http.build_request(
            method, path, content=body, timeout=self._timeout(first_timeout, read_timeout),
            headers={"Content-Type": "application/json"} if body is not None else None,
            extensions={"trace": trace})
        try:
            with _mapped(self.name):
                return _HttpxResponse(self.name, await self._http.send(req, stream=True))
        except EngineError as exc:
            if dialled or not isinstance(exc.__cause__, _CLOSED):
                raise
        # a reused connection the peer closed as the request went out: once more, fresh
        self.counters["resent"] += 1
        fresh = httpx.AsyncClient(**self._args, limits=httpx.Limits(max_keepalive_connections=0))
        try:
            with _mapped(self.name):
                return _HttpxResponse(self.name, await fresh.send(req, stream=True), fresh)
        except BaseException:
            await fresh.aclose()
            raise

    def abort_active(self, why: str) -> int:
        return 0  # httpx cannot break a read off from outside: the read timeouts bound it

    async def aclose(self) -> None:
        await self._http.aclose()


def open_transport(name: str, url: str, *, connect_timeout: float, keep_alive_s: float,
                   headers: dict[str, str] | None = None) -> Transport:
    """The transport for ``url``: the raw keep-alive client for plain http, httpx for
    https."""
    u = urlsplit(url)
    if u.scheme == "http":
        return RawHttpPool(name, u.hostname or "127.0.0.1", u.port or 80,
                           connect_timeout=connect_timeout, keep_alive_s=keep_alive_s,
                           headers=headers, prefix=u.path)
    return HttpxTransport(name, url, connect_timeout=connect_timeout, keep_alive_s=keep_alive_s,
                          headers=headers)
