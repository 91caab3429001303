"""RawConnection (the engine client's buffered protocol) over a real loopback socket:
every mix of reads returns exactly the bytes sent, whatever the socket's chunking."""

from __future__ import annotations

import asyncio
import random

import pytest

from rollout_gateway import native
from rollout_gateway.engines import rawconn
from rollout_gateway.engines.rawconn import RawConnection


async def _pair(chunks: list[bytes], *, close: bool = True, limit: int = 1 << 16,
                gap: float = 0.0):
    """A server that sends ``chunks`` (then closes), and a RawConnection to it."""
    async def handle(reader, writer):
        for c in chunks:
            writer.write(c)
            await writer.drain()
            if gap:
                await asyncio.sleep(gap)
        if close:
            writer.close()
        else:
            await asyncio.sleep(30)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, conn = await asyncio.get_running_loop().create_connection(
        lambda: RawConnection(limit), "127.0.0.1", port)
    return server, conn


@pytest.fixture(params=["landing", "buffered"])
def landing(request, monkeypatch) -> bool:
    """Large reads land in their own bytes object (native data plane; lowered to 1000
    bytes here so that random reads take both paths) or are copied out of the buffer."""
    if request.param == "buffered":
        monkeypatch.setattr(native, "impl", None)
        return False
    _land_from_1000(monkeypatch)
    return True


def _land_from_1000(monkeypatch) -> None:
    monkeypatch.setattr(native, "impl", native.compiled())  # built by pip install
    monkeypatch.setattr(rawconn, "LAND_MIN", 1000)


@pytest.mark.parametrize("seed", range(6))
async def test_random_reads_return_the_stream_in_order(seed: int, landing: bool) -> None:
    rng = random.Random(seed)
    lines = [bytes(rng.choice(b"abcdef0123") for _ in range(rng.randint(0, 3000))) + b"\r\n"
             for _ in range(60)]
    stream = b"".join(lines)
    cuts = sorted(rng.sample(range(1, len(stream)), 40))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
    server, conn = await _pair(chunks, gap=0.001)
    got, pos = [], 0
    try:
        while pos < len(stream):
            op = rng.random()
            if op < 0.4:
                part = await conn.readuntil(b"\r\n")
            elif op < 0.7:
                part = await conn.readexactly(min(rng.randint(1, 20000), len(stream) - pos))
            else:
                part = await conn.read(rng.randint(1, 50000))
            assert part == stream[pos:pos + len(part)] and part
            got.append(part)
            pos += len(part)
        assert b"".join(got) == stream
        assert await conn.read(10) == b""  # end of stream
        with pytest.raises(asyncio.IncompleteReadError):
            await conn.readexactly(1)
    finally:
        conn.close()
        server.close()


async def test_large_bodies_pause_and_resume_the_socket() -> None:
    body = bytes(range(256)) * (40_000)  # 10 MB against a 64 KiB limit
    server, conn = await _pair([body[i:i + 1_000_000] for i in range(0, len(body), 1_000_000)])
    try:
        assert await conn.readexactly(len(body)) == body
    finally:
        conn.close()
        server.close()


async def test_limits_cut_streams_and_timeouts() -> None:
    server, conn = await _pair([b"x" * 200_000], limit=1 << 16)
    try:
        with pytest.raises(asyncio.LimitOverrunError):
            await conn.readuntil(b"\r\n")  # no separator within the limit
    finally:
        conn.close()
        server.close()
    server, conn = await _pair([b"HTTP/1.1 200 OK\r\nhead"])
    try:
        assert await conn.readuntil(b"\r\n") == b"HTTP/1.1 200 OK\r\n"
        with pytest.raises(asyncio.IncompleteReadError) as e:
            await conn.readexactly(100)
        assert e.value.partial == b"head"
    finally:
        conn.close()
        server.close()
    server, conn = await _pair([b"abc"], close=False)
    try:  # a timed-out read consumes nothing: the retry gets the bytes
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await conn.readexactly(5)
        assert await conn.read(10) == b"abc"
        conn.abort()
        await asyncio.sleep(0.05)
        assert conn.is_closing()
    finally:
        server.close()


async def test_an_idle_connection_gives_back_a_grown_buffer() -> None:
    server, conn = await _pair([b"y" * 3_000_000])
    try:
        assert len(await conn.readexactly(3_000_000)) == 3_000_000
        conn.trim(1 << 20)
        assert len(conn._buf) <= 1 << 20
    finally:
        conn.close()
        server.close()


