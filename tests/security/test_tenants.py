"""Tenants on one real ``serve`` (memory store): client tokens per tenant
(``client_tenants``); sessions, request ids, held trajectories and rewards are the owner's.
Another tenant gets 404 (the same answer as for an id that never existed), the admin acts on
every tenant's, and each trajectory carries its tenant (metadata the client cannot set)."""

from __future__ import annotations

import httpx
import pytest
from _gateway_support import GatewayProcess
from _support import PATIENT_HEALTH
from _tenants import (
    ADMIN,
    ENV,
    A,
    B,
    C,
    chat,
    end,
    new_id,
    pull_until,
    reward,
    rollout,
    traj_id,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gw(engine):
    env = {**PATIENT_HEALTH, **ENV, "ROLLOUT_GATEWAY_MAX_SESSIONS_PER_TENANT": "3"}
    with GatewayProcess({"e0": engine.url}, env=env) as g:
        yield g


def test_two_tenants_cannot_see_write_end_or_reward_each_others_sessions(gw):
    sid = new_id("shared")  # both tenants use this id: two sessions, one per tenant
    a1 = chat(gw, A, sid, "hello from a")
    assert a1.status_code == 200, a1.text
    ta = traj_id(a1)
    assert ta.startswith(f"{sid}.b0.") and len(ta) >= len(sid) + 4 + 16  # a random part
    b1 = chat(gw, B, sid, "hello from b")  # "writing into" a's session id
    assert b1.status_code == 200, b1.text
    tb = traj_id(b1)
    assert tb != ta and tb.startswith(f"{sid}.b0.")
    # a's session is untouched by b's turn: a's second turn extends a's branch
    reply = a1.json()["choices"][0]["message"]["content"]
    a2 = chat(gw, A, sid, [{"role": "user", "content": "hello from a"},
                           {"role": "assistant", "content": reply},
                           {"role": "user", "content": "and again"}])
    assert a2.status_code == 200, a2.text
    info = a2.json()["choices"][0]["rollout"]
    assert info["trajectory_id"] == ta and info["branched"] is None and info["turn"] == 1

    only_a = new_id("only-a")
    assert chat(gw, A, only_a, "mine").status_code == 200
    never = new_id("never")
    for who, target in ((B, only_a), (B, never)):
        r = end(gw, who, target, {"reward": 1.0})
        assert r.status_code == 404, r.text
    r = end(gw, B, only_a, tenant="team-a")  # naming the tenant is the admin's alone
    assert r.status_code == 404, r.text
    # no existence oracle: another tenant's session answers as one that never existed
    mine, absent = end(gw, B, only_a), end(gw, B, never)
    assert mine.status_code == absent.status_code == 404
    assert mine.json()["error"]["code"] == absent.json()["error"]["code"]
    assert mine.text.replace(only_a, "X") == absent.text.replace(never, "X")

    held = end(gw, A, only_a, {"await_reward": True})
    assert held.status_code == 200 and held.json()["awaiting_reward"], held.text
    tid = held.json()["trajectory_id"]
    assert reward(gw, B, tid, 1.0).status_code == 404  # b cannot reward a's
    assert reward(gw, C, tid, 1.0).status_code == 404
    r = reward(gw, A, tid, 0.5)
    assert r.status_code == 200 and r.json()["published"], r.text
    assert reward(gw, A, tid, 0.7).status_code == 409  # published: no second reward

    # the admin acts on every tenant's session: both have `sid`, so it names the tenant
    amb = end(gw, ADMIN, sid)
    assert amb.status_code == 400 and "tenant" in amb.json()["error"]["message"]
    r = end(gw, ADMIN, sid, {"reward": -1.0}, tenant="team-b")
    assert r.status_code == 200 and r.json()["trajectory_id"] == tb, r.text
    assert end(gw, B, sid).status_code == 409  # b's own session: ended (by the admin)
    r = end(gw, A, sid, {"reward": 1.0})  # a's is still open, and a's to end
    assert r.status_code == 200 and r.json()["trajectory_id"] == ta and r.json()["published"]

    got = pull_until(gw, {ta, tb, tid})
    assert got[ta].metadata["tenant"] == "team-a" and got[ta].reward == 1.0
    assert got[tb].metadata["tenant"] == "team-b" and got[tb].reward == -1.0
    assert got[tid].metadata["tenant"] == "team-a" and got[tid].reward == 0.5


def test_a_client_cannot_set_the_tenant_stamp(gw):
    """'tenant' is a gateway-owned metadata key: a request naming it is refused with a
    message naming the key, on the OpenAI routes and on /v1/rollouts alike."""
    r = chat(gw, B, None, "no session", metadata={"tenant": "team-a"})
    assert r.status_code == 422 and "'tenant'" in r.text, r.text
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2},
            "metadata": {"tenant": "team-a"}}
    r = rollout(gw, B, body)
    assert r.status_code == 422 and "'tenant'" in r.text, r.text
    r = chat(gw, B, None, "no session")  # without it: stamped with the caller's tenant
    assert r.status_code == 200, r.text
    tid = traj_id(r)
    assert pull_until(gw, {tid})[tid].metadata["tenant"] == "team-b"


