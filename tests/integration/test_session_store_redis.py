"""The session store on real Redis, single node and Redis Cluster (3 masters + 3
replicas started by the tests): the semantics the embedded store has (locks, leases,
bounds, ended markers, held trajectories, request claims), each session's scripts on one
slot, and a second client (another replica) rebuilding a branch from the records."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from _gateway_support import REDIS_URL
from _redis_support import delete_prefix_sync

from rollout_gateway.core.trajectory import FinishReason, Segment, TokenColumns, Trajectory
from rollout_gateway.sessions.records import BranchStart, apply, turn_record
from rollout_gateway.sessions.factory import session_store_for
from rollout_gateway.sessions.store import Head
from rollout_gateway.store.factory import store_from_url

pytestmark = pytest.mark.integration


@pytest.fixture(params=["redis", "cluster"])
def url(request):
    prefix = f"gwtest-sess-{uuid.uuid4().hex[:8]}"
    if request.param == "cluster":
        yield f"{request.getfixturevalue('redis_cluster').url}/?prefix={prefix}"
        return
    yield f"{REDIS_URL}?prefix={prefix}"
    delete_prefix_sync(prefix)


def _turn(prompt_len: int, out: list[int]) -> Trajectory:
    n = len(out)
    v = np.zeros(n, np.int32)
    cols = TokenColumns(np.asarray(out, np.int32), np.full(n, -0.5, np.float32),
                        np.zeros(n, np.float32), v, v)
    return Trajectory("t", np.zeros(prompt_len, np.int32), cols, FinishReason(type="stop"),
                      [Segment(0, n, 0, "e0")])


async def test_sessions_on_redis_and_redis_cluster(url):
    now = [1000.0]
    one, two = store_from_url(url), store_from_url(url)  # two replicas
    a, b = session_store_for(one), session_store_for(two)
    a.clock = b.clock = lambda: now[0]
    assert a.shared and b.shared
    try:
        key = ("team-a", "s1")
        assert (await a.claim(key, "A", 5, None)).status == "absent"
        head = Head(*key, last_active=now[0])
        assert await a.create(head, "A", 5, 10, 10) == "ok"
        assert await b.create(Head(*key), "B", 5, 10, 10) == "busy"
        got = await b.claim(key, "B", 5, None)
        assert got.status == "busy" and got.retry_after == pytest.approx(5)
        start = BranchStart("s1.b0.x", 0, np.arange(4, dtype=np.int32))
        branch = apply(None, start)
        recs = [start]
        for k in range(3):  # A serves three turns
            if k:
                assert (await a.claim(key, "A", 5, (1, len(recs)))).records == []
            ctx = [7] * k
            seq = int(branch.prompt_ids.shape[0]) + branch.output_len + len(ctx)
            rec = turn_record(branch, ctx, _turn(seq, [1, 2, 257]), kind="completion",
                              plan_input="p", prompt_text="p", content="c", reply_msg={},
                              group_id="g", metadata={})
            apply(branch, rec)
            new = [start, rec] if k == 0 else [rec]
            recs += [rec] if k else [rec]
            head = Head(*key, branches=1, n=len(recs), last_active=now[0])
            assert await a.commit(key, "A", head, new, k == 0)
        # B (never saw it) rebuilds the same branch from the records
        got = await b.claim(key, "B", 5, None)
        assert got.status == "ok" and got.since == 0 and len(got.records) == 4
        rebuilt = None
        for r in got.records:
            rebuilt = apply(rebuilt, r)
        assert rebuilt.sequence().tolist() == branch.sequence().tolist()
        assert not await a.commit(key, "A", head, [], False)  # A no longer holds the lock
        # a new branch commits with the old one's trajectory in the outbox: a replica dying
        # before it publishes leaves it to the next claimer
        old = _turn(2, [8, 9])
        old.trajectory_id = "s1.b0.x"
        assert await b.commit(key, "B", head, [], False, outbox=old)
        got = await a.claim(key, "A", 5, (1, 4))
        assert [t.tokens.token_ids.tolist() for t in got.outbox] == [[8, 9]]
        await a.clear_outbox(key, "s1.b0.x")
        await a.release(key, "A")
        assert (await b.claim(key, "B", 5, (1, 4))).outbox == []
        await b.release(key, "B")
        # a lock whose holder died lapses after its lease
        assert (await a.claim(key, "A", 5, (1, 4))).status == "ok"
        now[0] += 6
        assert (await b.claim(key, "B", 5, None)).status == "ok"
        await b.renew({key: "B"}, 5)
        now[0] += 3
        assert (await a.claim(key, "A", 5, None)).status == "busy"  # renewed
        # bounds count every replica's sessions
        assert await a.create(Head("team-a", "s2"), "A", 5, 10, 1) == "tenant_full"
        assert await a.create(Head("team-b", "s2"), "A", 5, 1, 10) == "full"
        assert await a.open_counts() == await b.open_counts() == {"team-a": 1}
        assert await a.idle(now[0] + 10, 10) == [key]
        assert await b.finish(key, "B", "end", 60)
        got = await a.claim(key, "A", 5, None)
        assert got.status == "ended" and got.ended_by == "end"
        assert await a.tenants_of("s1") == ["team-a"] and await a.open_counts() == {}
        # held trajectories and published markers, seen by the other replica
        traj = _turn(3, [4, 5])
        traj.trajectory_id = "s1.b0.x"
        await a.hold(traj, now[0] + 1)
        assert (await b.held("s1.b0.x")).tokens.token_ids.tolist() == [4, 5]
        assert await b.due(now[0], 10) == [] and await b.due(now[0] + 2, 10) == ["s1.b0.x"]
        await b.unhold("s1.b0.x")
        assert await a.held("s1.b0.x") is None and await a.held_count() == 0
        await b.mark_published("s1.b0.x", "team-a", 60)
        assert await a.published_tenant("s1.b0.x") == "team-a"
        # one run of a request id across replicas
        assert await a.claim_request("team-a/r1", "A", 5)
        assert not await b.claim_request("team-a/r1", "B", 5)
        assert not await b.renew_request("team-a/r1", "B", 5)
        await b.release_request("team-a/r1", "B")  # not B's: stays
        assert not await b.claim_request("team-a/r1", "B", 5)
        await a.release_request("team-a/r1", "A")
        assert await b.claim_request("team-a/r1", "B", 5)
        assert await b.sweep_lease("B", 5) and not await a.sweep_lease("A", 5)
    finally:
        await one.close()
        await two.close()
