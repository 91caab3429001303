"""The fault suite's parts: real processes on loopback, and injectors in front of them
(imported by its tests; the fixtures are in conftest.py).

* :class:`RedisServer` - our own ``redis-server`` on a free port, append-only file with the
  fsync policy ``deploy/k8s/redis.yaml`` ships (:data:`APPENDFSYNC`), in a temp dir: killed
  with SIGKILL and restarted on the same port and dir (the shared Redis on :6379 is never
  touched).
* :class:`FaultProxy` - a loopback HTTP proxy in front of a real engine that can, on
  demand, answer ``/update_weights_from_disk`` with a failure (the engine keeps its
  weights, as SGLang does) or cut a streamed ``/generate`` after a few chunks with a
  garbage chunk. Everything else passes through unchanged.
* :func:`drain` - a real learner (``learner_client`` over gRPC) that pulls and acks
  everything a group has, so each test can count submitted against delivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))

from _gateway_support import wait_for  # noqa: E402,F401 - the suite's tests import it here

from rollout_gateway.commands.engine_process import free_port  # noqa: E402


#: the append-only fsync policy of deploy/k8s/redis.yaml (a test checks they agree)
APPENDFSYNC = "everysec"


class RedisServer:
    """``redis-server`` with AOF (fsync policy :data:`APPENDFSYNC`) in ``workdir``, on a
    free port."""

    def __init__(self, workdir: Path) -> None:
        self.dir = Path(workdir)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> RedisServer:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (the fault suite starts its own)")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--appendfsync", APPENDFSYNC, "--save", "",
             "--logfile", str(self.dir / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        import redis

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                r = redis.Redis(port=self.port, socket_connect_timeout=0.5)
                try:
                    if r.ping():
                        # replaying the AOF answers LOADING until done
                        return self
                finally:
                    r.close()
            except redis.RedisError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start:\n{self.log_tail()}")

    def log_tail(self) -> str:
        p = self.dir / "redis.log"
        return p.read_text(errors="replace")[-2000:] if p.exists() else ""

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


GARBAGE = b'data: {"text": 7, "output_ids": "not a list", "meta_info": [1, {]}\n\n'


class FaultProxy:
    """HTTP/1.1 proxy (one upstream connection per request, ``Connection: close``) on a
    thread of its own. ``fail_loads``: answer that many weight loads with success=false.
    ``garbage``: cut that many streamed /generate answers after ``garbage_after`` chunks
    with a garbage SSE chunk."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self.port = free_port()
        self.fail_loads = 0
        self.garbage = 0
        self.garbage_after = 3
        self.cut: list[int] = []  # chunks passed before each garbage cut
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fault-proxy")
        self._server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def main() -> None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
            self._ready.set()

        self._loop.run_until_complete(main())
        self._loop.run_forever()

    def stop(self) -> None:
        def shut() -> None:
            if self._server is not None:
                self._server.close()
            self._loop.stop()

        self._loop.call_soon_threadsafe(shut)
        self._thread.join(5)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_w = None
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            n = 0
            kept = [lines[0]]
            for line in lines[1:]:
                if not line:
                    continue
                k = line.split(b":", 1)[0].strip().lower()
                if k == b"content-length":
                    n = int(line.split(b":", 1)[1])
                if k != b"connection":
                    kept.append(line)
            body = await reader.readexactly(n) if n else b""
            path = lines[0].split(b" ")[1]
            if path == b"/update_weights_from_disk" and self.fail_loads > 0:
                self.fail_loads -= 1
                msg = b'{"success": false, "message": "injected: cannot read the checkpoint"}'
                writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n" % len(msg) + msg)
                await writer.drain()
                return
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream)
            up_w.write(b"\r\n".join(kept) + b"\r\nConnection: close\r\n\r\n" + body)
            await up_w.drain()
            streamed = path == b"/generate" and b'"stream":true' in body
            if streamed and self.garbage > 0:
                self.garbage -= 1
                await self._cut(up_r, writer)
                return
            while data := await up_r.read(1 << 16):
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            for w in (writer, up_w):
                if w is not None:
                    with contextlib.suppress(Exception):
                        w.close()

    async def _cut(self, up_r: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await up_r.readuntil(b"\r\n\r\n"))  # chunked SSE from uvicorn
        passed = 0
        while passed < self.garbage_after:
            size_line = await up_r.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            chunk = await up_r.readexactly(size + 2)
            writer.write(size_line + chunk)
            if chunk.startswith(b"data:") and b"[DONE]" not in chunk:
                passed += 1
        self.cut.append(passed)
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(GARBAGE), GARBAGE))
        await writer.drain()


def drain(target: str, group: str, expect: int, *, timeout: float = 60.0,
          consumer: str = "fault-learner") -> list:
    """Pull (and ack) from ``group`` until ``expect`` deliveries arrived or the timeout;
    then keep pulling briefly to catch anything extra (duplicates). Returns the rollouts."""
    from learner_client import TrajectoryClient

    got: list = []
    deadline = time.monotonic() + timeout
    with TrajectoryClient(target, group, consumer) as client:
        while len(got) < expect and time.monotonic() < deadline:
            batch = client.pull(expect - len(got), timeout=1.0)
            if batch:
                client.ack(batch)
                got += batch
        got += (extra := client.pull(64, timeout=1.0))
        if extra:
            client.ack(extra)
    return got


def create_group(target: str, group: str) -> None:
    from learner_client import TrajectoryClient

    with TrajectoryClient(target, group, "setup") as client:
        client.create_group(from_latest=True)


#: engines of the suite run seed FAULT_SEED + weight version
FAULT_SEED = 21
