"""Nothing is kept per finished rollout: after a burst of /generate calls (plain, streamed,
batched, failed) every registry of the gateway is back to empty, and only the store holds
what was published. The gateway runs in this process (its state can be read) in front of
the reference engine (a real process)."""

from __future__ import annotations

import asyncio

import httpx

from rollout_gateway.api.app import create_app
from rollout_gateway.gateway import Gateway
from rollout_gateway.settings import GatewaySettings


def body(i: int, **kw):
    return {"input_ids": [1 + i % 7, 2, 3], "rid": f"leak-{i}", "return_logprob": True,
            "top_logprobs_num": 2, "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 1.0}, **kw}


def leftovers(gw: Gateway) -> dict[str, object]:
    """Everything that holds per-request state while a rollout runs (empty at rest)."""
    eng = gw.pool.list()[0]
    raw = eng.client.transport
    return {"samples running": dict(gw.rollouts.runner.active),
            "request ids claimed": dict(gw.rollouts._running_ids),
            "stream closers": set(gw.rollouts._background),
            "admission slots": gw.gatekeeper.running,
            "engine leases": (eng.outstanding_requests, eng.outstanding_tokens),
            "large answers read": (gw.pool.answers.busy, gw.pool.answers.waiting),
            "engine connections busy": set(raw._busy)}


async def closers_done(gw: Gateway, timeout: float = 30.0) -> None:
    """Wait for the stream closers (they end after a stream's last event: the client can
    have every answer before they run) - the tasks themselves, not a sleep."""
    await asyncio.wait_for(asyncio.gather(*list(gw.rollouts._background),
                                          return_exceptions=True), timeout)


async def test_a_burst_of_generate_calls_leaves_nothing_behind(engine):
    gw = Gateway(GatewaySettings(engines=[{"id": "ref", "url": engine.url}], heap_trim_s=0))
    await gw.start()
    app = create_app(gw, manage_gateway=False)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw", timeout=120) as c:
            async def burst(base: int) -> list[int]:
                calls = [c.post("/generate", json=body(base + i)) for i in range(12)]
                calls += [c.post("/generate", json=body(base + 50 + i, stream=True))
                          for i in range(4)]
                calls.append(c.post("/generate", json={  # a batch of two prompts, n = 2
                    **body(base + 90), "input_ids": [[1, 2], [3, 4]],
                    "rid": [f"leak-b{base}", f"leak-c{base}"],
                    "sampling_params": {"max_new_tokens": 3, "n": 2}}))
                calls.append(c.post("/generate", json=body(base + 99, input_ids=[])))  # 400
                return [r.status_code for r in await asyncio.gather(*calls)]

            first = await burst(0)
            assert first == [200] * 17 + [400]
            await closers_done(gw)
            at_rest = leftovers(gw)
            assert at_rest == {"samples running": {}, "request ids claimed": {},
                               "stream closers": set(), "admission slots": 0,
                               "engine leases": (0, 0), "large answers read": (0, 0),
                               "engine connections busy": set()}
            await c.get("/metrics")  # its own label set (route /metrics) exists from now on
            metrics1 = (await c.get("/metrics")).text.count("\n")
            assert await burst(100) == first
            await closers_done(gw)
            assert leftovers(gw) == at_rest
            # no label set per request id or trajectory: the exposition does not grow
            assert (await c.get("/metrics")).text.count("\n") == metrics1
        stats = await gw.store.stats()
        assert stats.published == 2 * (16 + 4)  # every finished sample, nothing else
    finally:
        await gw.stop()
