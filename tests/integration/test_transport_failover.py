"""Processes die: a learner before acking, the gateway (store owner) mid-stream.
Real subprocesses, SIGKILL, real gRPC on loopback, both stores (journaled embedded, Redis)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from _redis_support import delete_prefix_sync
from learner_client.client import AsyncTrajectoryClient
from rollout_gateway.commands.engine_process import free_port

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]

GATEWAY = r"""
import asyncio, sys
from pathlib import Path
from rollout_gateway.store.factory import store_from_url
from doubles.control_plane import InProcessControlPlane
from rollout_gateway.transport.server import GrpcServer
from doubles.trajectories import make_trajectory

async def main(url, n, port, ready):
    store = store_from_url(url)
    await store.create_group("job")
    for i in range(n):  # a restarted gateway republishes: must be deduplicated
        await store.publish(make_trajectory(f"t{i}", seed=i))
    server = GrpcServer(store, InProcessControlPlane(), port=port, poll_ms=50)
    await server.start()
    await server.set_serving(True)
    Path(ready).write_text("ok")
    await asyncio.Event().wait()

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
"""

LEARNER = r"""
import json, sys, time
from learner_client.client import TrajectoryClient
c = TrajectoryClient(sys.argv[1], "job", "doomed-learner")
got = c.pull(int(sys.argv[2]), timeout=10)
print(json.dumps([r.trajectory_id for r in got]), flush=True)
time.sleep(600)  # killed before acking
"""


def spawn(code: str, *args: str, stdout=None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, env=env,
                            stdout=stdout, stderr=subprocess.DEVNULL)


def wait_file(path: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, "process died while starting"
        assert time.monotonic() < end, "process did not become ready"
        time.sleep(0.05)
    path.unlink()


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


@pytest.fixture(params=["journal", "redis"])
def store_url(request, tmp_path):
    if request.param == "journal":
        yield f"memory://?journal={tmp_path / 'store.db'}&lease_seconds=1"
        return
    prefix = f"test-{uuid.uuid4().hex[:10]}"
    yield f"redis://127.0.0.1:6379/0?prefix={prefix}&lease_seconds=1"
    delete_prefix_sync(prefix)


@pytest.fixture
def start_gateway(store_url, tmp_path):
    procs = []
    port = free_port()

    def start(n: int) -> subprocess.Popen:
        ready = tmp_path / f"ready-{len(procs)}"
        p = spawn(GATEWAY, store_url, n, port, ready)
        procs.append(p)
        wait_file(ready, p)
        return p

    start.target = f"127.0.0.1:{port}"
    yield start
    for p in procs:
        kill(p)


async def test_killed_learner_trajectories_go_to_another_learner(start_gateway):
    start_gateway(5)
    doomed = spawn(LEARNER, start_gateway.target, 3, stdout=subprocess.PIPE)
    try:
        line = doomed.stdout.readline()
        taken = json.loads(line)
        assert len(taken) == 3
    finally:
        kill(doomed)
    async with AsyncTrajectoryClient(start_gateway.target, "job", "survivor") as c:
        got = []
        end = time.monotonic() + 15
        while len(got) < 5 and time.monotonic() < end:
            got += await c.pull(5 - len(got), timeout=1.0)
        counts = {r.trajectory_id: r.delivery_count for r in got}
        assert sorted(counts) == [f"t{i}" for i in range(5)]  # nothing lost, nothing twice
        assert all(counts[t] >= 2 for t in taken)  # flagged as redeliveries
        assert all(counts[t] == 1 for t in counts if t not in taken)
        assert await c.ack(got) == 5
        assert await c.pull(5, timeout=1.5) == []


async def test_gateway_killed_and_restarted_loses_nothing(start_gateway):
    gw = start_gateway(6)
    # no lease renewal: the two pending deliveries must expire and come back after restart
    async with AsyncTrajectoryClient(start_gateway.target, "job", "learner",
                                     backoff_max=0.3, auto_extend=False) as c:
        first = await c.pull(4, timeout=5)
        assert len(first) == 4
        acked = first[:2]
        assert await c.ack(acked) == 2
        kill(gw)  # two acked, two pending (leased), two never delivered
        start_gateway(6)
        got = []
        end = time.monotonic() + 20
        while len(got) < 4 and time.monotonic() < end:
            got += await c.pull(4 - len(got), timeout=1.0)
        ids = {r.trajectory_id: r.delivery_count for r in got}
        pending = {r.trajectory_id for r in first[2:]}
        assert set(ids) == {f"t{i}" for i in range(6)} - {r.trajectory_id for r in acked}
        assert all(ids[t] >= 2 for t in pending)
        assert await c.ack(got) == 4
        st = (await c.status()).store
        assert (st.published, st.duplicates, st.group_backlog) == (6, 6, 0)


def test_sigterm_drains_gracefully(tmp_path):
    port_file = tmp_path / "port"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "doubles.grpc_server", "--store", "memory://",
         "--port", "0", "--port-file", str(port_file), "--grace", "2"],
        cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < end
            time.sleep(0.05)
        with grpc.insecure_channel(f"127.0.0.1:{port_file.read_text()}") as ch:
            res = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="rollout.v1.TrajectoryService"),
                timeout=10)
            assert res.status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        kill(proc)
