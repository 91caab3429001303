"""SIGTERM: health goes off, in-flight rollouts finish and are published, then the
gateway exits cleanly."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from _gateway_support import GatewayProcess, redis_urls, rollout

pytestmark = pytest.mark.integration


def test_sigterm_drains_in_flight_rollouts(make_engine):
    eng = make_engine(seed=1, step_delay_ms=30)
    store, registry = redis_urls()
    gw = GatewayProcess({"e0": eng.url}, store_url=store, registry_url=registry).start()
    try:
        with ThreadPoolExecutor(2) as ex:
            fut = ex.submit(rollout, gw.url, [1, 2, 3], n=2, max_new_tokens=30)
            time.sleep(0.3)
            gw.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 3
            while True:  # health turns off while the rollout is still draining
                h = httpx.get(gw.url + "/health", timeout=5)
                if h.status_code == 503 or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            assert h.status_code == 503 and h.json()["serving"] is False
            assert not fut.done()
            body = fut.result()
        assert [t["num_tokens"] for t in body["trajectories"]] == [30, 30]
        assert gw.proc.wait(30) == 0
    finally:
        gw.stop()

    import asyncio

    from rollout_gateway.store.factory import store_from_url

    async def published() -> int:
        s = store_from_url(store)
        try:
            return (await s.stats()).published
        finally:
            await s.close()

    assert asyncio.run(published()) == 2
