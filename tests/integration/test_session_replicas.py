"""Stateless replicas: three ``rollout-gateway serve`` processes sharing one Redis (store,
registry, sessions) in front of two reference engines. A session's turns go to whichever
replica the client reaches, one replica dies (SIGKILL) mid-turn, another ends it, a third
takes the reward; idle sessions and held trajectories of a dead replica are published by
the others; a request_id means one request on every replica.

Counted: every turn a client was answered (acknowledged) is in the published trajectory,
token for token; the one turn cut by the kill is not (its client got no answer)."""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from _gateway_support import REDIS_URL, GatewayProcess, pull_ids, wait_for
from _redis_support import delete_prefix_sync

from rollout_gateway.commands.engine_process import EngineProcess

pytestmark = pytest.mark.integration

ADMIN, LEARNER = "admin-key-0123456789", "learner-key-0123456789"
A, B = "team-a-token-0123456789", "team-b-token-0123456789"
ENV = {"ROLLOUT_GATEWAY_ADMIN_API_KEY": ADMIN, "ROLLOUT_GATEWAY_LEARNER_API_KEY": LEARNER,
       "ROLLOUT_GATEWAY_CLIENT_TENANTS": json.dumps([{"name": "team-a", "token": A},
                                                     {"name": "team-b", "token": B}]),
       "ROLLOUT_GATEWAY_SESSION_LEASE_S": "1"}


def _h(token: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", **extra}


def _chat(gw, sid: str, messages: list, token: str = A, **kw) -> httpx.Response:
    body = {"model": "reference", "messages": messages, "max_tokens": 4, **kw}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=120,
                      headers=_h(token, **{"x-session-id": sid}))


def _reply(r: httpx.Response) -> tuple[str, dict]:
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["message"]["content"], c["rollout"]


@pytest.fixture(scope="module")
def engines():
    with EngineProcess(seed=3, step_delay_ms=20) as e0, \
            EngineProcess(seed=3, step_delay_ms=20) as e1:
        yield {"e0": e0.url, "e1": e1.url}


@pytest.fixture
def prefix():
    p = f"gwtest-replicas-{uuid.uuid4().hex[:8]}"
    yield p
    delete_prefix_sync(p)


def _replicas(engines, prefix, n, env=None):
    url = f"{REDIS_URL}?prefix={prefix}"
    return [GatewayProcess(engines, store_url=url, registry_url=url, env={**ENV, **(env or {})})
            for _ in range(n)]


def test_a_session_continues_on_any_replica_and_survives_a_sigkilled_one(engines, prefix):
    ra, rb, rc = (g.start() for g in _replicas(engines, prefix, 3))
    try:
        sid = f"s-{uuid.uuid4().hex[:6]}"
        m = [{"role": "user", "content": "hello"}]
        acked: list[list[int]] = []  # the model tokens of every answered turn
        turns = []
        for gw in (ra, rb, rc, rb):  # each turn on the next replica
            content, ro = _reply(_chat(gw, sid, m))
            acked.append(ro["token_ids"])
            turns.append(ro)
            m += [{"role": "assistant", "content": content}, {"role": "user", "content": "go"}]
        assert [t["turn"] for t in turns] == [0, 1, 2, 3]
        assert {t["trajectory_id"] for t in turns} == {turns[0]["trajectory_id"]}
        assert not any(t.get("branched") for t in turns)
        # the prefix stays on its engine whichever replica serves the turn
        assert len({e for t in turns for e in t["engine_ids"]}) == 1, turns
        # another tenant sees nothing of it on any replica
        assert httpx.post(f"{rc.url}/v1/sessions/{sid}/end", json={}, headers=_h(B),
                          timeout=30).status_code == 404
        # history edited on another replica: a new branch; the replaced one is published
        forked = f"f-{uuid.uuid4().hex[:6]}"
        content, first = _reply(_chat(ra, forked, [{"role": "user", "content": "hi"}]))
        edited = [{"role": "user", "content": "edited"},
                  {"role": "assistant", "content": content}, {"role": "user", "content": "go"}]
        _, second = _reply(_chat(rb, forked, edited))
        assert second["branched"] == "history_edited"
        assert second["trajectory_id"] != first["trajectory_id"]
        old = pull_ids(rc, {first["trajectory_id"]}, token=LEARNER)[first["trajectory_id"]]
        assert old.metadata["session_ended_by"] == "branch"
        assert np.asarray(old.token_ids)[np.asarray(old.loss_mask) == 1].tolist() == \
            first["token_ids"]

        # replica A dies mid-turn: its client gets no answer, the turn is not recorded
        with httpx.stream("POST", ra.url + "/v1/chat/completions", timeout=120,
                          headers=_h(A, **{"x-session-id": sid}),
                          json={"model": "reference", "messages": m, "max_tokens": 200,
                                "stream": True}) as s:
            lines = s.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            ra.proc.kill()
            ra.proc.wait(10)
            with pytest.raises(httpx.HTTPError):
                for _ in lines:
                    pass
        # the same turn again on B: refused (retryable) until A's lock lapses, then served
        r = _chat(rb, sid, m)
        if r.status_code == 409:
            assert r.headers.get("retry-after"), r.headers
            assert "in flight" in r.json()["error"]["message"]
            r = wait_for(lambda: (x := _chat(rb, sid, m)).status_code != 409 and x, 30,
                         "A's session lock to lapse")
        content, ro = _reply(r)
        assert ro["turn"] == 4 and ro["trajectory_id"] == turns[0]["trajectory_id"]
        acked.append(ro["token_ids"])

        # ended on C, held for a reward, rewarded through B; published once
        e = httpx.post(f"{rc.url}/v1/sessions/{sid}/end", json={"await_reward": True},
                       headers=_h(A), timeout=30)
        assert e.status_code == 200 and e.json()["awaiting_reward"], e.text
        tid = e.json()["trajectory_id"]
        assert httpx.post(f"{rb.url}/v1/trajectories/{tid}/reward", json={"reward": 1.0},
                          headers=_h(B), timeout=30).status_code == 404  # not team-b's
        got = httpx.post(f"{rb.url}/v1/trajectories/{tid}/reward", json={"reward": 0.5},
                         headers=_h(A), timeout=30)
        assert got.status_code == 200 and got.json()["published"], got.text
        again = httpx.post(f"{rc.url}/v1/trajectories/{tid}/reward", json={"reward": 0.7},
                           headers=_h(A), timeout=30)
        assert again.status_code == 409, again.text
        assert _chat(rc, sid, m).status_code == 409  # ended, on every replica

        t = pull_ids(rc, {tid}, token=LEARNER)[tid]
        assert t.reward == 0.5 and t.metadata["session_turns"] == "5"
        assert t.metadata["tenant"] == "team-a"
        model = np.asarray(t.token_ids)[np.asarray(t.loss_mask) == 1].tolist()
        assert model == [x for turn in acked for x in turn]  # nothing acknowledged lost
    finally:
        for g in (ra, rb, rc):
            g.stop()


