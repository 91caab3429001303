"""Helpers for the gateway's integration tests: the gateway as a real subprocess
(``rollout-gateway serve``) and ground-truth checks of stamped trajectories."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

import rollout_gateway
from rollout_gateway.proc import wait_healthy
from rollout_gateway.commands.engine_process import free_ports

REDIS_URL = os.environ.get("ROLLOUT_GATEWAY_TEST_REDIS", "redis://127.0.0.1:6379/0")


def redis_urls() -> tuple[str, str]:
    """A store URL and a registry URL under a fresh key prefix."""
    prefix = f"gwtest-{uuid.uuid4().hex[:8]}"
    return f"{REDIS_URL}?prefix={prefix}", f"{REDIS_URL}?prefix={prefix}"


class GatewayProcess:
    """``python -m rollout_gateway serve`` on free ports."""

    def __init__(self, engines: dict[str, str], *, store_url: str = "memory://",
                 registry_url: str = "memory://", env: dict[str, str] | None = None,
                 extra_args: list[str] | None = None) -> None:
        self.port, self.grpc_port = free_ports(2)
        self.args = [sys.executable, "-m", "rollout_gateway", "serve", "--host", "127.0.0.1",
                     "--port", str(self.port), "--grpc-host", "127.0.0.1",
                     "--grpc-port", str(self.grpc_port), "--store", store_url,
                     "--registry", registry_url, "--log-level", "warning"]
        for eid, url in engines.items():
            self.args += ["--engine", f"{eid}={url}"]
        self.args += extra_args or []
        self.env = dict(os.environ)
        root = str(Path(rollout_gateway.__file__).resolve().parent.parent)
        self.env["PYTHONPATH"] = root + os.pathsep + self.env.get("PYTHONPATH", "")
        self.env.setdefault("ROLLOUT_GATEWAY_HEALTH_INTERVAL_S", "0.5")
        self.env.update(env or {})
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile("w+", prefix="gateway-", suffix=".log", delete=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 4000) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")[-n:]

    def tracebacks(self, n: int = 4) -> str:
        """The last ``n`` tracebacks in the log, whole (with the message logged before
        each): what a 500 was, where the log's tail would cut it."""
        self._log.flush()
        lines = Path(self._log.name).read_text(errors="replace").splitlines()
        found: list[str] = []
        for i, line in enumerate(lines):
            if line.startswith("Traceback (most recent call last)"):
                j = i + 1
                while j < len(lines) and (lines[j].startswith((" ", "\t")) or not lines[j]
                                          or lines[j].startswith(("During handling",
                                                                  "The above exception",
                                                                  "Traceback"))):
                    j += 1
                found.append("\n".join(lines[max(i - 1, 0):j + 1]))
        return "\n\n".join(found[-n:]) or "(no traceback in the log)"

    def start(self, timeout: float = 60.0) -> GatewayProcess:
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env)
        why = wait_healthy(self.proc, self.url + "/health", timeout, ok=(200, 503))
        if why is None:
            return self
        self.stop()
        raise RuntimeError(f"gateway {why}:\n{self.log_tail()}")

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode if self.proc else None

    def __enter__(self) -> GatewayProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._log.close()
        os.unlink(self._log.name)


def pull_ids(gw, want: set[str], *, group: str | None = None, token: str | None = None,
             timeout: float = 30.0) -> dict:
    """Pull (a fresh consumer group unless named) until every id in ``want`` arrived (an id
    also matches ``<id>.<more>``: session trajectory ids end in a random part); returns
    {id: Rollout} for everything pulled and for each wanted id. Each pull blocks until
    entries arrive."""
    import time

    from learner_client import TrajectoryClient

    got: dict = {}
    c = TrajectoryClient(f"127.0.0.1:{gw.grpc_port}", group=group or f"g-{uuid.uuid4().hex[:6]}",
                         token=token)

    def found(w: str) -> str | None:
        return next((t for t in got if t == w or t.startswith(w + ".")), None)
    try:
        c.create_group()
        deadline = time.monotonic() + timeout
        while not all(map(found, want)) and time.monotonic() < deadline:
            rs = c.pull(16, timeout=2)
            got.update({r.trajectory_id: r for r in rs})
            if rs:
                c.ack(rs)
    finally:
        c.close()
    assert all(map(found, want)), (want, set(got))
    return {**got, **{w: got[found(w)] for w in want}}


