"""The gateway's engine connections against real uvicorn servers (SGLang's HTTP server
is uvicorn): idle keep-alive connections the engine closed are never taken for a failed
engine, and an error the engine reports inside a 200 stream (SGLang's way for a bad
request) is the client's 400, not an engine failure. The gateway runs in this process
(its engine pool and counters can be read); the engines are real processes."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from _uvicorn_engines import NO_TOKENIZER, TOO_LONG, UvicornEngine, established, wait_closed

from rollout_gateway.api.app import create_app
from rollout_gateway.gateway import Gateway
from rollout_gateway.engines.client import EngineClient
from rollout_gateway.engines.rawhttp import RawHttpPool
from rollout_gateway.engines.transport import HttpxTransport
from rollout_gateway.settings import GatewaySettings

pytestmark = pytest.mark.integration

BURST = 8


def body(i: int, **kw) -> dict:
    return {"input_ids": [1 + i % 7, 2, 3], "rid": f"ka-{i}-{kw.pop('round', 0)}",
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 3, "temperature": 1.0}, **kw}


class InProcessGateway:
    """A gateway in front of one engine, in this process; no health probes during the
    test (a request failure would keep the engine out of rotation: a 503)."""

    def __init__(self, url: str, **settings) -> None:
        self.gw = Gateway(GatewaySettings(engines=[{"id": "e", "url": url}], heap_trim_s=0,
                                          health_interval_s=3600, **settings))

    async def __aenter__(self) -> tuple[Gateway, httpx.AsyncClient]:
        await self.gw.start()
        self.http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_app(gateway=self.gw, manage_gateway=False)),
            base_url="http://gw", timeout=120)
        return self.gw, self.http

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()
        await self.gw.stop()


async def metric(http: httpx.AsyncClient, name: str) -> float:
    for line in (await http.get("/metrics")).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


async def engine_requests(engine: UvicornEngine) -> int:
    async with httpx.AsyncClient() as c:
        return (await c.get(engine.url + "/requests")).json()["generate"]


def assert_healthy(gw: Gateway) -> None:
    eng = gw.pool.list()[0]
    assert eng.state == "healthy" and eng.last_error is None, eng.to_dict()
    assert eng.failures == 0 and not eng.breaker_open


async def burst_idle_burst(http: httpx.AsyncClient, port: int, *, stream: bool) -> None:
    """A burst that opens several connections, the server closing them all once idle,
    then another burst: every request answers 200."""
    first = await asyncio.gather(*(http.post("/generate", json=body(i, stream=stream))
                                   for i in range(BURST)))
    assert [r.status_code for r in first] == [200] * BURST
    await asyncio.to_thread(wait_closed, port)  # the engine closed every idle connection
    again = await asyncio.gather(*(http.post("/generate", json=body(i, stream=stream, round=1))
                                   for i in range(BURST)))
    assert [r.status_code for r in again] == [200] * BURST, [r.text for r in again]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
async def test_idle_connections_closed_by_uvicorn_never_fail_the_engine(stream):
    with UvicornEngine("reference", keep_alive=1.0) as engine:
        async with InProcessGateway(engine.url) as (gw, http):
            raw: RawHttpPool = gw.pool.list()[0].client.transport
            await burst_idle_burst(http, engine.port, stream=stream)
            assert raw.counters["dialled"] >= 2 * 2  # several connections, in both bursts
            # every connection the engine closed was seen closed and never written to
            assert raw.counters["stale"] >= 2 and raw.counters["resent"] == 0
            assert_healthy(gw)
            assert await metric(http, "rollout_gateway_failovers_total") == 0
            assert await metric(http, "rollout_gateway_failed_samples_total") == 0


async def test_idle_connections_of_the_reference_engine_process():
    """The reference engine as ``rollout-gateway engine`` runs (uvicorn's default 5 s
    keep-alive); the gateway's keep_alive_s (4 s) retires its connections first."""
    from rollout_gateway.commands.engine_process import EngineProcess

    with EngineProcess(seed=1) as engine:
        async with InProcessGateway(engine.url) as (gw, http):
            raw: RawHttpPool = gw.pool.list()[0].client.transport
            await burst_idle_burst(http, engine.port, stream=True)
            assert raw.counters["stale"] >= 2 and raw.counters["resent"] == 0
            assert_healthy(gw)
            assert await metric(http, "rollout_gateway_failovers_total") == 0


