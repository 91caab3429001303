"""Engine faults mid-generation, against ``rollout-gateway serve`` with two real reference
engines (the second behind a :class:`FaultProxy`), counted end to end through a real
learner over gRPC: every submitted sample is delivered exactly once, and every token's
policy_version, kv_version and logprob match a fresh forward pass of the weights of the
version it is stamped with (so no token carries a version its engine did not run).

In file order: a hung engine (SIGSTOP), garbage answers, a swap one engine fails to
load, a killed engine (SIGKILL).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from _gateway_support import GatewayProcess, Streams, check_against_ground_truth
from _faults_support import FAULT_SEED, FaultProxy, create_group, drain, wait_for

from rollout_gateway.commands.engine_process import EngineProcess

pytestmark = pytest.mark.integration

STEP_MS = 40  # engine step delay: a sample of NEW tokens takes >= 1.2 s
NEW = 32
SAMPLES = 6


@pytest.fixture(scope="module")
def cluster():
    engines = [EngineProcess(seed=FAULT_SEED, weight_version="0", step_delay_ms=STEP_MS)
               for _ in range(2)]
    with ThreadPoolExecutor(2) as ex:  # start both at once (each imports torch)
        list(ex.map(lambda e: e.start(), engines))
    e0, e1 = engines
    proxy = FaultProxy(e1.port).start()
    gw = GatewayProcess({"e0": e0.url, "e1": proxy.url}, env={
        "ROLLOUT_GATEWAY_TIMEOUTS__HEALTH_S": "1", "ROLLOUT_GATEWAY_BREAKER__COOLDOWN_S": "1",
        "ROLLOUT_GATEWAY_MAX_ATTEMPTS": "6"}).start()
    try:
        yield gw, e0, e1, proxy
    finally:
        gw.stop()
        proxy.stop()
        for e in engines:
            if e.proc and e.proc.poll() is None:
                os.kill(e.pid, signal.SIGCONT)
            e.stop()


def target(gw) -> str:
    return f"127.0.0.1:{gw.grpc_port}"


def engine_state(gw, eid: str) -> dict:
    return httpx.get(f"{gw.url}/v1/engines/{eid}", timeout=10).json()


def all_healthy(gw) -> None:
    wait_for(lambda: all(e["state"] == "healthy" for e in
                         httpx.get(gw.url + "/v1/engines", timeout=10).json()["engines"]
                         if e["state"] != "failed_load"), 60, "engines back in rotation")


def run_batch(gw, fault, *, under_way: int = 2, prompts: int = SAMPLES):
    """Stream ``prompts`` rollouts (one sample each, request ids); call ``fault()`` once every
    sample has streamed ``under_way`` tokens (0: at once); return (trajectories, submitted
    ids, seconds from the fault to the end, what ``fault`` returned)."""
    rid = uuid.uuid4().hex[:8]
    with Streams(gw.url) as st:
        futs = [st.start([3 + i, 9, 4 + i], max_new_tokens=NEW, request_id=f"{rid}-{i}")
                for i in range(prompts)]
        if under_way:
            st.wait_tokens(under_way)
        t_fault = time.monotonic()
        fault_result = fault()
        trajs = [t for f in futs for t in f.result()["trajectories"]]
    done = time.monotonic() - t_fault
    return trajs, [f"{rid}-{i}:0" for i in range(prompts)], done, fault_result


def check_delivered(gw, group: str, submitted: list[str]) -> None:
    got = drain(target(gw), group, len(submitted))
    ids = sorted(r.trajectory_id for r in got)
    assert ids == sorted(submitted), f"submitted {len(submitted)}, delivered {len(ids)}"


def moved(trajs: list[dict]) -> list[dict]:
    return [t for t in trajs if any(s["began"] == "failover" for s in t["segments"])]


def test_hung_engine_requests_move_elsewhere_within_seconds(cluster, fault_models):
    gw, e0, _, _ = cluster
    all_healthy(gw)
    create_group(target(gw), "hang")
    try:
        trajs, submitted, after_fault, _ = run_batch(
            gw, lambda: os.kill(e0.pid, signal.SIGSTOP))
        # health probes fail after ~2 x (0.5 s interval + 1 s probe deadline); the
        # requests it held are broken off then and resume on e1 (not after 600 s)
        assert after_fault < 30, f"rollouts took {after_fault:.1f}s after the hang"
        state = engine_state(gw, "e0")
        assert state["state"] == "unhealthy" and state["last_error"]
    finally:
        os.kill(e0.pid, signal.SIGCONT)
    hung = moved(trajs)
    assert hung, "no rollout was in flight on the hung engine"
    assert all(t["engine_ids"][-1] == "e1" for t in hung)
    # continued from the partial output the hung engine had streamed
    assert any(t["engine_ids"] == ["e0", "e1"] for t in hung), "no partial output was kept"
    print(f"hang: {len(hung)} of {len(trajs)} samples moved, all done {after_fault:.1f}s "
          "after SIGSTOP")
    for t in trajs:
        assert t["num_tokens"] == NEW
        check_against_ground_truth(t, fault_models)
    check_delivered(gw, "hang", submitted)
    all_healthy(gw)  # SIGCONT: back in rotation after its cooldown


def test_garbage_answers_fail_over_keeping_the_output_before_them(cluster, fault_models):
    gw, _, _, proxy = cluster
    all_healthy(gw)
    create_group(target(gw), "garbage")
    proxy.garbage_after, proxy.cut = 3, []
    proxy.garbage = 2  # the next two streamed answers of e1 turn to garbage
    trajs, submitted, _, _ = run_batch(gw, lambda: None, under_way=0)
    assert proxy.cut, "no request reached the garbage engine"
    bad = moved(trajs)
    assert bad and all(t["engine_ids"][-1] == "e0" for t in bad)
    assert any(t["engine_ids"] == ["e1", "e0"] for t in bad), "output before the garbage lost"
    for t in trajs:
        assert t["num_tokens"] == NEW
        check_against_ground_truth(t, fault_models)
    check_delivered(gw, "garbage", submitted)


def test_a_failure_before_the_first_token_leaves_the_first_segment_a_start(cluster,
                                                                            fault_models):
    """An engine answer that breaks before its first token keeps nothing: the sample runs
    again from its prompt, and its first segment is its start (nothing was resumed), as when
    no engine had failed (``rollout_gateway_failovers_total`` counts resumed segments: not
    these)."""
    gw, _, _, proxy = cluster
    all_healthy(gw)
    create_group(target(gw), "early")
    proxy.garbage_after, proxy.cut = 0, []
    proxy.garbage = 1  # the next streamed answer of e1 breaks before any token

    def failovers() -> float:
        m = httpx.get(gw.url + "/metrics").text
        return float(next(x.split()[-1] for x in m.splitlines()
                          if x.startswith("rollout_gateway_failovers_total ")))

    before = failovers()
    try:
        trajs, submitted, _, _ = run_batch(gw, lambda: None, under_way=0)
    finally:
        proxy.garbage = 0
    assert proxy.cut == [0], "the broken answer did not reach the gateway"
    assert failovers() == before
    for t in trajs:
        assert t["num_tokens"] == NEW
        assert t["segments"][0]["began"] == "start", t["segments"]
        assert not moved([t]), t["segments"]  # no token was carried over
        check_against_ground_truth(t, fault_models)
    check_delivered(gw, "early", submitted)
    all_healthy(gw)  # e1 back after its one failure


def test_a_swap_one_engine_fails_to_load_aborts_nothing_and_stamps_true(cluster, fault_models,
                                                                       tmp_path):
    from reference_engine.checkpoint import init_checkpoint

    gw, _, _, proxy = cluster
    all_healthy(gw)
    ckpt = init_checkpoint(tmp_path / "v1", seed=FAULT_SEED + 1)
    create_group(target(gw), "swap")
    proxy.fail_loads = 1  # e1 answers success=false and keeps its weights

    def swap():
        return httpx.post(gw.url + "/v1/weights", timeout=120, json={
            "version": 1, "source": {"kind": "disk", "path": str(ckpt)}, "mode": "in_place"})

    trajs, submitted, _, r = run_batch(gw, swap)
    assert r.status_code == 207, r.text  # a partial refit: each engine's result
    rec = r.json()
    assert rec["status"] == "partial"
    assert rec["results"]["e0"]["result"] == "verified"
    assert rec["results"]["e1"]["result"] == "kept_version"
    assert rec["results"]["e1"]["serving_version"] == 0
    assert rec["engines"]["e0"]["ok"] and rec["engines"]["e0"]["version_after"] == 1
    e1 = rec["engines"]["e1"]
    assert not e1["ok"] and e1["kept_version"] and e1["version_after"] == 0
    assert "injected" in e1["error"]
    # pool state reported: e1 serves its old version, and says why
    s1, s0 = engine_state(gw, "e1"), engine_state(gw, "e0")
    assert s1["state"] == "healthy" and s1["weight_version"] == 0
    assert "serving version 0" in s1["last_error"] and s0["weight_version"] == 1
    assert httpx.get(gw.url + "/v1/versions").json()["learner_version"] == 1
    # nothing aborted: no request had to move
    assert not moved(trajs)
    for t in trajs:
        assert t["num_tokens"] == NEW
        for s in t["segments"]:  # e1 never ran version 1
            if s["engine_id"] == "e1":
                assert s["policy_version"] == 0
        check_against_ground_truth(t, fault_models)
    assert any(1 in t["policy_version"] for t in trajs)
    check_delivered(gw, "swap", submitted)

    # over gRPC: a version past int32 is refused; a bad path at the largest version is
    # tried, kept by every engine, and pins nothing
    from learner_client import TrajectoryClient
    from learner_client.errors import TrajectoryClientError

    with TrajectoryClient(target(gw), "swap", "admin") as client:
        with pytest.raises(TrajectoryClientError) as ei:
            client.announce(2**31, str(ckpt))
        assert ei.value.code == "INVALID_ARGUMENT"
        res = client.announce(2**31 - 1, str(tmp_path / "missing"), mode="in_place")
        assert not res.accepted and "learner version stays 1" in res.message
        assert client.status().learner_version == 1
    for eid, version in (("e0", 1), ("e1", 0)):
        st = engine_state(gw, eid)
        assert st["state"] == "healthy" and st["weight_version"] == version


def test_killed_engine_requests_fail_over_with_true_stamps(cluster, fault_models):
    gw, e0, _, _ = cluster
    all_healthy(gw)
    create_group(target(gw), "kill")
    try:
        trajs, submitted, after_fault, _ = run_batch(gw, e0.kill)
        assert after_fault < 30
        dead = moved(trajs)
        assert dead and all(t["engine_ids"][-1] == "e1" for t in dead)
        print(f"kill: {len(dead)} of {len(trajs)} samples moved, all done {after_fault:.1f}s "
              "after SIGKILL")
        for t in trajs:
            assert t["num_tokens"] == NEW
            check_against_ground_truth(t, fault_models)
        check_delivered(gw, "kill", submitted)
        assert engine_state(gw, "e0")["state"] == "unhealthy"
    finally:  # the module's other tests need e0: the same engine again, on its port
        if e0.proc.poll() is not None:
            e0.start()
    all_healthy(gw)  # the gateway re-admits it (a new process: re-detected, caught up)