def rollout(url: str, prompt_ids: list[int], *, n: int = 1, max_new_tokens: int = 12,
            timeout: float = 120.0, **extra) -> dict:
    body = {"input_ids": prompt_ids, "n": n,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0,
                                "ignore_eos": True}, **extra}
    r = httpx.post(url + "/v1/rollouts", json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


class Streams:
    """Streamed ``/v1/rollouts`` (``"stream": true``) read on threads, the tokens of their
    chunks counted per sample, so a test acts (swaps, kills an engine) once every sample is
    under way: it waits on that event, never on a sleep. ``start`` returns a future of the
    rollout's answer (``{"trajectories": [...]}``, as :func:`rollout`)."""

    def __init__(self, url: str, workers: int = 16) -> None:
        self.url = url
        self._ex = ThreadPoolExecutor(workers)
        self._cond = threading.Condition()
        self.tokens: Counter = Counter()  # (stream, sample_index) -> tokens streamed
        self.engine: dict[tuple[int, int], str] = {}  # (stream, sample_index) -> last engine
        self._samples: set[tuple[int, int]] = set()
        self._ended: set[int] = set()
        self._n = 0

    def start(self, prompt_ids: list[int], *, n: int = 1, max_new_tokens: int = 12,
              timeout: float = 120.0, **extra) -> Future:
        body = {"input_ids": prompt_ids, "n": n, "stream": True,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0,
                                    "ignore_eos": True}, **extra}
        with self._cond:
            k, self._n = self._n, self._n + 1
            self._samples |= {(k, i) for i in range(n)}
        return self._ex.submit(self._read, k, body, timeout)

    def _read(self, k: int, body: dict, timeout: float) -> dict:
        events = []
        try:
            with httpx.stream("POST", self.url + "/v1/rollouts", json=body,
                              timeout=timeout) as r:
                if r.status_code != 200:
                    raise AssertionError(f"HTTP {r.status_code}: {r.read()[:2000]!r}")
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        break
                    ev = json.loads(line[6:])
                    events.append(ev)
                    if ev.get("type") == "chunk":
                        with self._cond:
                            self.tokens[(k, ev["sample_index"])] += len(ev["token_ids"])
                            self.engine[(k, ev["sample_index"])] = ev["engine_id"]
                            self._cond.notify_all()
        finally:
            with self._cond:
                self._ended.add(k)
                self._cond.notify_all()
        errors = [e for e in events if e.get("type") == "error"]
        assert not errors, errors
        trajs = {e["sample_index"]: e["trajectory"] for e in events
                 if e.get("type") == "trajectory"}
        assert sorted(trajs) == list(range(body["n"])), events[-3:]
        return {"trajectories": [trajs[i] for i in range(body["n"])]}

    def wait_tokens(self, k: int, timeout: float = 60.0) -> None:
        """Block until every sample started has streamed at least ``k`` tokens; fail if
        a stream ended first (the test would no longer act mid-generation)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not all(self.tokens[s] >= k for s in self._samples):
                short = {s for s in self._samples if self.tokens[s] < k}
                if any(s[0] in self._ended for s in short):
                    raise AssertionError(f"a stream ended with under {k} tokens streamed: "
                                         f"{dict(self.tokens)}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out after {timeout}s waiting for {k} tokens "
                                         f"of every sample: {dict(self.tokens)}")
                self._cond.wait(left)

    def close(self) -> None:
        self._ex.shutdown(wait=True)

    def __enter__(self) -> Streams:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_for(pred, timeout: float, what: str, every: float = 0.01):
    """Poll ``pred`` until it returns something true (returned); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def check_against_ground_truth(traj: dict, models: dict[int, object], *, atol: float = 2e-3) -> None:
    """Every token's policy_version, kv_version and logprob match fresh forward passes of
    the versions' weights (in_place segments: old KV before the switch, new weights after).

    A batched engine and an unbatched recomputation add floats in different orders, so a
    router whose top-k is a near tie can pick another expert in one of them; the token's
    logprob then differs by ~1e-2. A mismatch is accepted only when that is what happened:
    the trajectory's recorded routing differs from the recomputation's at or before the
    token, and replaying the recorded routing (R3) in the recomputation gives the stamped
    logprobs within ``atol``."""
    prompt = traj["prompt_token_ids"]
    out = traj["token_ids"]
    p = len(prompt)
    pv = np.array(traj["policy_version"])
    kv = np.array(traj["kv_version"])
    lps = np.array([np.nan if x is None else x for x in traj["logprobs"]], dtype=np.float64)
    segs = traj["segments"]
    assert len(out) == traj["num_tokens"] == len(pv) == len(kv) == len(lps)
    # segments tile the output exactly, in order: nothing lost, nothing duplicated
    assert segs[0]["start"] == 0 and segs[-1]["end"] == len(out)
    for a, b in zip(segs, segs[1:]):
        assert a["end"] == b["start"] and a["ended"] == b["began"], (a, b)
    expected_lp, expected_kv, routes = _ground_truth(traj, models)
    assert (kv == expected_kv).all(), (kv, expected_kv, segs)
    try:
        np.testing.assert_allclose(lps, expected_lp, atol=atol, rtol=0)
        return
    except AssertionError:
        recorded = _recorded_routing(traj)
        bad = int(np.flatnonzero(~(np.abs(lps - expected_lp) <= atol))[0])
        upto = p + bad  # the rows of the inputs up to the one that produced token ``bad``
        if recorded is None or (recorded[:upto] == routes[:upto]).all():
            raise
    forced = routes.copy()
    forced[:len(recorded)] = recorded
    replayed, _, _ = _ground_truth(traj, models, forced)
    np.testing.assert_allclose(lps, replayed, atol=atol, rtol=0)


