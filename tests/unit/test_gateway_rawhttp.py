"""The raw /generate HTTP client against a real loopback socket server."""

import asyncio

import pytest

from rollout_gateway.engines.rawhttp import RawHttpPool
from rollout_gateway.errors import EngineError, Timeout


BIG_LEN = 9 << 20  # beyond the client's stream buffer limit (4 MiB) on purpose
BIG = bytes(range(256)) * (BIG_LEN // 256)


class Server:
    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")]
                        [0].split(b":")[1])
                body = await reader.readexactly(n)
                path = head.split(b" ")[1]
                self.requests.append(body)
                if path == b"/cl":
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello")
                elif path == b"/chunked":
                    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                                 b"3\r\nabc\r\n2;ext=1\r\nde\r\n0\r\n\r\n")
                elif path == b"/close-after":
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    await writer.drain()
                    writer.close()  # idle keep-alive connection dropped by the server
                    return
                elif path == b"/garbage":
                    writer.write(b"SPEAK FRIEND\r\n\r\n")
                elif path == b"/cut":
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten b")
                    await writer.drain()
                    writer.close()
                    return
                elif path == b"/big":  # a large body in many pieces, some time apart
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % BIG_LEN)
                    for i in range(0, BIG_LEN, 1 << 16):
                        writer.write(BIG[i:i + (1 << 16)])
                        await writer.drain()
                        if i % (1 << 20) == 0:
                            await asyncio.sleep(0.01)
                elif path == b"/bad-length":
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5x\r\n\r\nhello")
                elif path == b"/slow":
                    await asyncio.sleep(2)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass


@pytest.fixture
async def server():
    s = Server()
    srv = await asyncio.start_server(s.handle, "127.0.0.1", 0)
    s.port = srv.sockets[0].getsockname()[1]
    yield s
    srv.close()


async def test_bodies_and_keep_alive(server):
    pool = RawHttpPool("t", "127.0.0.1", server.port, connect_timeout=2)
    r = await pool.post("/cl", b'{"a":1}', read_timeout=2)
    assert r.status == 200 and await r.read() == b"hello"
    r = await pool.post("/chunked", b"{}", read_timeout=2)
    assert [c async for c in r.iter_bytes()] == [b"abc", b"de"]
    assert server.connections == 1 and server.requests == [b'{"a":1}', b"{}"]
    pool.close()


async def test_a_large_body_arrives_whole_and_the_connection_is_reused(server):
    pool = RawHttpPool("t", "127.0.0.1", server.port, connect_timeout=2)
    for _ in range(2):
        r = await pool.post("/big", b"{}", read_timeout=5)
        assert await r.read() == BIG
    assert await (await pool.post("/cl", b"{}", read_timeout=2)).read() == b"hello"
    assert server.connections == 1
    r = await pool.post("/bad-length", b"{}", read_timeout=2)
    with pytest.raises(EngineError, match="bad Content-Length"):
        await r.read()
    pool.close()


async def test_a_dropped_idle_connection_is_retried_on_a_fresh_one(server):
    pool = RawHttpPool("t", "127.0.0.1", server.port, connect_timeout=2)
    assert await (await pool.post("/close-after", b"{}", read_timeout=2)).read() == b"ok"
    await asyncio.sleep(0.05)
    assert await (await pool.post("/cl", b"{}", read_timeout=2)).read() == b"hello"
    assert server.connections == 2
    pool.close()


async def test_garbage_cut_bodies_timeouts_and_refused_connections(server):
    pool = RawHttpPool("t", "127.0.0.1", server.port, connect_timeout=2)
    with pytest.raises(EngineError, match="not an HTTP"):
        await pool.post("/garbage", b"{}", read_timeout=2)
    r = await pool.post("/cut", b"{}", read_timeout=2)
    with pytest.raises(EngineError) as e:
        await r.read()
    assert e.value.details["dropped"] is True
    with pytest.raises(Timeout):
        await pool.post("/slow", b"{}", read_timeout=0.2)
    pool.close()
    dead = RawHttpPool("t", "127.0.0.1", 1, connect_timeout=2)
    with pytest.raises(EngineError, match="cannot connect"):
        await dead.post("/cl", b"{}", read_timeout=1)


