"""Hung engines: per-phase deadlines of the raw /generate client (real loopback socket),
breaking off requests in flight, and the pool's circuit breaker (pure pool logic)."""

from __future__ import annotations

import asyncio
import time

import pytest

from rollout_gateway.engines.client import Health
from rollout_gateway.engines.pool import Engine, EnginePool, EngineState
from rollout_gateway.engines.rawhttp import RawHttpPool
from rollout_gateway.errors import EngineError, Timeout
from rollout_gateway.settings import GatewaySettings


async def stalling_server(first_chunk_after: float = 0.0):
    """Answers the head at once, one chunk after ``first_chunk_after`` s, then goes silent."""
    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        n = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")]
                [0].split(b":")[1])
        await reader.readexactly(n)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(first_chunk_after)
        writer.write(b"5\r\nfirst\r\n")
        await writer.drain()
        await asyncio.sleep(3600)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_silence_between_chunks_times_out_after_the_first_chunk_arrived():
    server, port = await stalling_server(first_chunk_after=0.3)
    pool = RawHttpPool("e", "127.0.0.1", port, connect_timeout=1)
    try:
        resp = await pool.post("/generate", b"{}", read_timeout=0.2, first_timeout=2.0)
        got = []
        t0 = time.monotonic()
        with pytest.raises(Timeout) as ei:
            async for chunk in resp.iter_bytes():  # the first chunk may take up to 2 s
                got.append(chunk)
        assert got == [b"first"]
        assert ei.value.details["dropped"] and ei.value.details["silent_s"] == 0.2
        assert time.monotonic() - t0 < 1.9  # not the first-chunk deadline (2 s): slack for load
    finally:
        pool.close()
        server.close()


async def test_patience_waives_the_silence_deadline_while_paused():
    server, port = await stalling_server()
    pool = RawHttpPool("e", "127.0.0.1", port, connect_timeout=1)
    asked = []

    def patience() -> bool:  # "paused for a swap" for the first three deadlines
        asked.append(1)
        return len(asked) <= 3

    try:
        resp = await pool.post("/generate", b"{}", read_timeout=0.1, patience=patience)
        t0 = time.monotonic()
        with pytest.raises(Timeout):
            async for _ in resp.iter_bytes():
                pass
        assert len(asked) == 4 and time.monotonic() - t0 >= 0.35
    finally:
        pool.close()
        server.close()


async def test_abort_active_breaks_off_a_silent_request_at_once():
    server, port = await stalling_server()
    pool = RawHttpPool("e", "127.0.0.1", port, connect_timeout=1)
    try:
        resp = await pool.post("/generate", b"{}", read_timeout=600)

        async def read():
            return [c async for c in chunks]

        chunks = resp.iter_bytes().__aiter__()
        assert await chunks.__anext__() == b"first"  # under way; the server is silent now
        reader = asyncio.create_task(read())
        assert pool.abort_active("it stopped answering health probes") == 1
        with pytest.raises(EngineError) as ei:
            await asyncio.wait_for(reader, 2)
        assert "broken off: it stopped answering" in ei.value.message
        assert ei.value.details["dropped"]
        assert pool.abort_active("again") == 0 and not pool._idle  # never reused
    finally:
        pool.close()
        server.close()


class StubClient:
    """Just what the pool's health and breaker logic call."""

    def __init__(self) -> None:
        from rollout_gateway.engines.client import EngineInfo

        self.url = "http://stub"
        self.info = EngineInfo()
        self.health_answer = Health.OK
        self.aborted: list[str] = []

    async def health(self) -> Health:
        return self.health_answer

    def abort_inflight(self, why: str) -> int:
        self.aborted.append(why)
        return 1

    async def detect(self):
        from rollout_gateway.engines.client import EngineInfo
        from rollout_gateway.engines.identity import EngineIdentity

        return EngineInfo(weight_version=0, identity=EngineIdentity(weight_version=0))

    async def identity(self, read=None):
        from rollout_gateway.engines.identity import EngineIdentity

        return EngineIdentity(weight_version=0)


