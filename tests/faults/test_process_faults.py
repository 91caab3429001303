"""Process faults around the store: the gateway, Redis and a learner killed with SIGKILL,
against ``rollout-gateway serve``, a real reference engine and our own ``redis-server``
(append-only, fsync every second as deploy/k8s/redis.yaml ships it), counted end to end through a real learner over gRPC.
Also: 200 concurrent rollouts from cold through a small Redis pool, without a 503."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from _faults_support import APPENDFSYNC, FAULT_SEED, create_group, drain, wait_for
from _gateway_support import GatewayProcess, check_against_ground_truth

import rollout_gateway
from rollout_gateway.commands.engine_process import EngineProcess

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engine():
    with EngineProcess(seed=FAULT_SEED, weight_version="0", step_delay_ms=20) as eng:
        yield eng


def urls(redis_server, **query) -> str:
    q = "".join(f"&{k}={v}" for k, v in query.items())
    return f"{redis_server.url}?prefix=fault-{uuid.uuid4().hex[:8]}{q}"


def target(gw) -> str:
    return f"127.0.0.1:{gw.grpc_port}"


def body(i: int, rid: str, tokens: int, n: int = 1, **extra) -> dict:
    return {"input_ids": [5 + i, 6, 7], "n": n, "request_id": rid,
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}, **extra}


def post(url: str, b: dict, timeout: float = 120) -> httpx.Response | Exception:
    try:
        return httpx.post(url + "/v1/rollouts", json=b, timeout=timeout)
    except httpx.HTTPError as exc:
        return exc


def test_gateway_killed_mid_rollouts_restarts_and_retries_are_idempotent(
        engine, redis_server, fault_models):
    url = urls(redis_server)
    gw = GatewayProcess({"e0": engine.url}, store_url=url, registry_url=url).start()
    create_group(target(gw), "learner")
    reqs = [body(i, f"kill-{i}", tokens=6 + 10 * i, n=2) for i in range(8)]
    first: dict[str, httpx.Response | Exception] = {}
    with ThreadPoolExecutor(len(reqs)) as ex:
        futs = {ex.submit(post, gw.url, b): b["request_id"] for b in reqs}
        wait_for(lambda: sum(f.done() for f in futs) >= 2, 60, "two rollouts to finish")
        gw.proc.kill()  # SIGKILL, mid-rollouts
        gw.proc.wait(10)
        for f, rid in futs.items():
            first[rid] = f.result()
    answered = {rid for rid, r in first.items() if isinstance(r, httpx.Response)
                and r.status_code == 200}
    cut = set(first) - answered
    assert answered and cut, f"answered {sorted(answered)}, cut off {sorted(cut)}"
    assert all(isinstance(first[rid], Exception) for rid in cut)  # reported to the client

    gw2 = GatewayProcess({"e0": engine.url}, store_url=url, registry_url=url).start()
    try:
        final: dict[str, list[dict]] = {}
        for b in reqs:  # the client retries everything, with the same request ids
            r = post(gw2.url, b)
            assert isinstance(r, httpx.Response) and r.status_code == 200, r
            final[b["request_id"]] = r.json()["trajectories"]
        for rid in answered:  # answered before the kill: the same trajectories again
            assert final[rid] == first[rid].json()["trajectories"]
        metrics = httpx.get(gw2.url + "/metrics").text
        replayed = int(float(next(line.split()[1] for line in metrics.splitlines()
                                  if line.startswith("rollout_gateway_replayed_total"))))
        assert replayed >= 2 * len(answered)  # answered from the store, not generated
        submitted = {t["trajectory_id"]: t for ts in final.values() for t in ts}
        assert len(submitted) == 2 * len(reqs)
        for t in submitted.values():
            check_against_ground_truth(t, fault_models)
        got = drain(target(gw2), "learner", len(submitted))
        assert sorted(r.trajectory_id for r in got) == sorted(submitted), \
            f"submitted {len(submitted)}, delivered {len(got)}"
        for r in got:  # what the learner trains on is what the client was answered
            assert r.token_ids.tolist() == submitted[r.trajectory_id]["token_ids"]
    finally:
        gw2.stop()


def test_the_suite_runs_redis_with_the_shipped_fsync_policy(redis_server):
    import redis

    manifest = Path(rollout_gateway.__file__).resolve().parent.parent / "deploy/k8s/redis.yaml"
    args = re.search(r'args: \[(.*?)\]', manifest.read_text(), re.S).group(1)
    shipped = re.findall(r'"([^"]*)"', args)
    assert shipped[shipped.index("--appendfsync") + 1] == APPENDFSYNC
    r = redis.Redis(port=redis_server.port)
    try:
        assert r.config_get("appendfsync") == {"appendfsync": APPENDFSYNC}
        assert r.config_get("appendonly") == {"appendonly": "yes"}
    finally:
        r.close()


def test_redis_killed_and_restarted_loses_nothing_acknowledged(engine, redis_server):
    url = urls(redis_server)
    gw = GatewayProcess({"e0": engine.url}, store_url=url, registry_url=url).start()
    try:
        create_group(target(gw), "learner")
        with ThreadPoolExecutor(6) as ex:
            res = list(ex.map(lambda i: post(gw.url, body(i, f"before-{i}", 8)), range(6)))
        assert all(r.status_code == 200 for r in res)
        stored = {t["trajectory_id"] for r in res for t in r.json()["trajectories"]
                  if "publish_error" not in t["metadata"]}
        assert len(stored) == 6
        from learner_client import TrajectoryClient

        with TrajectoryClient(target(gw), "learner", "l1") as client:
            acked = []
            while len(acked) < 3:
                batch = client.pull(3 - len(acked), timeout=5)
                client.ack(batch)
                acked += [r.trajectory_id for r in batch]

        redis_server.kill()  # SIGKILL
        down = post(gw.url, body(0, "during", 8), timeout=60)
        # while Redis is down a rollout is refused with a reason, never answered as stored
        assert isinstance(down, Exception) or down.status_code >= 500 or all(
            "publish_error" in t["metadata"] for t in down.json()["trajectories"]), down.text
        redis_server.start()  # same port and dir: the append-only file is replayed

        def answers() -> bool:
            r = post(gw.url, body(0, f"probe-{uuid.uuid4().hex[:6]}", 2, publish=False), 30)
            return isinstance(r, httpx.Response) and r.status_code == 200

        wait_for(answers, 60, "the gateway to use the restarted Redis", every=0.5)
        with ThreadPoolExecutor(3) as ex:
            after = list(ex.map(lambda i: post(gw.url, body(i, f"after-{i}", 8)), range(3)))
        assert all(r.status_code == 200 for r in after), [r.text[:300] for r in after]
        stored |= {t["trajectory_id"] for r in after for t in r.json()["trajectories"]}
        if isinstance(down, httpx.Response) and down.status_code == 200:
            stored |= {t["trajectory_id"] for t in down.json()["trajectories"]
                       if "publish_error" not in t["metadata"]}
        want = stored - set(acked)
        got = drain(target(gw), "learner", len(want))
        ids = [r.trajectory_id for r in got]
        assert sorted(ids) == sorted(want), f"acknowledged {len(want)}, delivered {len(ids)}"
        assert not set(ids) & set(acked)  # acks made before the crash survived it
    finally:
        gw.stop()


def renewed_past_lease(redis_server, consumer: str, n: int, since: float, lease: float) -> bool:
    """True once ``n`` entries are pending to ``consumer`` more than a lease after ``since``
    (when they were known delivered), each idle for less than the time since: renewed."""
    import redis

    r = redis.Redis(port=redis_server.port)
    try:
        (stream,) = r.keys("*:stream")
        pending = r.xpending_range(stream, "learner", min="-", max="+", count=100)
    finally:
        r.close()
    elapsed_ms = (time.monotonic() - since) * 1000
    assert len(pending) == n and {p["consumer"] for p in pending} == {consumer.encode()}, pending
    return elapsed_ms > lease * 1200 and all(p["time_since_delivered"] < elapsed_ms - 300
                                             for p in pending)


def test_learner_killed_before_ack_gets_its_batch_redelivered(engine, redis_server):
    url = urls(redis_server, lease_seconds=3)
    gw = GatewayProcess({"e0": engine.url}, store_url=url, registry_url=url).start()
    try:
        create_group(target(gw), "learner")
        with ThreadPoolExecutor(4) as ex:
            res = list(ex.map(lambda i: post(gw.url, body(i, f"l-{i}", 4)), range(4)))
        submitted = sorted(t["trajectory_id"] for r in res for t in r.json()["trajectories"])
        code = ("import sys, time\nfrom learner_client import TrajectoryClient\n"
                f"c = TrajectoryClient({target(gw)!r}, 'learner', 'doomed')\n"
                "got = c.pull(4, timeout=30)\nprint(len(got), flush=True)\ntime.sleep(600)\n")
        env = dict(os.environ)
        root = str(Path(rollout_gateway.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        doomed = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                  env=env, text=True)
        try:
            assert doomed.stdout.readline().strip() == "4"
            held = time.monotonic()
            # it holds them past the lease, renewing in the background: wait until the
            # store shows every entry still pending to it, a lease after delivery, with an
            # idle time that proves a renewal (the event, read from Redis's XPENDING)
            wait_for(lambda: renewed_past_lease(redis_server, "doomed", 4, held, 3.0), 30,
                     "the held entries renewed past their first lease")
            from learner_client import TrajectoryClient

            with TrajectoryClient(target(gw), "learner", "peek") as peek:
                assert peek.pull(4, timeout=0.5) == []  # renewed: not redelivered yet
        finally:
            doomed.kill()  # SIGKILL before it acked
            doomed.wait(10)
        got = drain(target(gw), "learner", 4, timeout=30)
        assert sorted(r.trajectory_id for r in got) == submitted
        assert all(r.delivery_count >= 2 for r in got)
    finally:
        gw.stop()


def test_200_concurrent_rollouts_from_cold_wait_for_redis_connections(engine, redis_server):
    url = urls(redis_server)
    gw = GatewayProcess({"e0": engine.url}, store_url=url, registry_url=url, env={
        "ROLLOUT_GATEWAY_REDIS__MAX_CONNECTIONS": "8"}).start()
    try:
        async def burst() -> list[int]:
            limits = httpx.Limits(max_connections=256, max_keepalive_connections=0)
            async with httpx.AsyncClient(timeout=300, limits=limits) as client:
                async def one(i: int) -> int:
                    r = await client.post(gw.url + "/v1/rollouts", json=body(
                        i, f"cold-{i}", 2))
                    return r.status_code
                return await asyncio.gather(*(one(i) for i in range(200)))

        t0 = time.monotonic()
        codes = asyncio.run(burst())
        assert codes.count(200) == 200, {c: codes.count(c) for c in set(codes)}
        assert time.monotonic() - t0 < 240
        assert "Too many connections" not in gw.log_tail(20000)
    finally:
        gw.stop()