def test_a_dropped_idle_connection_is_retried_under_uvloop():
    """The gateway runs on uvloop (fast_io), whose transports refuse writes once closed."""
    uvloop = pytest.importorskip("uvloop")

    async def main():
        for test in (test_a_dropped_idle_connection_is_retried_on_a_fresh_one,
                     test_a_large_body_arrives_whole_and_the_connection_is_reused,
                     test_garbage_cut_bodies_timeouts_and_refused_connections):
            s = Server()
            srv = await asyncio.start_server(s.handle, "127.0.0.1", 0)
            s.port = srv.sockets[0].getsockname()[1]
            try:
                await test(s)
            finally:
                srv.close()

    uvloop.run(main())


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request (its body read and dropped); returns its head."""
    head = await reader.readuntil(b"\r\n\r\n")
    n = int(next(h for h in head.split(b"\r\n")
                 if h.lower().startswith(b"content-length")).split(b":")[1])
    await reader.readexactly(n)
    return head


class Closer:
    """Answers each connection's first request; on a later one it closes the connection
    without answering ("drop"), or after half a response head ("half")."""

    def __init__(self, later: str) -> None:
        self.later = later
        self.connections = 0
        self.requests = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                head = await read_request(reader)
                self.requests += 1
                if served and self.later == "half":
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-le")
                if served or head.startswith(b"POST /drop"):
                    await writer.drain()
                    writer.close()
                    return
                served += 1
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass


async def serve(handler):
    srv = await asyncio.start_server(handler.handle, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1]


async def test_a_reused_connection_closed_as_the_request_went_out_is_resent_fresh():
    """The engine closes an idle connection just as a request is sent on it (nothing of
    the answer arrived): the request goes again on a freshly dialled connection, once."""
    closer = Closer("drop")
    srv, port = await serve(closer)
    pool = RawHttpPool("t", "127.0.0.1", port, connect_timeout=2)
    try:
        assert await (await pool.post("/cl", b"{}", read_timeout=2)).read() == b"ok"
        conn = pool._idle[-1]
        conn.io.reusable = lambda: True  # the close is not visible yet: it races the send
        assert await (await pool.post("/cl", b"{}", read_timeout=2)).read() == b"ok"
        assert pool.counters == {"dialled": 2, "reused": 1, "stale": 0, "resent": 1}
        assert closer.connections == 2 and closer.requests == 3
        # the same on a fresh connection is the engine's failure: not sent again
        fresh = RawHttpPool("t", "127.0.0.1", port, connect_timeout=2)
        with pytest.raises(EngineError, match="closed before a response"):
            await fresh.post("/drop", b"{}", read_timeout=2)
        assert closer.requests == 4 and fresh.counters["resent"] == 0
        fresh.close()
    finally:
        pool.close()
        srv.close()


async def test_a_reused_connection_cut_after_answer_bytes_is_not_resent():
    closer = Closer("half")
    srv, port = await serve(closer)
    pool = RawHttpPool("t", "127.0.0.1", port, connect_timeout=2)
    try:
        assert await (await pool.post("/cl", b"{}", read_timeout=2)).read() == b"ok"
        pool._idle[-1].io.reusable = lambda: True
        with pytest.raises(EngineError):
            await pool.post("/cl", b"{}", read_timeout=2)
        assert closer.requests == 2 and pool.counters["resent"] == 0
    finally:
        pool.close()
        srv.close()


async def test_a_connection_idle_past_keep_alive_s_is_not_reused(server, monkeypatch):
    import time

    import rollout_gateway.engines.rawhttp as rawhttp

    ahead = [0.0]  # the pool's clock runs this far ahead of the real one

    class Clock:
        @staticmethod
        def monotonic() -> float:
            return time.monotonic() + ahead[0]

    monkeypatch.setattr(rawhttp, "time", Clock)
    pool = RawHttpPool("t", "127.0.0.1", server.port, connect_timeout=2, keep_alive_s=5.0)
    assert await (await pool.post("/cl", b"{}", read_timeout=2)).read() == b"hello"
    assert await (await pool.post("/cl", b"{}", read_timeout=2)).read() == b"hello"
    assert server.connections == 1  # reused within the bound
    ahead[0] = 5.0  # idle past the bound (the server itself keeps it open)
    assert await (await pool.post("/cl", b"{}", read_timeout=2)).read() == b"hello"
    assert server.connections == 2
    assert pool.counters == {"dialled": 2, "reused": 1, "stale": 1, "resent": 0}
    pool.close()


async def test_a_close_not_yet_read_by_the_event_loop_is_seen_on_the_socket():
    """The peer closed the idle connection while its FIN still waits in the socket (the
    event loop has not read it): the socket check sees it, and a fresh one is dialled."""
    closed = asyncio.Event()
    connections = 0

    async def handle(reader, writer):
        nonlocal connections
        connections += 1
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        if connections == 1:  # the first connection: closed once idle (a keep-alive timeout)
            writer.close()
            await writer.wait_closed()
            closed.set()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    pool = RawHttpPool("t", "127.0.0.1", srv.sockets[0].getsockname()[1], connect_timeout=2)
    try:
        resp = await pool.post("/cl", b"{}", read_timeout=2)
        resp._conn.io.transport.pause_reading()  # the FIN will stay unread in the socket
        assert await resp.read() == b"ok"
        await closed.wait()
        assert not pool._idle[-1].io._eof  # the protocol has not seen the close
        assert await (await pool.post("/cl", b"{}", read_timeout=2)).read() == b"ok"
        assert connections == 2
        assert pool.counters == {"dialled": 2, "reused": 0, "stale": 1, "resent": 0}
    finally:
        pool.close()
        srv.close()


def test_stale_connection_checks_under_uvloop():
    """The same keep-alive rules on uvloop (the gateway's loop), whose transports hand out
    a pseudo-socket."""
    uvloop = pytest.importorskip("uvloop")

    async def main():
        await test_a_reused_connection_closed_as_the_request_went_out_is_resent_fresh()
        await test_a_reused_connection_cut_after_answer_bytes_is_not_resent()
        await test_a_close_not_yet_read_by_the_event_loop_is_seen_on_the_socket()

    uvloop.run(main())
