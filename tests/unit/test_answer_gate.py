"""AnswerGate: large engine answers are read a bounded number at a time (the rest wait in
their sockets), against a real loopback HTTP server; slots always come back."""

import asyncio

import orjson
import pytest

from rollout_gateway.engines.client import AnswerGate, EngineClient
from rollout_gateway.errors import EngineError

BIG = 1 << 20  # the final event's payload: larger than the gate's threshold


def sse(big: int) -> bytes:
    small = [orjson.dumps({"i": i}) for i in range(3)]
    final = b'{"routed_experts":"' + b"A" * big + b'"}'
    return b"".join(b"data: " + p + b"\n\n" for p in [*small, final]) + b"data: [DONE]\n\n"


class Server:
    """POST /generate -> an SSE body (Content-Length, or chunked with one chunk per event
    as uvicorn sends SGLang's); rid "cut" gets half of it, then the connection closes;
    a non-streamed request gets a large JSON body."""

    def __init__(self, chunked: bool) -> None:
        self.chunked = chunked
        self.sent = 0
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = int(next(h for h in head.split(b"\r\n")
                             if h.lower().startswith(b"content-length")).split(b":")[1])
                body = orjson.loads(await reader.readexactly(n))
                data = sse(BIG) if body.get("stream") else b'{"x":"' + b"B" * BIG + b'"}'
                cut = body.get("rid") == "cut"
                if self.chunked and body.get("stream"):
                    events = [e + b"\n\n" for e in data.split(b"\n\n") if e]
                    data = b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
                    head = b"transfer-encoding: chunked"
                else:
                    head = b"content-length: %d" % len(data)
                writer.write(b"HTTP/1.1 200 OK\r\n%b\r\n\r\n" % head)
                writer.write(data[:len(data) // 2] if cut else data)
                await writer.drain()
                self.sent += 1
                if cut:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass


@pytest.fixture(params=[False, True], ids=["content-length", "chunked"])
async def server(request):
    s = Server(request.param)
    srv = await asyncio.start_server(s.handle, "127.0.0.1", 0)
    s.url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    yield s
    srv.close()


async def test_a_second_large_answer_waits_unread_until_the_first_is_taken(server):
    gate = AnswerGate(1)
    a = EngineClient("a", server.url, gate=gate)
    b = EngineClient("b", server.url, gate=gate)
    sa = a.generate_stream({"rid": "a"})
    got_a = [await anext(sa) for _ in range(4)]  # the large payload: A's consumer holds it
    assert len(got_a[-1]) > BIG and gate.busy == 1
    got_b: list[bytes] = []

    async def read_b() -> None:
        async for p in b.generate_stream({"rid": "b"}):
            got_b.append(p)

    task = asyncio.create_task(read_b())
    for _ in range(200):  # B gets at most its small events, then waits for the slot
        await asyncio.sleep(0.01)
        if gate.waiting:
            break
    assert gate.waiting == 1 and len(got_b) < 4
    assert [p async for p in sa] == []  # A asks for more: [DONE], its slot comes back
    await asyncio.wait_for(task, 5)
    assert len(got_b) == 4 and got_b[-1] == got_a[-1]
    assert gate.busy == 0 and gate.waiting == 0
    await a.close()
    await b.close()


async def test_slots_come_back_after_a_stream_cut_mid_event_and_after_a_large_body(server):
    gate = AnswerGate(1)
    c = EngineClient("c", server.url, gate=gate)
    with pytest.raises(EngineError):
        async for _ in c.generate_stream({"rid": "cut"}):
            pass
    assert gate.busy == 0
    body = await c.generate({"rid": "plain"})
    assert len(body) > BIG and gate.busy == 0
    # a consumer that stops early (closes the stream while holding a slot) frees it too
    s = c.generate_stream({"rid": "early"})
    [await anext(s) for _ in range(4)]
    assert gate.busy == 1
    await s.aclose()
    assert gate.busy == 0
    await c.close()


def test_a_gate_needs_a_slot():
    with pytest.raises(ValueError):
        AnswerGate(0)


async def test_a_stream_read_to_its_end_gives_its_connection_back(server):
    c = EngineClient("c", server.url, gate=AnswerGate(2))
    for rid in ("one", "two", "three"):
        assert len([p async for p in c.generate_stream({"rid": rid})]) == 4
        assert len(c.transport._idle) == 1 and not c.transport._busy
    assert server.connections == 1  # one kept-alive connection, not one per stream
    await c.close()
