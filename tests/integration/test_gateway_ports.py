"""A gateway started on ports another gateway serves fails to start, clearly, and the
running one keeps its learners: gRPC binds with SO_REUSEPORT by default, which would let the
second bind the learner port too and the kernel split learners between the two."""

from __future__ import annotations

import subprocess

import grpc
import pytest
from _gateway_support import GatewayProcess
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout_gateway.commands.engine_process import free_port

pytestmark = pytest.mark.integration


def grpc_health(target: str) -> int:
    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                    timeout=10).status


def test_second_gateway_on_a_served_grpc_port_is_refused(engine):
    with GatewayProcess({"e0": engine.url}) as first:
        target = f"127.0.0.1:{first.grpc_port}"
        assert grpc_health(target) == health_pb2.HealthCheckResponse.SERVING
        second = GatewayProcess({"e0": engine.url})
        args = list(second.args)
        args[args.index("--grpc-port") + 1] = str(first.grpc_port)
        args[args.index("--port") + 1] = str(free_port())
        out = subprocess.run(args, env=second.env, capture_output=True, text=True, timeout=120)
        text = out.stdout + out.stderr
        assert out.returncode == 2, text
        assert f"learner gRPC cannot listen on {target}: the port is in use" in text, text
        assert "Traceback" not in text, text
        # the first one still serves its learners (every new connection reaches it)
        for _ in range(8):
            assert grpc_health(target) == health_pb2.HealthCheckResponse.SERVING
        assert first.proc.poll() is None