def test_idle_sessions_and_held_trajectories_of_a_dead_replica_are_published(engines, prefix):
    env = {"ROLLOUT_GATEWAY_SESSION_IDLE_TIMEOUT_S": "1",
           "ROLLOUT_GATEWAY_SESSION_REWARD_WAIT_S": "1"}
    ra, rb = (g.start() for g in _replicas(engines, prefix, 2, env))
    try:
        idle, held = f"i-{uuid.uuid4().hex[:6]}", f"h-{uuid.uuid4().hex[:6]}"
        m = [{"role": "user", "content": "hi"}]
        _, ro = _reply(_chat(ra, idle, m))
        _reply(_chat(ra, held, m))
        e = httpx.post(f"{ra.url}/v1/sessions/{held}/end", json={"await_reward": True},
                       headers=_h(A), timeout=30)
        assert e.status_code == 200 and e.json()["awaiting_reward"], e.text
        ra.proc.kill()  # the replica that created both is gone
        ra.proc.wait(10)
        got = pull_ids(rb, {ro["trajectory_id"], e.json()["trajectory_id"]}, token=LEARNER)
        t = got[ro["trajectory_id"]]
        assert t.metadata["session_ended_by"] == "idle_timeout"
        assert np.asarray(t.token_ids)[np.asarray(t.loss_mask) == 1].tolist() == ro["token_ids"]
        h = got[e.json()["trajectory_id"]]
        assert h.metadata["reward"] == "missing" and h.reward is None
        r = _chat(rb, idle, m)
        assert r.status_code == 409 and "idle_timeout" in r.text, r.text
    finally:
        for g in (ra, rb):
            g.stop()


def test_a_request_id_is_one_request_on_every_replica(engines, prefix):
    ra, rb, rc = (g.start() for g in _replicas(engines, prefix, 3))
    try:
        body = {"input_ids": [5, 6, 7], "request_id": f"r-{uuid.uuid4().hex[:6]}", "n": 2,
                "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}

        def post(gw, b=body):
            return httpx.post(gw.url + "/v1/rollouts", json=b, headers=_h(A), timeout=120)

        with ThreadPoolExecutor(2) as ex:  # the same request on two replicas at once
            both = [f.result() for f in [ex.submit(post, ra), ex.submit(post, rb)]]
        answers = []
        for r in [*both, post(rc)]:
            assert r.status_code == 200, r.text
            answers.append([(t["trajectory_id"], t["token_ids"])
                            for t in r.json()["trajectories"]])
        assert answers[0] == answers[1] == answers[2]  # what the store holds, everywhere
        other = post(rc, {**body, "input_ids": [9]})
        assert other.status_code == 409 and "input_ids" in other.text, other.text
        ids = {tid for tid, _ in answers[0]}
        got = pull_ids(rb, ids, token=LEARNER)
        assert {k for k in got if body["request_id"] in k} == ids  # stored once
    finally:
        for g in (ra, rb, rc):
            g.stop()


def test_a_session_moves_between_replicas_on_a_redis_cluster(engines, redis_cluster):
    """The same on Redis Cluster (3 masters + 3 replicas): each session's keys on one slot,
    sessions spread over the masters."""
    prefix = f"gwtest-replicas-{uuid.uuid4().hex[:8]}"
    url = f"{redis_cluster.url}/?prefix={prefix}&shards=3"
    ra, rb = (GatewayProcess(engines, store_url=url, registry_url=url, env=ENV).start()
              for _ in range(2))
    try:
        sid = f"c-{uuid.uuid4().hex[:6]}"
        m = [{"role": "user", "content": "hello"}]
        acked = []
        for gw in (ra, rb, ra):
            content, ro = _reply(_chat(gw, sid, m))
            acked.append(ro["token_ids"])
            m += [{"role": "assistant", "content": content}, {"role": "user", "content": "go"}]
        assert ro["turn"] == 2
        e = httpx.post(f"{rb.url}/v1/sessions/{sid}/end", json={"reward": 1.0},
                       headers=_h(A), timeout=30)
        assert e.status_code == 200 and e.json()["published"], e.text
        assert _chat(ra, sid, m).status_code == 409
        tid = e.json()["trajectory_id"]
        t = pull_ids(ra, {tid}, token=LEARNER)[tid]
        assert np.asarray(t.token_ids)[np.asarray(t.loss_mask) == 1].tolist() == \
            [x for turn in acked for x in turn]
    finally:
        for g in (ra, rb):
            g.stop()