class Clock:
    """The pool's monotonic clock, moved by the test (cooldowns pass when it says so)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    @staticmethod
    def time() -> float:
        return time.time()


async def test_circuit_opens_after_failures_in_a_row_and_probes_do_not_close_it_early(
        monkeypatch):
    import rollout_gateway.engines.pool as pool_module

    clock = Clock()
    monkeypatch.setattr(pool_module, "time", clock)
    s = GatewaySettings(breaker={"failures": 3, "cooldown_s": 0.3, "max_cooldown_s": 0.5})
    pool = EnginePool(s)
    eng = Engine(id="a", client=StubClient())  # type: ignore[arg-type]
    pool._engines["a"] = eng
    pool.record_failure(eng, "garbage")
    assert eng.state is EngineState.UNHEALTHY and not eng.breaker_open
    assert await pool.probe(eng) is EngineState.HEALTHY  # one failure: back at the next probe
    pool.record_failure(eng, "garbage")
    pool.record_failure(eng, "garbage")
    assert eng.breaker_open and eng.trips == 1 and "circuit open" in eng.last_error
    assert eng.client.aborted  # its other requests were broken off
    assert await pool.probe(eng) is EngineState.UNHEALTHY  # healthy probe, circuit still open
    assert pool.choose() is None
    clock.now += 0.29
    assert await pool.probe(eng) is EngineState.UNHEALTHY  # not yet: 0.3 s
    clock.now += 0.02
    assert await pool.probe(eng) is EngineState.HEALTHY  # half-open
    pool.record_failure(eng, "garbage")  # one more failure re-opens it, for longer
    assert eng.breaker_open and eng.trips == 2
    assert eng.to_dict()["breaker"]["open_for_s"] == 0.5  # doubled, capped at max_cooldown_s
    clock.now += 0.49
    assert await pool.probe(eng) is EngineState.UNHEALTHY
    clock.now += 0.02
    assert await pool.probe(eng) is EngineState.HEALTHY
    pool.record_success(eng)
    assert eng.failures == 0 and eng.trips == 0


async def test_failed_health_probes_break_off_requests_in_flight():
    pool = EnginePool(GatewaySettings(unhealthy_after=2))
    client = StubClient()
    eng = Engine(id="a", client=client)  # type: ignore[arg-type]
    pool._engines["a"] = eng
    client.health_answer = Health.DOWN
    await pool.probe(eng)
    assert eng.state is EngineState.HEALTHY and not client.aborted
    await pool.probe(eng)
    assert eng.state is EngineState.UNHEALTHY
    assert client.aborted and "health probes" in client.aborted[0]


async def test_a_probe_answered_across_a_swap_pause_does_not_outlive_the_resume():
    """A 503 taken while a swap paused the engine, applied after the swap resumed it, would
    keep a serving engine out of routing until the next probe (seen in CI: 'paused' after a
    failed swap had resumed every engine)."""
    pool = EnginePool(GatewaySettings())
    client = StubClient()
    eng = Engine(id="a", client=client)  # type: ignore[arg-type]
    pool._engines["a"] = eng
    asked, answer = asyncio.Event(), asyncio.Event()

    async def slow_health() -> Health:
        asked.set()
        await answer.wait()
        return Health.PAUSED

    client.health = slow_health  # type: ignore[method-assign]
    pool.close_gate(eng)  # the swap's fence and pause
    probe = asyncio.create_task(pool.probe(eng))
    await asyncio.wait_for(asked.wait(), 5)
    await pool.open_gate(eng, resumed=True)  # the swap resumed it
    answer.set()
    assert await probe is EngineState.HEALTHY
    assert eng.state is EngineState.HEALTHY and not eng.patience()

    # a 503 that came back during the pause is lifted by the resume itself
    client.health = StubClient.health.__get__(client)  # type: ignore[method-assign]
    client.health_answer = Health.PAUSED
    pool.close_gate(eng)
    assert await pool.probe(eng) is EngineState.PAUSED
    await pool.open_gate(eng, resumed=True)
    assert eng.state is EngineState.HEALTHY and not eng.patience()
    # not resumed by us (a plain fence lifted): the probe's word stands
    pool.close_gate(eng)
    assert await pool.probe(eng) is EngineState.PAUSED
    await pool.open_gate(eng)
    assert eng.state is EngineState.PAUSED and eng.patience()
