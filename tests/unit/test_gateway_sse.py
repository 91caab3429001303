"""SSE splitting of engine streams (EngineClient.generate_stream's framing)."""

from __future__ import annotations

import random

import pytest

from rollout_gateway.engines.sse import SSEPayloads
from rollout_gateway.errors import EngineError


def reference(stream: bytes) -> list[bytes]:
    """The plain definition: complete events (ended by a blank line), each one's data:
    lines (stripped) joined with a newline, as the SSE standard joins them."""
    events = stream.split(b"\n\n")[:-1]  # the last piece is not terminated yet
    data = [[line[5:].strip() for line in ev.split(b"\n") if line.startswith(b"data:")]
            for ev in events]
    return [b"\n".join(lines) for lines in data if lines]


def random_stream(rng: random.Random) -> bytes:
    parts = []
    for _ in range(rng.randint(0, 12)):
        kind = rng.random()
        body = bytes(rng.choice(b'{}"abc:, 019\t\r') for _ in range(rng.randint(0, 40)))
        body = body.replace(b"\n", b"")
        if kind < 0.5:
            ev = b"data:" + rng.choice([b"", b" ", b"  \t"]) + body + rng.choice([b"", b" ", b"\r"])
        elif kind < 0.65:
            ev = b": keep-alive"
        elif kind < 0.8:
            ev = b"event: x\ndata: " + body + b"\nid: 3"
        elif kind < 0.9:
            ev = b"data: " + body + b"\ndata:" + body[::-1]
        else:
            ev = b""
        parts.append(ev + b"\n\n")
    tail = rng.choice([b"", b"data: {partial", b"data: x\n", b"\n"])
    return b"".join(parts) + tail


@pytest.mark.parametrize("large", [1 << 16, 0])  # 0: every payload takes the large path
def test_payloads_match_the_plain_definition_for_any_chunking(monkeypatch, large):
    monkeypatch.setattr(SSEPayloads, "LARGE", large)
    rng = random.Random(7)
    for _ in range(600):
        stream = random_stream(rng)
        cuts = sorted(rng.sample(range(len(stream) + 1), min(len(stream) + 1, rng.randint(0, 8))))
        chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
        if rng.random() < 0.2:  # byte by byte
            chunks = [stream[i:i + 1] for i in range(len(stream))]
        split = SSEPayloads()
        got = [p for c in chunks for p in split.feed(c)]
        assert got == reference(stream), (stream, chunks)
        assert all(type(p) is bytes for p in got)


def test_a_chunk_per_event_as_uvicorn_sends_them():
    rng = random.Random(11)
    for _ in range(300):
        stream = random_stream(rng)
        events = [ev + b"\n\n" for ev in stream.split(b"\n\n")[:-1]]
        split = SSEPayloads()
        got = [p for ev in events for p in split.feed(ev)]
        assert got == reference(stream)
        assert all(type(p) is bytes for p in got)


def test_a_large_single_payload_arrives_whole_and_exact():
    body = b'{"meta_info": {"routed_experts": "' + b"QUJD" * 300_000 + b'"}}'
    stream = b"data: " + body + b"\n\n" + b"data: [DONE]\n\n"
    split = SSEPayloads()
    got = [p for i in range(0, len(stream), 65536) for p in split.feed(stream[i:i + 65536])]
    assert got == [body, b"[DONE]"]


class _SSEServer:
    """A loopback engine answering every /generate with one SSE body ending in [DONE]."""

    def __init__(self, framing: str) -> None:
        self.framing = framing
        self.connections = 0

    async def handle(self, reader, writer) -> None:
        import asyncio

        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = int([h for h in head.split(b"\r\n")
                         if h.lower().startswith(b"content-length")][0].split(b":")[1])
                await reader.readexactly(n)
                sse = b'data: {"a":1}\n\ndata: {"b":2}\n\ndata: [DONE]\n\n'
                if self.framing == "length":
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b"
                                 % (len(sse), sse))
                else:  # chunked; "hang": the terminating chunk never comes
                    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                                 b"%x\r\n%b\r\n" % (len(sse), sse))
                    if self.framing == "chunked":
                        writer.write(b"0\r\n\r\n")
                await writer.drain()
                if self.framing == "hang":
                    await asyncio.sleep(30)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass


@pytest.mark.parametrize("framing", ["length", "chunked", "hang"])
async def test_streamed_generate_keeps_the_engine_connection_alive(framing: str) -> None:
    import asyncio
    import time

    from rollout_gateway.engines.client import EngineClient

    srv = _SSEServer(framing)
    server = await asyncio.start_server(srv.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = EngineClient("e", f"http://127.0.0.1:{port}")
    try:
        for _ in range(3):
            t0 = time.monotonic()
            got = [p async for p in client.generate_stream({"input_ids": [1]})]
            assert got == [b'{"a":1}', b'{"b":2}']
            assert time.monotonic() - t0 < 5  # a hung body end is given up on, not awaited
        # a complete body leaves the connection reusable: one TCP connection for all three
        assert srv.connections == (3 if framing == "hang" else 1)
    finally:
        await client.close()
        server.close()


def test_crlf_line_ends_a_last_event_cut_short_and_the_size_limit():
    stream = b'data: {"a":1}\r\n\r\n: ping\r\n\r\ndata: x\r\ndata: y\r\n\r\ndata: {"b"'
    for step in (1, 3, len(stream)):
        split = SSEPayloads()
        got = [p for i in range(0, len(stream), step) for p in split.feed(stream[i:i + step])]
        assert got == [b'{"a":1}', b"x\ny"]
        assert split.close() == [b'{"b"'] and split.pending == 0
    with pytest.raises(EngineError, match="size limit"):
        SSEPayloads(limit=1024).feed(b"data: " + b"x" * 2048)
