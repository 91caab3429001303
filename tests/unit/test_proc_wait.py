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
