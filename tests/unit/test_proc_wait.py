"""wait_healthy against real child processes: healthy, exited, too slow."""

from __future__ import annotations

import subprocess
import sys

from rollout_gateway.proc import wait_healthy
from rollout_gateway.commands.engine_process import free_port

SERVER = ("import http.server, sys\n"
          "class H(http.server.BaseHTTPRequestHandler):\n"
          "    def do_GET(self):\n"
          "        self.send_response(int(sys.argv[2])); self.end_headers()\n"
          "    def log_message(self, *a): pass\n"
          "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")


def _serve(status: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(status)])
    return proc, f"http://127.0.0.1:{port}/health"


def test_healthy_unhealthy_and_exited() -> None:
    proc, url = _serve(503)
    try:
        assert wait_healthy(proc, url, 10, ok=(200, 503)) is None
        assert wait_healthy(proc, url, 10, ok=None) is None
        assert wait_healthy(proc, url, 0.5) == "not healthy within 0.5s"
    finally:
        proc.kill()
        proc.wait()
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    assert wait_healthy(dead, "http://127.0.0.1:1/health", 10) == "exited with code 3"


def test_free_port_is_outside_the_ephemeral_range_and_bindable() -> None:
    import socket

    lo, hi = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    for _ in range(20):
        port = free_port()
        assert not lo <= port <= hi  # outgoing connections never take it
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_engine_start_failure_names_its_cause() -> None:
    import socket

    import pytest

    from rollout_gateway.commands.engine_process import EngineProcess, EngineStartError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        with pytest.raises(EngineStartError, match="address already in use"):
            EngineProcess(port=taken.getsockname()[1]).start()