async def test_the_httpx_transport_after_idle_connections_were_closed():
    with UvicornEngine("reference", keep_alive=1.0) as engine:
        client = EngineClient("e", engine.url, transport=HttpxTransport(
            "e", engine.url, connect_timeout=5, keep_alive_s=4.0))
        try:
            for rnd in range(2):
                out = await asyncio.gather(*(client.generate(body(i, round=rnd))
                                             for i in range(BURST)))
                assert all(b'"output_ids"' in o for o in out)
                if rnd == 0:
                    assert established(engine.port) >= 2
                    await asyncio.to_thread(wait_closed, engine.port)
        finally:
            await client.close()


# ---- errors the engine reports -------------------------------------------------------

@pytest.mark.parametrize("stream_from_engines", [True, False], ids=["streamed", "plain"])
async def test_an_error_event_for_a_bad_request_is_the_clients_400(stream_from_engines):
    """SGLang answers text sent to a --skip-tokenizer-init engine with HTTP 200 and an
    error event (code 400, retryable false) when streamed, HTTP 400 when not: either way
    the client gets the 400 with SGLang's message, at once; the engine stays healthy."""
    with UvicornEngine("sglang-errors") as engine:
        async with InProcessGateway(engine.url,
                                    stream_from_engines=stream_from_engines) as (gw, http):
            r = await http.post("/v1/rollouts", json={
                "prompt": "hello", "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "INVALID_ARGUMENT" and NO_TOKENIZER in err["message"]
            r = await http.post("/generate", json={"text": "hello", "stream": True})
            assert r.status_code == 400 and NO_TOKENIZER in r.json()["error"]["message"], r.text
            assert_healthy(gw)
            assert await engine_requests(engine) == 2  # one engine request each: no retry
            assert await metric(http, "rollout_gateway_failovers_total") == 0
            ok = await http.post("/v1/rollouts", json={
                "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
            assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("stream_from_engines", [True, False], ids=["streamed", "plain"])
async def test_a_prompt_the_scheduler_refuses_is_the_clients_400(stream_from_engines):
    """SGLang's scheduler refuses some prompts (longer than it admits) by ending a
    streamed request with finish_reason abort + status_code 400 (HTTP 400 when not
    streamed): the client's 400, not an abort to resume from (that looped to a 503)."""
    with UvicornEngine("sglang-errors") as engine:
        async with InProcessGateway(engine.url,
                                    stream_from_engines=stream_from_engines) as (gw, http):
            r = await http.post("/v1/rollouts", json={
                "input_ids": [400, 2], "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 400, r.text
            assert TOO_LONG in r.json()["error"]["message"]
            assert await engine_requests(engine) == 1
            assert_healthy(gw)
            assert await metric(http, "rollout_gateway_abort_resumes_total") == 0


@pytest.mark.parametrize("first,stream_from_engines", [
    (503, True), (503, False), (429, True)], ids=["503-event", "503-status", "retryable-400"])
async def test_an_engine_side_error_is_still_an_engine_failure(first, stream_from_engines):
    with UvicornEngine("sglang-errors") as engine:
        async with InProcessGateway(engine.url, stream_from_engines=stream_from_engines,
                                    max_attempts=2) as (gw, http):
            r = await http.post("/v1/rollouts", json={
                "input_ids": [first, 2], "sampling_params": {"max_new_tokens": 1}})
            assert r.status_code == 503, r.text
            eng = gw.pool.list()[0]
            assert eng.state == "unhealthy" and eng.failures >= 1
