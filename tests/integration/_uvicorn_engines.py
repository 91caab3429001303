"""Engines under uvicorn as real processes, for the engine-connection tests.

``python _uvicorn_engines.py reference --port P --keep-alive S``: the reference engine's
app under uvicorn with ``timeout_keep_alive=S`` (uvicorn's and SGLang's default is 5 s).

:class:`UvicornEngine` starts one on a free port and stops it; :func:`established` counts
the server side's established TCP connections (from /proc/net/tcp*), to wait for the
server to close idle keep-alive connections.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import rollout_gateway
from rollout_gateway.commands.engine_process import free_port
from rollout_gateway.proc import wait_healthy


def reference_app(seed: int):
    from reference_engine.server import EngineSettings, create_app

    return create_app(EngineSettings(seed=seed, weight_version="0"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=["reference"])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--keep-alive", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    import uvicorn

    app = reference_app(args.seed)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning",
                timeout_keep_alive=args.keep_alive)


class UvicornEngine:
    """One of the engines above as a subprocess on a free port (a context manager)."""

    def __init__(self, kind: str, *, keep_alive: float = 5.0, seed: int = 1) -> None:
        self.port = free_port()
        self.args = [sys.executable, str(Path(__file__).resolve()), kind, "--port",
                     str(self.port), "--keep-alive", str(keep_alive), "--seed", str(seed)]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> UvicornEngine:
        env = dict(os.environ)
        root = str(Path(rollout_gateway.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(self.args, env=env)
        why = wait_healthy(self.proc, self.url + "/health", 60)
        if why is not None:
            self.__exit__()
            raise RuntimeError(f"engine {why}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def established(port: int) -> int:
    """Established TCP connections whose local port is ``port`` (the server's side)."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "01":
                n += 1
    return n


def wait_closed(port: int, *, at_most: int = 0, timeout: float = 30.0) -> None:
    """Wait until the server on ``port`` holds at most ``at_most`` established connections
    (it closed the others: an event, polled every 20 ms, not a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while established(port) > at_most:
        if time.monotonic() > deadline:
            raise AssertionError(f"the server on port {port} still holds "
                                 f"{established(port)} connections after {timeout:g}s")
        time.sleep(0.02)


if __name__ == "__main__":
    main()