def test_failed_calls_open_no_session_and_sessions_are_counted_per_tenant(gw):
    for i in range(20):  # invalid in a session (n=2): 400, and no session held open
        r = chat(gw, C, new_id(f"bad{i}"), "x", n=2)
        assert r.status_code == 400, r.text
    r = chat(gw, C, new_id("bad"), "x", top_logprobs=3)  # needs logprobs: true
    assert r.status_code == 400, r.text
    opened = [new_id("c") for _ in range(3)]  # max_sessions_per_tenant = 3
    for sid in opened:
        r = chat(gw, C, sid, "hi")
        assert r.status_code == 200, r.text
    r = chat(gw, C, new_id("c"), "one more")
    assert r.status_code == 429 and "max_sessions_per_tenant" in r.text, r.text
    metrics = httpx.get(gw.url + "/metrics", timeout=10).text
    assert 'rollout_gateway_tenant_sessions_open{tenant="team-c"} 3.0' in metrics
    assert chat(gw, C, None, "no session: not counted").status_code == 200
    other = new_id("b")  # another tenant is not stopped by c's sessions
    assert chat(gw, B, other, "hi").status_code == 200
    assert end(gw, B, other).status_code == 200
    assert end(gw, C, opened[0]).status_code == 200  # an end frees a place
    last = new_id("c")
    assert chat(gw, C, last, "now it fits").status_code == 200
    for sid in [*opened[1:], last]:
        assert end(gw, C, sid).status_code == 200


def _ids(r) -> list[str]:
    return [t["trajectory_id"] for t in r.json()["trajectories"]]


def _tokens(r) -> list:
    return [t["token_ids"] for t in r.json()["trajectories"]]


def test_request_id_is_the_tenants_own_and_means_one_body(gw):
    rid = new_id("req")
    body = {"input_ids": [1, 2, 3], "n": 2, "request_id": rid,
            "sampling_params": {"max_new_tokens": 4}}
    a1 = rollout(gw, A, body)
    assert a1.status_code == 200, a1.text
    a2 = rollout(gw, A, body)  # a retry: the stored answer, not a new generation
    assert a2.status_code == 200, a2.text
    assert _ids(a2) == _ids(a1) and _tokens(a2) == _tokens(a1)
    for field, changed in (("input_ids", {"input_ids": [4, 5, 6]}),
                           ("sampling_params", {"sampling_params": {"max_new_tokens": 5}}),
                           ("metadata", {"metadata": {"k": "v"}})):
        r = rollout(gw, A, {**body, **changed})
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert field in err["message"] and err["details"]["fields"] == [field], err
    b1 = rollout(gw, B, {**body, "input_ids": [7, 8, 9]})  # b's own request of that id
    assert b1.status_code == 200, b1.text
    assert not set(_ids(b1)) & set(_ids(a1))
    t = b1.json()["trajectories"][0]
    assert t["prompt_token_ids"] == [7, 8, 9] and t["metadata"]["tenant"] == "team-b"
    b2 = rollout(gw, B, {**body, "input_ids": [7, 8, 9]})
    assert b2.status_code == 200 and _ids(b2) == _ids(b1) and _tokens(b2) == _tokens(b1)
    assert rollout(gw, B, body).status_code == 409  # b's id now means b's body
    assert a1.json()["trajectories"][0]["metadata"]["tenant"] == "team-a"
    a3 = rollout(gw, A, body)  # b's request changed nothing of a's
    assert a3.status_code == 200 and _ids(a3) == _ids(a1) and _tokens(a3) == _tokens(a1)
