"""SIGTERM: health goes off, in-flight rollouts finish and are published, then the
gateway exits cleanly."""

from __future__ import annotations

import signal
import time

import httpx
import pytest
from _gateway_support import GatewayProcess, Streams, redis_urls, rollout

pytestmark = pytest.mark.integration


def test_sigterm_drains_in_flight_rollouts(make_engine):
    eng = make_engine(seed=1, step_delay_ms=30)
    store, registry = redis_urls()
    gw = GatewayProcess({"e0": eng.url}, store_url=store, registry_url=registry).start()
    try:
        with Streams(gw.url) as st:
            fut = st.start([1, 2, 3], n=2, max_new_tokens=30)
            st.wait_tokens(2)  # both samples generating
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


def test_failed_requests_leak_no_slots_and_sigterm_does_not_wait_for_them(engine):
    """Requests that fail after admission (here a token id past int32, which the engine
    could not take) return their slots: admission stays open and the drain is instant."""
    gw = GatewayProcess({"e0": engine.url}, env={"ROLLOUT_GATEWAY_DRAIN_GRACE_S": "60",
                                                 "ROLLOUT_GATEWAY_ADMISSION__MAX_CONCURRENT": "4"})
    gw.start()
    try:
        for _ in range(6):  # more than max_concurrent: a leak would end in 429s
            r = httpx.post(gw.url + "/v1/rollouts", timeout=30, json={
                "input_ids": [2147483648], "n": 2, "sampling_params": {"max_new_tokens": 2}})
            assert 400 <= r.status_code < 500 and r.status_code != 429, r.text
        metrics = httpx.get(gw.url + "/metrics", timeout=10).text
        assert "rollout_gateway_inflight_samples 0" in metrics
        assert rollout(gw.url, [1, 2], n=2, max_new_tokens=2)["trajectories"]
        t0 = time.monotonic()
        gw.proc.send_signal(signal.SIGTERM)
        assert gw.proc.wait(30) == 0
        assert time.monotonic() - t0 < 15  # no phantom samples to wait out (grace 60 s)
    finally:
        gw.stop()
