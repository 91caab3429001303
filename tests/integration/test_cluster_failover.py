"""Gateway replicas on a Redis Cluster, under load, while parts die.

A real Redis Cluster of 3 masters + 3 replicas on loopback (``_cluster_support``), the
trajectory store sharded over its masters (``shards=3``), gateway replicas as
``rollout-gateway serve`` processes, a reference engine, and a learner pulling over gRPC
(credit, acks, leases) while clients keep posting rollouts with request ids and retry what
they are told to retry (429/503 with ``Retry-After``, or a connection the dead replica
dropped). Counted: trajectories the gateway acknowledged (a 200 whose trajectory was
published) vs trajectories the learner was delivered (deduplicated by id), and every error a
client saw. Nothing acknowledged may be lost, and every error must be retryable.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter

import httpx
import numpy as np
import pytest
from _cluster_support import LocalCluster
from _gateway_support import GatewayProcess, pull_ids, wait_for

from learner_client import TrajectoryClient
from learner_client.errors import TrajectoryClientError
from rollout_gateway.store.keys import KeyLayout

pytestmark = pytest.mark.integration

SHARDS = 3
#: leases short enough that what a dead Pull stream held comes back within the test
LEASE_S = 3


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(masters=3, replicas=1) as c:
        yield c


def _urls(cluster: LocalCluster) -> tuple[str, str, str]:
    prefix = f"fo-{uuid.uuid4().hex[:8]}"
    store = (f"{cluster.url}/?prefix={prefix}&shards={SHARDS}&lease_seconds={LEASE_S}"
             "&replica_acks=1")  # acknowledged = on a replica too
    return prefix, store, f"{cluster.url}/?prefix={prefix}"


class Load:
    """Client threads posting rollouts round-robin over the replicas' URLs; each request
    is retried (same request_id) while the answer says retry, on the next replica."""

    def __init__(self, urls: list[str], threads: int = 3) -> None:
        self.urls = urls
        self.acked: set[str] = set()  # trajectory ids answered 200 and published
        self.errors: Counter[str] = Counter()  # what clients saw, by kind
        self.bad: list[str] = []  # errors that were not retryable
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(threads)]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def count(self) -> int:
        with self.lock:
            return len(self.acked)

    def _run(self, i: int) -> None:
        k = i
        with httpx.Client(timeout=60) as http:
            while not self.stop.is_set():
                rid = uuid.uuid4().hex
                body = {"input_ids": [5 + i, 7, 9], "n": 2, "request_id": rid,
                        "sampling_params": {"max_new_tokens": 4, "temperature": 1.0,
                                            "ignore_eos": True}}
                for _attempt in range(60):
                    url = self.urls[k % len(self.urls)]
                    k += 1
                    try:
                        r = http.post(url + "/v1/rollouts", json=body)
                    except httpx.TransportError as exc:  # a replica died under the request
                        self._saw(f"connection:{type(exc).__name__}")
                        continue
                    if r.status_code in (429, 503):
                        ra = r.headers.get("retry-after")
                        self._saw(f"{r.status_code}" + ("" if ra else ":no-retry-after"))
                        if not ra:
                            self.bad.append(f"{r.status_code} without Retry-After: {r.text}")
                        time.sleep(min(float(ra or 1), 0.5))
                        continue
                    if r.status_code != 200:
                        self._saw(str(r.status_code))
                        self.bad.append(f"{r.status_code}: {r.text[:300]}")
                        break
                    trajs = r.json()["trajectories"]
                    failed = [t for t in trajs if t.get("metadata", {}).get("publish_error")]
                    if failed:  # generated but not stored: the client retries it
                        self._saw("publish_error")
                        continue
                    with self.lock:
                        self.acked.update(t["trajectory_id"] for t in trajs)
                    break

    def _saw(self, kind: str) -> None:
        with self.lock:
            self.errors[kind] += 1


class Learner:
    """One learner thread: pull (gRPC, credit), ack, repeat; reconnects on retryable
    errors; records every delivered trajectory id (duplicates counted)."""

    def __init__(self, grpc_targets: list[str], group: str) -> None:
        self.targets, self.group = grpc_targets, group
        self.delivered: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.bad: list[str] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Learner:
        c = TrajectoryClient(self.targets[0], group=self.group)
        c.create_group()
        c.close()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(60)

    def ids(self) -> set[str]:
        with self.lock:
            return set(self.delivered)

    def _run(self) -> None:
        k = 0
        while not self.stop.is_set():
            c = TrajectoryClient(self.targets[k % len(self.targets)], group=self.group,
                                 consumer=f"learner-{k}")
            k += 1
            try:
                while not self.stop.is_set():
                    rs = c.pull(32, timeout=0.5)
                    with self.lock:
                        self.delivered.update(r.trajectory_id for r in rs)
                    if rs:
                        c.ack(rs)
            except TrajectoryClientError as exc:
                with self.lock:
                    self.errors[exc.code] += 1
                if not exc.retryable:
                    self.bad.append(str(exc))
                time.sleep(0.1)
            except Exception as exc:  # noqa: BLE001 - reported, never a silent dead thread
                self.bad.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.1)
            finally:
                try:
                    c.close()
                except Exception:  # noqa: BLE001 - a dead channel may fail to close
                    pass


def _drained(load: Load, learner: Learner, timeout: float = 30.0) -> set[str]:
    """Wait until every acknowledged trajectory was delivered; returns those missing."""
    want = set(load.acked)
    try:
        wait_for(lambda: want <= learner.ids(), timeout, "the learner to receive every "
                 "acknowledged trajectory", every=0.1)
    except AssertionError:
        pass
    return want - learner.ids()


def test_a_redis_master_dies_under_load_and_nothing_acknowledged_is_lost(cluster, engine):
    prefix, store, registry = _urls(cluster)
    engines = {"e0": engine.url}
    with GatewayProcess(engines, store_url=store, registry_url=registry) as a, \
            GatewayProcess(engines, store_url=store, registry_url=registry) as b:
        targets = [f"127.0.0.1:{g.grpc_port}" for g in (a, b)]
        with Learner(targets, "job") as learner:
            with Load([a.url, b.url]) as load:
                wait_for(lambda: load.count() >= 12, 60, "load before the kill", every=0.05)
                # the master of one shard (SIGKILL: no goodbye); its replica takes over
                dead = cluster.master_of(KeyLayout(prefix, shards=SHARDS, cluster=True)
                                         .shard_key(0, "stream"))
                cluster.kill(dead)
                try:
                    before = load.count()
                    cluster.wait_promoted(dead)
                    promoted_at = load.count()
                    wait_for(lambda: load.count() >= promoted_at + 12, 60,
                             "load after the promotion", every=0.05)
                finally:  # the cluster whole again for the module's other tests
                    cluster.restart(dead)
            missing = _drained(load, learner)  # the learner still pulling
        dups = {t: n for t, n in learner.delivered.items() if n > 1}
        print(f"\nmaster kill: acknowledged {len(load.acked)} (before kill {before}), "
              f"delivered {len(learner.delivered)} distinct ({sum(dups.values())} "
              f"deliveries of {len(dups)} ids more than once), missing {len(missing)}; "
              f"client errors {dict(load.errors)}; learner errors {dict(learner.errors)}")
        assert not missing, (sorted(missing)[:10], a.log_tail(), b.log_tail())
        assert not load.bad and not learner.bad, (load.bad[:5], learner.bad[:5],
                                                  a.tracebacks(), b.tracebacks())
        assert len(load.acked) >= 24


def test_a_gateway_replica_dies_mid_rollout_and_nothing_acknowledged_is_lost(cluster, engine):
    _prefix, store, registry = _urls(cluster)
    engines = {"e0": engine.url}
    with GatewayProcess(engines, store_url=store, registry_url=registry) as a:
        b = GatewayProcess(engines, store_url=store, registry_url=registry).start()
        try:
            with Learner([f"127.0.0.1:{a.grpc_port}", f"127.0.0.1:{b.grpc_port}"],
                         "job") as learner:
                with Load([a.url, b.url]) as load:
                    wait_for(lambda: load.count() >= 12, 60, "load before the kill",
                             every=0.05)
                    b.proc.kill()  # SIGKILL mid-rollout: its clients' connections drop
                    b.proc.wait(10)
                    after = load.count()
                    wait_for(lambda: load.count() >= after + 12, 60, "load on the survivor",
                             every=0.05)
                missing = _drained(load, learner)  # the learner still pulling
        finally:
            b.stop()
        dups = {t: n for t, n in learner.delivered.items() if n > 1}
        print(f"\nreplica kill: acknowledged {len(load.acked)}, delivered "
              f"{len(learner.delivered)} distinct ({len(dups)} ids more than once), missing "
              f"{len(missing)}; client errors {dict(load.errors)}; learner errors "
              f"{dict(learner.errors)}")
        assert not missing, (sorted(missing)[:10], a.log_tail())
        assert not load.bad and not learner.bad, (load.bad[:5], learner.bad[:5])
        assert len(load.acked) >= 24


class Session:
    """One agent session's client (``/v1/chat/completions`` with ``x-session-id``): a turn
    is posted to the first replica of the list and, while the answer says retry (409 or 503
    with ``Retry-After``), again with the same messages; a connection a dead replica dropped
    moves it to the next replica. Kept: the model tokens of every answered turn, and every
    error the client saw."""

    def __init__(self, sid: str) -> None:
        self.sid = sid
        self.messages: list[dict] = [{"role": "user", "content": "hello"}]
        self.acked: list[list[int]] = []  # the model tokens of every answered turn
        self.errors: Counter[str] = Counter()
        self.bad: list[str] = []

    def body(self, **kw) -> dict:
        return {"model": "reference", "messages": self.messages, "max_tokens": 4, **kw}

    def turn(self, urls: list[str], timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        k = 0
        with httpx.Client(timeout=60) as http:
            while time.monotonic() < deadline:
                try:
                    r = http.post(urls[k % len(urls)] + "/v1/chat/completions",
                                  json=self.body(), headers={"x-session-id": self.sid})
                except httpx.TransportError as exc:
                    self.errors[f"connection:{type(exc).__name__}"] += 1
                    k += 1
                    continue
                if r.status_code in (409, 503):
                    ra = r.headers.get("retry-after")
                    self.errors[str(r.status_code)] += 1
                    if not ra:
                        self.bad.append(f"{r.status_code} without Retry-After: {r.text[:300]}")
                    time.sleep(min(float(ra or 1), 0.2))  # the client's backoff
                    continue
                if r.status_code != 200:
                    self.bad.append(f"{r.status_code}: {r.text[:300]}")
                    raise AssertionError(self.bad[-1])
                return self.answered(r.json())
        raise AssertionError(f"turn {len(self.acked)} unanswered for {timeout} s: "
                             f"{dict(self.errors)} {self.bad[:3]}")

    def answered(self, answer: dict) -> dict:
        choice = answer["choices"][0]
        self.acked.append(choice["rollout"]["token_ids"])
        self.messages += [{"role": "assistant", "content": choice["message"]["content"]},
                          {"role": "user", "content": "go"}]
        return choice["rollout"]


def _session_on_a_master_with_a_replica(cluster: LocalCluster, layout: KeyLayout) -> str:
    """A session id whose keys live on a master that has a live replica to promote."""
    from rollout_gateway.sessions.redis_store import RedisKeys
    from rollout_gateway.settings import DEFAULT_TENANT

    for _ in range(64):
        sid = f"s-{uuid.uuid4().hex[:8]}"
        head = RedisKeys(layout).session((DEFAULT_TENANT, sid))[0]
        if cluster.replicas_of(cluster.master_of(head)):
            return sid
    raise AssertionError("no master with a live replica")


def test_a_session_outlives_a_dead_gateway_replica_and_a_dead_redis_master(cluster,
                                                                             make_engine):
    """An agent session on the cluster: its turns alternate between two replicas; the
    replica serving a turn is SIGKILLed mid-turn and the session continues on the other
    (409 + Retry-After until the dead one's lock lapses); then the master holding the
    session's keys is SIGKILLed and the session continues once its replica is promoted.
    Every answered turn is in the published trajectory, token for token; clients saw only
    retryable errors."""
    from rollout_gateway.sessions.redis_store import RedisKeys
    from rollout_gateway.settings import DEFAULT_TENANT

    slow = make_engine(seed=1, step_delay_ms=20)  # a turn still running when its replica dies
    prefix, store, registry = _urls(cluster)
    layout = KeyLayout(prefix, shards=SHARDS, cluster=True)
    engines = {"e0": slow.url}
    env = {"ROLLOUT_GATEWAY_SESSION_LEASE_S": "1"}  # a dead replica's lock lapses in 1 s
    s = Session(_session_on_a_master_with_a_replica(cluster, layout))
    b = GatewayProcess(engines, store_url=store, registry_url=registry, env=env)
    with GatewayProcess(engines, store_url=store, registry_url=registry, env=env) as a:
        b.start()
        try:
            for gw in (a, b, a):  # each turn on the other replica
                s.turn([gw.url])
            # replica A dies mid-turn: its client's connection drops, the turn is not recorded
            with httpx.stream("POST", a.url + "/v1/chat/completions", timeout=60,
                              headers={"x-session-id": s.sid},
                              json=s.body(max_tokens=200, stream=True)) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                a.proc.kill()
                a.proc.wait(10)
                with pytest.raises(httpx.HTTPError):
                    for _ in lines:
                        pass
            s.errors["connection:dropped-mid-stream"] += 1
            s.turn([b.url])  # the same turn on B: 409 until A's lock lapses, then served

            # the master holding the session dies; its replica is promoted
            head = RedisKeys(layout).session((DEFAULT_TENANT, s.sid))[0]
            dead = cluster.master_of(head)
            assert cluster.replicas_of(dead) >= 1
            cluster.kill(dead)
            try:
                s.turn([b.url])  # during the failover: 503 + Retry-After until promoted
                cluster.wait_promoted(dead)
                s.turn([b.url])
                assert cluster.master_of(head) != dead
                r = httpx.post(f"{b.url}/v1/sessions/{s.sid}/end", json={"reward": 1.0},
                               timeout=30)
                assert r.status_code == 200 and r.json()["published"], r.text
                tid = r.json()["trajectory_id"]
                t = pull_ids(b, {tid})[tid]
            finally:
                cluster.restart(dead)  # the cluster whole again for the module's other tests
        finally:
            b.stop()
    print(f"\nsession: {len(s.acked)} turns answered; client errors {dict(s.errors)}")
    assert not s.bad, s.bad
    assert t.metadata["session_turns"] == str(len(s.acked)) == "6"
    model = np.asarray(t.token_ids)[np.asarray(t.loss_mask) == 1].tolist()
    assert model == [x for turn in s.acked for x in turn]  # every answered turn, in order
    assert all(k in ("409", "503") or k.startswith("connection:") for k in s.errors), s.errors


def test_everything_restarts_and_nothing_acknowledged_is_lost(engine):
    """Gateway replicas and every Redis node stopped (SIGTERM) and started again on the
    same ports and data (append-only files, ``appendfsync always``): every trajectory
    acknowledged before is delivered after (the consumer group and what it had not acked
    survive); clients and learners saw only retryable errors."""
    with LocalCluster(masters=3, replicas=1, persist=True) as c:
        prefix, store, registry = _urls(c)
        engines = {"e0": engine.url}

        def replicas() -> list[GatewayProcess]:
            return [GatewayProcess(engines, store_url=store, registry_url=registry).start()
                    for _ in range(2)]

        before = replicas()
        try:
            c0 = TrajectoryClient(f"127.0.0.1:{before[0].grpc_port}", group="job")
            c0.create_group()  # the learner's group, nothing pulled before the restart
            c0.close()
            with Load([g.url for g in before]) as load:
                wait_for(lambda: load.count() >= 16, 60, "load before the restart",
                         every=0.05)
        finally:
            for g in before:
                g.stop()
        c.restart_all()
        after = replicas()
        try:
            with Learner([f"127.0.0.1:{g.grpc_port}" for g in after], "job") as late:
                want = set(load.acked)
                try:
                    wait_for(lambda: want <= late.ids(), 60,
                             "every acknowledged trajectory delivered", every=0.1)
                except AssertionError:
                    missing = want - late.ids()
                    raise AssertionError(
                        f"{len(missing)} of {len(want)} acknowledged trajectories not "
                        f"delivered after the restart: {sorted(missing)[:5]}; learner errors "
                        f"{dict(late.errors)} {late.bad[:3]}; "
                        f"{after[0].log_tail(3000)}") from None
        finally:
            for g in after:
                g.stop()
    print(f"\nrestart everything: acknowledged {len(load.acked)}, delivered after the "
          f"restart {len(late.ids())}; client errors {dict(load.errors)}; learner errors "
          f"{dict(late.errors)}")
    assert not load.bad and not late.bad, (load.bad, late.bad)
    assert len(load.acked) >= 16
