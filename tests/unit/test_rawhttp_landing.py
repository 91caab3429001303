"""A streamed answer's large one-line event lands whole (``RawResponse.iter_events`` with the
native data plane: its payload is received straight into its own bytes object, never
copied out of the connection's buffer). Over a real loopback socket, however the body is
cut into chunks and the chunks into writes, the payloads equal the SSE splitter's over the
de-chunked body and the Python data plane's; a chunk that only looked like one event, bad
framing after a landed payload, and a connection cut mid-payload are handled as before."""

from __future__ import annotations

import asyncio
import random

import pytest
from _sse_support import chunked

from rollout_gateway import native
from rollout_gateway.engines import rawconn
from rollout_gateway.engines.rawconn import RawConnection
from rollout_gateway.engines.rawhttp import RawHttpPool
from rollout_gateway.engines.sse import SSEPayloads
from rollout_gateway.errors import EngineError


class Streamer:
    """Answers each request with the next queued raw response, written in the given
    pieces, each once the client waits for more bytes (so that each arrives as a socket
    read of its own, whatever the loopback's timing)."""

    def __init__(self, monkeypatch) -> None:
        self.answers: list[list[bytes]] = []
        self.asked = asyncio.Event()
        real_wait = RawConnection._wait

        async def wait(conn):
            self.asked.set()
            await real_wait(conn)

        monkeypatch.setattr(RawConnection, "_wait", wait)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                n = int(next(h for h in head.split(b"\r\n")
                             if h.lower().startswith(b"content-length")).split(b":")[1])
                await reader.readexactly(n)
                pieces = self.answers.pop(0)
                for i, piece in enumerate(pieces):
                    self.asked.clear()
                    writer.write(piece)
                    await writer.drain()
                    if i < len(pieces) - 1:
                        await self.asked.wait()
            writer.close()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass


def _pieces(wire: bytes, rng: random.Random) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(wire)), min(len(wire) - 1, rng.randint(0, 12))))
    return [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)])]


_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _event(rng: random.Random) -> bytes:
    size = rng.choice([3, 40, 900, 3000, 20_000])
    payload = b"{" + bytes(rng.choice(b"abc 019,:") for _ in range(size)) + b"}"
    lead = rng.choice([b" ", b"", b"  \t"])
    trail = rng.choice([b"", b"", b" ", b"\r"])
    if rng.random() < 0.1:  # an event of two data lines (joined by the splitter)
        return b"data: " + payload[:size // 2] + b"\ndata:" + lead + payload[size // 2:] + b"\n\n"
    end = b"\r\n\r\n" if rng.random() < 0.1 else b"\n\n"
    return b"data:" + lead + payload + trail + end


async def _payloads(port: int) -> list[bytes]:
    pool = RawHttpPool("t", "127.0.0.1", port, connect_timeout=2)
    try:
        resp = await pool.post("/generate", b"{}", read_timeout=5)
        got = [p async for batch in resp.iter_events() for p in batch]
        assert pool._idle, "the connection goes back to the pool after the stream"
        return got
    finally:
        pool.close()


@pytest.mark.parametrize("seed", range(20))
async def test_landed_payloads_equal_the_splitters_and_the_python_planes(seed, monkeypatch):
    rng = random.Random(seed)
    events = [_event(rng) for _ in range(rng.randint(1, 6))]
    body = b"".join(events)
    if rng.random() < 0.5:  # one chunk per event, as uvicorn (SGLang) sends them
        cuts, pos = [], 0
        for e in events:
            pos += len(e)
            cuts.append(pos)
    else:
        cuts = rng.sample(range(1, len(body)), min(len(body) - 1, rng.randint(0, 5)))
    wire = _HEAD + chunked(body, cuts)
    pieces = _pieces(wire, rng)
    want = SSEPayloads().feed(body)
    landed: list[int] = []
    real_land = RawConnection.land

    async def spy(self, n):
        landed.append(n)
        return await real_land(self, n)

    monkeypatch.setattr(RawConnection, "land", spy)
    monkeypatch.setattr(rawconn, "LAND_MIN", 1000)
    server = Streamer(monkeypatch)
    server.answers = [pieces, pieces]
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        with native.using("native"):
            got_native = await _payloads(port)
        with native.using("python"):
            got_python = await _payloads(port)
    finally:
        srv.close()
    assert got_native == want == got_python
    assert all(type(p) is bytes for p in got_native)
    assert len(landed) <= len(events)


async def test_a_uvicorn_style_final_event_is_the_landed_object_itself(monkeypatch):
    """One chunk per event, the large final one arriving over several socket reads: its
    payload is the bytes object the socket received into (no copy), and equal."""
    small = b"data: {\"a\": 1}\n\n"
    big = b"data: {\"routed\": \"" + b"QUJD" * 5000 + b"\"}\n\n"
    wire = _HEAD + b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in (small, big)) + b"0\r\n\r\n"
    cut = wire.index(b"QUJD") + 100
    landed: list[bytes] = []
    real_land = RawConnection.land

    async def spy(self, n):
        landed.append(await real_land(self, n))
        return landed[-1]

    monkeypatch.setattr(RawConnection, "land", spy)
    got = await _one([wire[:cut], wire[cut:cut + 7000], wire[cut + 7000:]], monkeypatch)
    assert got == [b'{"a": 1}', big[6:-2]]
    assert len(landed) == 1 and got[1] is landed[0]


async def _one(wire_pieces: list[bytes], monkeypatch) -> list[bytes]:
    """The payloads of one streamed answer sent in ``wire_pieces`` (native data plane),
    then the error if it fails."""
    monkeypatch.setattr(rawconn, "LAND_MIN", 1000)
    server = Streamer(monkeypatch)
    server.answers = [wire_pieces]
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    pool = RawHttpPool("t", "127.0.0.1", srv.sockets[0].getsockname()[1], connect_timeout=2)
    got: list[bytes] = []
    try:
        with native.using("native"):
            resp = await pool.post("/generate", b"{}", read_timeout=5)
            async for batch in resp.iter_events():
                got += batch
    except EngineError as exc:
        got.append(str(exc).encode())
    finally:
        pool.close()
        srv.close()
    return got


async def test_a_landed_chunk_with_bad_framing_after_it_is_a_dropped_stream(monkeypatch):
    small = b"data: 1\n\n"
    big = b"data: {" + b"7" * 5000 + b"}\n\n"
    wire = _HEAD + b"%x\r\n%b\r\n" % (len(small), small) + b"%x\r\n%bXY" % (len(big), big)
    got = await _one([wire[:len(_HEAD) + 40], wire[len(_HEAD) + 40:]], monkeypatch)
    assert got[0] == b"1" and b"malformed chunked body" in got[-1] and len(got) == 2


async def test_a_connection_cut_mid_payload_keeps_the_events_before_it(monkeypatch):
    small = b"data: 1\n\n"
    big = b"data: {" + b"7" * 50_000 + b"}\n\n"
    wire = _HEAD + b"%x\r\n%b\r\n" % (len(small), small) + b"%x\r\n%b" % (len(big), big)
    got = await _one([wire[:len(_HEAD) + 40], wire[len(_HEAD) + 40:-20_000]], monkeypatch)
    assert got[0] == b"1" and b"connection broke mid-response" in got[-1] and len(got) == 2