def _recorded_routing(traj: dict) -> np.ndarray | None:
    """The trajectory's routed experts as rows of every input position (prompt + output
    - 1), or None without them or when they start past the prompt's first token."""
    import base64

    r = traj.get("routed_experts")
    if not r or r.get("start", 0):
        return None
    return np.frombuffer(base64.b64decode(r["data_b64"]), np.dtype(r["dtype"])).reshape(
        r["shape"]).astype(np.int64)


def _ground_truth(traj: dict, models: dict[int, object], routing: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logprob per output token, kv_version per token, the router's experts per position
    of prompt + output as recomputed), each segment scored under its version, with
    ``routing`` replayed when given."""
    from reference_engine.reference import score, score_mixed

    prompt, out, segs = traj["prompt_token_ids"], traj["token_ids"], traj["segments"]
    ids = prompt + out
    p = len(prompt)
    expected_lp = np.full(len(out), np.nan)
    expected_kv = np.zeros(len(out), dtype=np.int64)
    routes = None
    kv_now = None
    for i, s in enumerate(segs):
        a, b, v = s["start"], s["end"], s["policy_version"]
        if s["began"] == "in_place":
            prev = segs[i - 1]
            # KV before the switch came from the previous segment's version (one switch)
            assert kv_now is not None
            switch = p + a - 1
            sc = score_mixed(models[prev["policy_version"]], models[v], ids, switch, p,
                             routing=routing)
            expected_kv[a:b] = kv_now
        else:  # start / retract / abort_resume / failover: KV rebuilt under v
            sc = score(models[v], ids, p, routing=routing)
            kv_now = v
            expected_kv[a:b] = v
        expected_lp[a:b] = sc.logprobs[a:b]
        rows = sc.routed_experts  # [len(ids) - 1, L, k]: the inputs of every position
        if routes is None:
            routes = np.concatenate([rows, rows[-1:]]).astype(np.int64)
        routes[p + a - 1:p + b - 1] = rows[p + a - 1:p + b - 1]  # what produced a..b-1
    return expected_lp, expected_kv, routes
