"""Start a reference engine as a real subprocess (for tests, benchmarks and ``up``).

No torch import here. Example::

    with EngineProcess(seed=1) as eng:
        httpx.post(eng.url + "/generate", json={...})
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path


import rollout_gateway
from rollout_gateway.proc import wait_healthy


#: Ports handed out for child processes: below Linux's ephemeral range (32768-60999 by
#: default), from which every outgoing connection takes its local port. A port the kernel
#: picked with ``bind(0)`` is itself ephemeral, so under load an outgoing connection could
#: take it between our close and the child's bind (seen: an engine exiting with "address
#: already in use" while other jobs made many connections). And below 22000: SGLang picks
#: the port its scheduler binds later (torch.distributed's store, ``nccl_port``) from
#: 22000-29999 (``get_free_port_below_ephemeral``), so a port handed out there could be
#: taken between SGLang's check and its scheduler's bind, or the other way round.
_PORTS = range(10000, 22000)
_random = random.SystemRandom()  # tests seed ``random``: parallel runs must not pick alike


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing on ``host`` listens on now, outside the ephemeral range."""
    for _ in range(200):
        port = _random.choice(_PORTS)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {_PORTS.start}-{_PORTS.stop - 1} on {host}")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports (:func:`free_port`) for one process or set of processes to bind:
    nothing is bound between two picks, so each call alone may return the same port twice."""
    ports: list[int] = []
    while len(ports) < n:
        if (port := free_port(host)) not in ports:
            ports.append(port)
    return ports


class EngineStartError(RuntimeError):
    """The engine process died or did not answer /health in time."""


class EngineProcess:
    """``python -m rollout_gateway engine ...`` on a free port; ``.url``, ``.port``, ``.pid``.

    ``start()`` waits until ``/health`` answers 200 (``EngineStartError`` with the stderr
    tail otherwise); ``stop()`` sends SIGTERM then SIGKILL; ``kill()`` SIGKILLs at once.
    """

    def __init__(self, *, seed: int = 0, checkpoint: str | os.PathLike | None = None,
                 model_config: str | None = None, weight_version: str | None = "0",
                 incremental_streaming_output: bool = False, max_running_requests: int = 64,
                 step_delay_ms: float = 0.0, sglang_strict: bool = False,
                 enable_return_routed_experts: bool = False, emulate_version: str | None = None,
                 model_path: str | os.PathLike | None = None,
                 port: int | None = None, host: str = "127.0.0.1", startup_timeout: float = 60.0,
                 extra_args: list[str] | None = None) -> None:
        self.host = host
        self.port = port or free_port()
        self.startup_timeout = startup_timeout
        self.args = ["--host", host, "--port", str(self.port), "--seed", str(seed),
                     "--max-running-requests", str(max_running_requests),
                     "--step-delay-ms", str(step_delay_ms)]
        if weight_version is not None:  # None: the engine's default ("default" if strict)
            self.args += ["--weight-version", str(weight_version)]
        if sglang_strict:
            self.args.append("--sglang-strict")
        if enable_return_routed_experts:
            self.args.append("--enable-return-routed-experts")
        if emulate_version:
            self.args += ["--emulate-version", emulate_version]
        if model_path:
            self.args += ["--model-path", str(model_path)]
        if checkpoint:
            self.args += ["--checkpoint", str(checkpoint)]
        if model_config:
            self.args += ["--model-config", model_config]
        if incremental_streaming_output:
            self.args.append("--incremental-streaming-output")
        self.args += extra_args or []
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def _stderr_tail(self, n: int = 3000) -> str:
        if not self._log:
            return ""
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")[-n:]

    def start(self) -> EngineProcess:
        env = dict(os.environ)
        root = str(Path(rollout_gateway.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("MKL_NUM_THREADS", "1")
        self._log = tempfile.NamedTemporaryFile("w+", prefix="engine-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "rollout_gateway", "engine", *self.args],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)
        why = wait_healthy(self.proc, self.url + "/health", self.startup_timeout)
        if why is None:
            return self
        tail = self._stderr_tail()  # before kill(), which deletes the log
        self.kill()
        raise EngineStartError(f"engine {why}:\n{tail}")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_log()

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._close_log()

    def _close_log(self) -> None:
        if self._log:
            self._log.close()
            try:
                os.unlink(self._log.name)
            except OSError:
                pass
            self._log = None

    def __enter__(self) -> EngineProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
