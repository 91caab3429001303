"""A throwaway Redis Cluster on loopback for the tests: ``masters`` masters with one replica
each, real ``redis-server --cluster-enabled yes`` processes, joined with
``redis-cli --cluster create``, no persistence, a short node timeout (a master's death is
noticed and its replica promoted in about two seconds)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time

from rollout_gateway.commands.engine_process import free_ports

NODE_TIMEOUT_MS = 1000


def _cli(port: int, *args: str, timeout: float = 10.0) -> str:
    return subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args],
                          capture_output=True, text=True, timeout=timeout).stdout


class LocalCluster:
    """``with LocalCluster() as c: c.url`` -> ``redis+cluster://127.0.0.1:p1,...``."""

    def __init__(self, masters: int = 3, replicas: int = 1, *, persist: bool = False) -> None:
        """``persist``: each node keeps an append-only file (``appendfsync always``), so
        :meth:`restart_all` brings back what it had acknowledged."""
        for tool in ("redis-server", "redis-cli"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool} not found (scripts/setup-env.sh installs Redis)")
        self.n_masters, self.replicas = masters, replicas
        self.persist = persist
        self.dir = tempfile.mkdtemp(prefix="rg-cluster-")
        self.ports: list[int] = []
        self.bus: dict[int, int] = {}  # node port -> its cluster bus port
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        live = [p for p in self.ports if self.procs[p].poll() is None]
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in live)

    def start(self) -> LocalCluster:
        n = self.n_masters * (1 + self.replicas)
        # node and cluster-bus ports (Redis 7 cluster-port) below the ephemeral range: a
        # bind(0) port, or its port + 10000 (the default bus), an outgoing connection under
        # load could take before redis-server binds it
        ports = free_ports(2 * n)
        self.ports = ports[:n]
        self.bus = dict(zip(ports[:n], ports[n:]))
        for p in self.ports:
            self._spawn(p)
        for p in self.ports:
            self._wait_ping(p)
        if self.n_masters == 1 and self.replicas == 0:
            # redis-cli --cluster create wants 3 masters: one node takes every slot itself
            _cli(self.ports[0], "cluster", "addslotsrange", "0", "16383")
        else:
            out = subprocess.run(
                ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                 "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                capture_output=True, text=True, timeout=60)
            if out.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout}{out.stderr}")
        self.wait_ok()
        return self

    def _spawn(self, port: int) -> None:
        d = os.path.join(self.dir, str(port))
        os.makedirs(d, exist_ok=True)
        self.procs[port] = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
             "--cluster-enabled", "yes", "--cluster-port", str(self.bus[port]),
             "--cluster-config-file", "nodes.conf",
             "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
             # a replica takes over however long ago it last heard from its master
             "--cluster-replica-validity-factor", "0",
             # the first full sync at once (the default waits 5 s for more replicas)
             "--repl-diskless-sync-delay", "0", "--save", "",
             *(("--appendonly", "yes", "--appendfsync", "always") if self.persist
               else ("--appendonly", "no")),
             "--dir", d, "--logfile", os.path.join(d, "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def _wait_ping(self, port: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if _cli(port, "ping").strip() == "PONG":
                return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on {port} did not start")

    def nodes(self) -> list[dict]:
        """CLUSTER NODES as seen by a live node: id, port, role, failed, the master's id
        (``of``, replicas), slots."""
        for p in self.ports:
            if self.procs[p].poll() is None:
                out = _cli(p, "cluster", "nodes")
                if out.strip():
                    break
        rows = []
        for line in out.strip().splitlines():
            f = line.split()
            rows.append({"id": f[0], "port": int(f[1].split("@")[0].rsplit(":", 1)[1]),
                         "master": "master" in f[2], "failed": "fail" in f[2],
                         "of": f[3], "slots": f[8:]})
        return rows

    def masters(self) -> list[int]:
        return sorted(r["port"] for r in self.nodes()
                      if r["master"] and not r["failed"] and r["slots"])

    def replicas_of(self, port: int) -> int:
        """How many live replicas the master on ``port`` has now."""
        rows = self.nodes()
        mid = next(r["id"] for r in rows if r["port"] == port)
        return sum(r["of"] == mid and not r["master"] and not r["failed"]
                   and self.procs[r["port"]].poll() is None for r in rows)

    def master_of(self, key: str) -> int:
        """The port of the master serving ``key``'s slot now."""
        slot = int(_cli(self.ports[0] if self.procs[self.ports[0]].poll() is None
                        else self.masters()[0], "cluster", "keyslot", key).strip())
        for r in self.nodes():
            if not r["master"] or r["failed"]:
                continue
            for rng in r["slots"]:
                if rng.startswith("["):
                    continue
                lo, _, hi = rng.partition("-")
                if int(lo) <= slot <= int(hi or lo):
                    return r["port"]
        raise RuntimeError(f"no master serves slot {slot}")

    def wait_ok(self, timeout: float = 30.0, *, replicas: int | None = None) -> None:
        """Every live node says cluster_state:ok, every slot has a live master and
        ``replicas`` replicas (default: all started) have synced with their master."""
        want = self.n_masters * self.replicas if replicas is None else replicas
        deadline = time.monotonic() + timeout
        seen = "no node answered"
        while time.monotonic() < deadline:
            live = [p for p in self.ports if self.procs[p].poll() is None]
            states = {p: _cli(p, "cluster", "info") for p in live}
            not_ok = [p for p, info in states.items() if "cluster_state:ok" not in info]
            seen = f"live nodes {live}; not cluster_state:ok: {not_ok}"
            if not not_ok:
                served = sum(len(r["slots"]) > 0 for r in self.nodes()
                             if r["master"] and not r["failed"])
                synced = sum("master_link_status:up" in _cli(p, "info", "replication")
                             for p in live)
                seen += f"; masters serving slots {served}/{self.n_masters}, replicas " \
                        f"synced {synced}/{want}"
                if served == self.n_masters and synced >= want:
                    return
            time.sleep(0.1)
        logs = "\n".join(f"--- node {p} (bus {self.bus.get(p)}, exit "
                         f"{self.procs[p].poll()}):\n{self.log_tail(p)}" for p in self.ports)
        raise RuntimeError(f"the Redis Cluster did not become ok in {timeout:.0f}s: {seen}\n"
                           f"{logs}")

    def log_tail(self, port: int, lines: int = 8) -> str:
        try:
            with open(os.path.join(self.dir, str(port), "redis.log"), errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"

    def kill(self, port: int) -> None:
        """SIGKILL one node (no goodbye: the others notice after the node timeout)."""
        proc = self.procs[port]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def restart(self, port: int) -> None:
        """Start a killed node again on its port and directory: it rejoins (its master's
        slots now served by the promoted replica, it becomes that one's replica) and the
        cluster is whole again (every replica synced)."""
        if self.procs[port].poll() is None:
            raise RuntimeError(f"node {port} is running")
        self._spawn(port)
        self._wait_ping(port)
        self.wait_ok()

    def wait_promoted(self, dead: int, timeout: float = 30.0) -> None:
        """The dead master's slots are served by a live master again."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = self.nodes()
            if any(r["port"] == dead and r["failed"] for r in rows):
                if len([r for r in rows if r["master"] and not r["failed"]
                        and r["slots"]]) == self.n_masters:
                    # the promoted replica has none of its own now
                    self.wait_ok(timeout=max(1.0, deadline - time.monotonic()),
                                 replicas=self.n_masters * self.replicas - 1)
                    return
            time.sleep(0.1)
        raise RuntimeError(f"no replica took over from master {dead}")

    def restart_all(self, timeout: float = 60.0) -> None:
        """Every node stopped (SIGTERM: each writes its files and exits) and started again
        on its port and directory; waits until the cluster is whole (``persist`` keeps the
        data)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            proc.wait(timeout=30)
        for p in self.ports:
            self._spawn(p)
        for p in self.ports:
            self._wait_ping(p)
        self.wait_ok(timeout=timeout)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
