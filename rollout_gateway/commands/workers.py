"""``rollout-gateway serve --workers N``: N gateway processes behind one HTTP and one gRPC port.

Each worker is a whole gateway (``serve.serve_async``) in its own process, i.e. a replica
sharing the Redis store and registry (``settings.workers > 1`` refuses memory://): one
swap leader at a time (the registry's lease), one staleness bound (each worker reports its
in-flight count under its own ``replica_id``), engine probes per worker. Every worker binds
the ports itself with SO_REUSEPORT (its own HTTP listening socket; gRPC sets it by default),
so the kernel spreads new connections over the workers; a port 0 is resolved once here and
held (bound, not listening) until the workers are gone.

The parent only supervises: it prints the ready line once every worker serves, forwards
SIGTERM/SIGINT to all of them (each drains as ``serve`` does: health 503, in-flight rollouts
get ``drain_grace_s``) and exits when they have. A worker that exits on its own (a crash)
stops the others and the parent exits 1: a process manager restarts the whole unit; a
parent that dies (even by SIGKILL) takes its workers along (Linux: they get SIGTERM).
Agent sessions live in the shared session store (docs/agents.md), so any worker serves
any turn of a session.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

log = logging.getLogger("rollout_gateway.serve")

#: ``(settings, ready, sockets, worker_index) -> None``: one gateway, run to its end
RunGateway = Callable[..., None]


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def reuseport_socket(host: str, port: int, *, listen: bool) -> socket.socket:
    """A TCP socket bound to (host, port) with SO_REUSEADDR and SO_REUSEPORT (several
    processes bind the same port; the kernel spreads connections over the listening ones)."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host.strip("[]"), port))
        if listen:
            sock.listen(2048)
            sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _die_with_parent(parent: int) -> None:
    """Linux: SIGTERM this worker (it drains) when the supervising process dies, even by
    SIGKILL (prctl PR_SET_PDEATHSIG); elsewhere a no-op."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # it died before the prctl
            os.kill(os.getpid(), signal.SIGTERM)


def _worker(run_gateway: RunGateway, settings, index: int, conn: Connection, log_level: str,
            parent: int) -> None:
    """One worker process: the gateway on SO_REUSEPORT sockets; reports readiness on conn."""
    _die_with_parent(parent)
    logging.basicConfig(level=log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[w{index}]: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    sock = reuseport_socket(settings.http_host, settings.http_port, listen=True)

    def ready(http_port: int, grpc_port: int) -> None:
        conn.send((index, os.getpid(), http_port, grpc_port))

    try:
        run_gateway(settings, ready, [sock], index)
    finally:
        sock.close()


def run_workers(settings, ready: Callable[[int, int], None], run_gateway: RunGateway,
                log_level: str = "info") -> int:
    """Start ``settings.workers`` workers, supervise them until SIGTERM/SIGINT; exit code.
    ``run_gateway(settings, ready, sockets, worker)`` runs one gateway to its end in a worker
    (``serve.run_gateway``: passed in, so this module does not import ``serve``)."""
    held = []  # port-0 reservations, held until the workers are gone
    if settings.http_port == 0:
        held.append(reuseport_socket(settings.http_host, 0, listen=False))
        settings = settings.model_copy(update={"http_port": held[-1].getsockname()[1]})
    if settings.grpc_port == 0:
        held.append(reuseport_socket(settings.grpc_host, 0, listen=False))
        settings = settings.model_copy(update={"grpc_port": held[-1].getsockname()[1]})
    stop_r, stop_w = os.pipe()  # the signal handler wakes the supervisor through it
    os.set_blocking(stop_w, False)
    signalled: list[int] = []

    def on_signal(signum, _frame) -> None:
        signalled.append(signum)
        with contextlib.suppress(OSError):
            os.write(stop_w, b"x")

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    ctx = mp.get_context("spawn")
    procs: list[mp.process.BaseProcess] = []
    conns: list[Connection] = []
    try:
        for i in range(settings.workers):
            r, w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker,
                           args=(run_gateway, settings, i, w, log_level, os.getpid()),
                            name=f"rollout-gateway-worker-{i}")
            p.start()
            w.close()
            procs.append(p)
            conns.append(r)
        code = _supervise(settings, procs, conns, stop_r, signalled, ready)
    finally:
        _stop_all(procs, settings.drain_grace_s + 15.0)
        for s, h in old.items():
            signal.signal(s, h)
        for fd in (stop_r, stop_w):
            os.close(fd)
        for c in conns:
            c.close()
        for sock in held:
            sock.close()
    return code


def _supervise(settings, procs, conns, stop_r: int, signalled: list[int],
               ready: Callable[[int, int], None]) -> int:
    pending = dict(zip(conns, range(len(conns))))
    sentinels = {p.sentinel: p for p in procs}
    while True:
        got = wait([*pending, *sentinels, stop_r])
        if signalled or stop_r in got:
            log.info("signal %s: stopping %d workers (drain up to %ss)",
                     signalled[0] if signalled else "?", len(procs), settings.drain_grace_s)
            return 0
        for obj in got:
            if obj in sentinels:
                p = sentinels[obj]
                log.error("worker %s (pid %s) exited with %s; stopping the others", p.name,
                          p.pid, p.exitcode)
                return 1
            if obj in pending:
                try:
                    index, pid, http_port, grpc_port = obj.recv()
                except EOFError:
                    continue  # its sentinel follows
                del pending[obj]
                log.info("worker %d (pid %d) serving", index, pid)
                if not pending:
                    ready(http_port, grpc_port)


def _stop_all(procs, timeout: float) -> None:
    """SIGTERM every live worker (each drains), wait up to ``timeout``, then SIGKILL."""
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            log.warning("worker %s did not stop within %.0fs: killing it", p.name, timeout)
            p.kill()
            p.join(5)