async def test_writing_to_a_connection_the_peer_closed_is_a_connection_error() -> None:
    server, conn = await _pair([b"bye"])
    try:
        assert await conn.read(10) == b"bye"
        assert await conn.read(10) == b""  # the peer closed
        with pytest.raises(ConnectionResetError):
            conn.write(b"GET / HTTP/1.1\r\n\r\n")
    finally:
        conn.close()
        server.close()


def test_the_buffer_pool_is_bounded_and_hands_out_big_enough_buffers() -> None:
    from rollout_gateway.engines.rawconn import _BufferPool

    pool = _BufferPool(cap=10)
    pool.give(bytearray(4))
    pool.give(bytearray(6))
    pool.give(bytearray(3))  # over the cap: dropped
    assert len(pool.take(5, 1)) == 6  # the first that fits
    assert len(pool.take(5, 8)) == 8  # none fits: a new one, of the wanted size
    assert len(pool.take(1, 1)) == 4 and pool._bytes == 0


@pytest.mark.parametrize("how", ["readexactly", "wait_more"])
async def test_a_large_body_lands_in_place_without_moving(how: str,
                                                          monkeypatch) -> None:
    """A body whose length is known is reserved whole once: the socket reads that fill it
    (each asking get_buffer for free space) never move what already arrived to a new
    buffer (they had moved the whole 2.6 MB final event of every streamed answer once)."""
    moved: list[int] = []
    real = RawConnection._reserve

    def spy(self, free: int) -> None:
        if len(self._buf) - self._end < free:
            moved.append(self._end - self._start)
        real(self, free)

    monkeypatch.setattr(RawConnection, "_reserve", spy)
    body = bytes(range(256)) * 12_000  # 3 MB, sent in 100 KB writes, then what follows it
    tail = b"0\r\n\r\n"  # (a chunked body's end, the next event)
    server, conn = await _pair([body[i:i + 100_000] for i in range(0, len(body), 100_000)]
                               + [tail], limit=8 << 20)
    try:
        if how == "readexactly":
            assert await conn.readexactly(len(body)) == body
            assert await conn.readexactly(len(tail)) == tail
        else:  # as rawhttp's chunked reader: wait for the rest of a chunk of known size
            while conn.unread < len(body):
                await conn.wait_more(len(body) - conn.unread)
            while conn.unread < len(body) + len(tail):
                await conn.wait_more(len(body) + len(tail) - conn.unread)
            buf, start, end = conn.unread_bytes()
            assert bytes(buf[start:end]) == body + tail
        big = [m for m in moved if m > 256 << 10]
        assert not big, f"moved {big} bytes already received"
    finally:
        conn.close()
        server.close()


async def test_a_landing_read_cancelled_midway_goes_on_when_retried(monkeypatch) -> None:
    """A read timed out half way (the engine paused for a swap) and retried returns the
    whole body: what had landed is not lost; another read is refused meanwhile."""
    _land_from_1000(monkeypatch)
    body = bytes(range(256)) * 40
    more = asyncio.Event()

    async def handle(reader, writer):
        writer.write(body[:3000])
        await writer.drain()
        await more.wait()
        writer.write(body[3000:] + b"after")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    _, conn = await asyncio.get_running_loop().create_connection(
        lambda: RawConnection(1 << 16), "127.0.0.1", server.sockets[0].getsockname()[1])
    try:
        task = asyncio.create_task(conn.readexactly(len(body)))
        while conn.unread < 3000:  # until the first part has landed
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert conn.unread == 3000 and not conn.reusable()
        with pytest.raises(RuntimeError, match="unfinished"):
            await conn.land(len(body) + 1)
        more.set()
        got = await conn.readexactly(len(body))
        assert got == body and type(got) is bytes
        assert await conn.readexactly(5) == b"after"
    finally:
        conn.close()
        server.close()


async def test_a_landing_read_cut_short_raises_with_what_arrived(landing: bool) -> None:
    body = b"x" * 5000
    server, conn = await _pair([body[:2500]])
    try:
        with pytest.raises(asyncio.IncompleteReadError) as err:
            await conn.readexactly(len(body))
        assert err.value.partial == body[:2500] and err.value.expected == len(body)
    finally:
        conn.close()
        server.close()


def test_native_land_hands_out_a_bytes_object_and_its_storage() -> None:
    data, writer = native.compiled().land(5)
    assert type(data) is bytes and len(data) == 5
    with memoryview(writer) as view:
        assert not view.readonly and view.nbytes == 5
        view[:] = b"hello"
    assert data == b"hello"
    del data  # the writer keeps the storage alive while a view of it exists
    with memoryview(writer) as view:
        view[:2] = b"ok"
        assert bytes(view) == b"okllo"
    assert native.compiled().land(0)[0] == b""
    with pytest.raises(ValueError, match="n must be >= 0"):
        native.compiled().land(-1)
