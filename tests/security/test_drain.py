"""A slow engine behind real ``serve`` processes: a streamed request whose client leaves
keeps counting against its tenant's pending limit until its generation ends, and SIGTERM
drains within ``drain_grace_s``: new work gets 503 with Retry-After, what is still running is
cut short and published with its output, and the process exits in time."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest
from _gateway_support import REDIS_URL, GatewayProcess
from _redis_support import delete_prefix_sync
from _support import PATIENT_HEALTH
from _tenants import ENV, A, B, h, new_id, pull_until, rollout

pytestmark = pytest.mark.integration

STEP_MS = 50  # per generated token


@pytest.fixture(scope="module")
def slow_engine():
    from rollout_gateway.commands.engine_process import EngineProcess

    with EngineProcess(seed=1, weight_version="0", step_delay_ms=STEP_MS) as eng:
        yield eng


def _open_stream(client: httpx.Client, url: str, token: str, body: dict):
    """Start a streamed rollout and read until its first token chunk; returns the open
    response and that chunk."""
    resp = client.send(client.build_request("POST", url + "/v1/rollouts",
                                            json={**body, "stream": True}, headers=h(token)),
                       stream=True)
    assert resp.status_code == 200, resp.read()
    lines = resp.iter_lines()
    for line in lines:
        if line.startswith("data: {"):
            ev = json.loads(line[6:])
            if ev.get("type") == "chunk":
                return resp, lines, ev
    raise AssertionError("the stream ended before its first chunk")


def test_a_dropped_stream_counts_until_its_generation_ends(slow_engine):
    env = {**PATIENT_HEALTH, **ENV, "ROLLOUT_GATEWAY_MAX_PENDING_PER_TENANT": "1"}
    with GatewayProcess({"e0": slow_engine.url}, env=env) as gw:
        body = {"input_ids": [1, 2, 3],
                "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}}
        with httpx.Client(timeout=60) as client:
            resp, _, first = _open_stream(client, gw.url, A, body)
            resp.close()  # the client goes away; the generation runs on (~3 s)
        # the event: the gateway ended that response (its HTTP histogram counted it)
        deadline = time.monotonic() + 30
        while _responses(gw, "/v1/rollouts") < 1:
            assert time.monotonic() < deadline, "the gateway never saw the client leave"
        r = rollout(gw, A, {**body, "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 429 and r.headers.get("retry-after"), r.text
        assert "tenant" in r.json()["error"]["message"]
        other = rollout(gw, B, {**body, "sampling_params": {"max_new_tokens": 1}})
        assert other.status_code == 200, other.text  # another tenant is not stopped
        tid = first["trajectory_id"]
        got = pull_until(gw, {tid})  # the dropped stream's sample finished and published
        assert got[tid].token_ids.shape[0] == 60, (got[tid].finish_reason, got[tid].metadata, got[tid].segments)
        deadline = time.monotonic() + 30  # its place is freed right after it published
        while True:
            r = rollout(gw, A, {**body, "sampling_params": {"max_new_tokens": 1}})
            if r.status_code != 429 or time.monotonic() > deadline:
                break
        assert r.status_code == 200, r.text


def _responses(gw, route: str) -> float:
    """200 responses of ``route`` the gateway finished (streams: when they ended)."""
    want = ('rollout_gateway_http_request_duration_seconds_count{method="POST",'
            f'route="{route}",status="200"}}')
    for line in httpx.get(gw.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(want):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _stored(url: str, tid: str):
    from rollout_gateway.core import trajectory_codec
    from rollout_gateway.store.factory import store_from_url

    store = store_from_url(url)
    try:
        data = (await store.lookup([tid])).get(tid)
        return trajectory_codec.decode(data) if data else None
    finally:
        await store.close()


def test_sigterm_drains_within_drain_grace_s(slow_engine):
    grace = 3.0
    prefix = new_id("gwtest-drain")
    url = f"{REDIS_URL}?prefix={prefix}"
    env = {**PATIENT_HEALTH, **ENV, "ROLLOUT_GATEWAY_DRAIN_GRACE_S": str(grace)}
    gw = GatewayProcess({"e0": slow_engine.url}, store_url=url, registry_url=url, env=env)
    try:
        gw.start()
        # ~100 s, and no end of sequence before the drain cuts it (sampling could stop it)
        body = {"input_ids": [4, 5, 6],
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
        with httpx.Client(timeout=60) as client:
            resp, lines, first = _open_stream(client, gw.url, A, body)
            t0 = time.monotonic()
            gw.proc.send_signal(signal.SIGTERM)
            while httpx.get(gw.url + "/health", timeout=10).status_code == 200:
                assert time.monotonic() - t0 < grace, "health never went off"
            r = rollout(gw, B, {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})
            assert r.status_code == 503 and r.headers.get("retry-after"), r.text
            final = None
            for line in lines:  # the stream ends with the cut-short trajectory
                if line.startswith("data: {"):
                    ev = json.loads(line[6:])
                    if ev.get("type") == "trajectory":
                        final = ev["trajectory"]
            resp.close()
        code = gw.proc.wait(timeout=grace + 30)
        took = time.monotonic() - t0
        assert code == 0, gw.log_tail()
        assert took < grace + 2.5, f"exited {took:.1f}s after SIGTERM (grace {grace}s)"
        assert final is not None, gw.log_tail()
        assert final["finish_reason"]["type"] == "abort"
        assert "cut short" in final["finish_reason"]["message"]
        assert 0 < final["num_tokens"] - 3 < 2000
        stored = asyncio.run(_stored(url, first["trajectory_id"]))
        assert stored is not None and stored.finish_reason.type == "abort"
        assert stored.num_tokens == final["num_tokens"]
    finally:
        gw.stop()
        delete_prefix_sync(prefix)
