"""Session records: a branch rebuilt from stored bytes (another replica) is the branch the
replica that ran the calls built; the embedded session store's locks and leases."""

from __future__ import annotations

import numpy as np
import pytest

from rollout_gateway.core.trajectory import (FinishReason, RoutedExperts, Segment, TokenColumns,
                                             Trajectory)
from rollout_gateway.errors import InvalidArgument
from rollout_gateway.sessions import records
from rollout_gateway.sessions.records import BranchStart, apply, turn_record
from rollout_gateway.sessions.session import Call
from rollout_gateway.sessions.store import Head, MemorySessionStore


def _turn(prompt_len: int, out: list[int], version: int) -> Trajectory:
    n = len(out)
    v = np.full(n, version, np.int32)
    cols = TokenColumns(np.asarray(out, np.int32), -np.arange(1, n + 1, dtype=np.float32) / 7,
                        np.full(n, 0.25, np.float32), v, v)
    routed = RoutedExperts(np.full((prompt_len + n - 1, 2, 2), version + 1, np.uint8), 4)
    t = Trajectory("t", np.arange(prompt_len, dtype=np.int32) % 250, cols,
                   FinishReason(type="stop", matched=257), [Segment(0, n, version, "e1")],
                   routed_experts=routed)
    t.metadata["stale_verdict"] = "mask" if version == 0 else ""
    t.metadata["stale_masked_tokens"] = "0-1" if version == 0 else ""
    return t


def _calls():
    """A branch forked from another (inherited call), then three chat turns."""
    start = BranchStart("s.b1.x", 1, np.arange(6, dtype=np.int32), tools=[{"t": 1}],
                        calls=[Call(1, "<p>", 6, np.array([1, 2], np.int32), "ok")],
                        messages=[{"role": "user", "content": "q"}],
                        metadata={"branched_from": "s.b0.y", "branch_reason": "history_edited"},
                        created_at=12.5)
    msgs = [{"role": "user", "content": "q"}]
    out = [start]
    branch = apply(None, start)
    text = "<p>"
    for k, (ctx, toks) in enumerate([([], [3, 4, 257]), ([9, 8], [5, 257]), ([7], [6])]):
        seq = int(branch.prompt_ids.shape[0]) + branch.output_len + len(ctx)
        text += f"<turn {k}>"
        reply = {"role": "assistant", "content": f"r{k}"}
        rec = turn_record(branch, ctx, _turn(seq, toks, k), kind="chat", plan_input=msgs,
                          prompt_text=text, content=f"r{k}", reply_msg=reply, group_id="g",
                          metadata={"k": str(k)})
        apply(branch, rec)
        out.append(rec)
        msgs = msgs + [reply, {"role": "user", "content": f"u{k}"}]
    return out, branch


def test_a_branch_rebuilt_from_bytes_is_the_branch_that_was_built():
    recs, built = _calls()
    data = [records.encode(r) for r in recs]
    rebuilt = None
    for d in data:
        rebuilt = apply(rebuilt, records.decode(d))
    a = built.trajectory(session_id="s", ended_by="end", reward=1.0, template="reference")
    b = rebuilt.trajectory(session_id="s", ended_by="end", reward=1.0, template="reference")
    assert a.tokens.token_ids.tolist() == b.tokens.token_ids.tolist()
    for col in ("logprobs", "entropy", "policy_version", "kv_version"):
        assert np.array_equal(getattr(a.tokens, col), getattr(b.tokens, col)), col
    assert np.array_equal(a.loss_mask, b.loss_mask) and a.turns == b.turns
    assert a.segments == b.segments and a.prompt_token_ids.tolist() == b.prompt_token_ids.tolist()
    assert np.array_equal(a.routed_experts.data, b.routed_experts.data)
    assert {k: v for k, v in a.metadata.items()} == b.metadata
    assert a.metadata["stale_verdict"] == "mask" and a.metadata["branched_from"] == "s.b0.y"
    assert built.messages == rebuilt.messages and built.tools == rebuilt.tools
    assert [(c.n_messages, c.prompt_text, c.seq_len, c.model_ids.tolist(), c.content)
            for c in built.calls] == [(c.n_messages, c.prompt_text, c.seq_len,
                                       c.model_ids.tolist(), c.content) for c in rebuilt.calls]
    # each turn stored what it added: no prompt, only the new prompt text
    assert all(len(d) < 2000 for d in data)
    assert recs[3].prompt_keep == len("<p><turn 0><turn 1>") and recs[3].prompt_rest == "<turn 2>"


@pytest.mark.parametrize("bad", [b"", b"RGS1", b"XXXX\x02\x00\x00\x00{}", b"RGS1\xff\x00\x00\x00{}"])
def test_a_malformed_record_is_invalid_argument(bad):
    with pytest.raises(InvalidArgument):
        records.decode(bad)


async def test_memory_session_store_locks_leases_and_bounds():
    now = [100.0]
    st = MemorySessionStore(clock=lambda: now[0])
    key = ("t", "s")
    assert (await st.claim(key, "a", 5, None)).status == "absent"
    assert await st.create(Head("t", "s", last_active=now[0]), "a", 5, 10, 10) == "ok"
    assert await st.create(Head("t", "s"), "b", 5, 10, 10) == "busy"
    got = await st.claim(key, "b", 5, None)
    assert got.status == "busy" and got.retry_after == 5
    now[0] += 6  # a's lease lapsed (its replica died): b takes the session
    assert (await st.claim(key, "b", 5, None)).status == "ok"
    assert not await st.commit(key, "a", Head("t", "s"), [], False)  # a lost it: no write
    old = _turn(2, [8, 9], 1)
    old.trajectory_id = "s.b0.x"
    assert await st.commit(key, "b", Head("t", "s", n=0, last_active=now[0]), [], False,
                           outbox=old)
    assert [t.trajectory_id for t in (await st.claim(key, "c", 5, None)).outbox] == ["s.b0.x"]
    await st.clear_outbox(key, "s.b0.x")
    await st.release(key, "c")
    assert await st.create(Head("t", "s2"), "c", 5, 2, 1) == "tenant_full"
    assert await st.create(Head("u", "s2"), "c", 5, 1, 1) == "full"
    assert await st.idle(now[0] + 1, 10) == [key]
    assert (await st.claim(key, "d", 5, None)).status == "ok"
    assert await st.finish(key, "d", "end", 60)
    got = await st.claim(key, "e", 5, None)
    assert got.status == "ended" and got.ended_by == "end"
    assert await st.tenants_of("s") == ["t"] and await st.open_counts() == {}


async def test_a_slot_no_node_serves_is_a_retryable_store_error():
    """redis-py's cluster errors without a node (SlotNotCoveredError during a failover) are
    not RedisErrors; the session store maps them to StoreError (503), not a 500."""
    import pytest
    from redis.exceptions import SlotNotCoveredError

    from rollout_gateway.errors import StoreError
    from rollout_gateway.sessions.redis_store import RedisSessionStore

    store = RedisSessionStore.__new__(RedisSessionStore)  # _io needs no connection
    with pytest.raises(StoreError, match="slot 7"):
        async with store._io("claim"):
            raise SlotNotCoveredError("slot 7 is not covered by the cluster")


async def test_a_write_on_a_connection_a_dead_node_closed_is_a_retryable_store_error():
    """uvloop raises RuntimeError('... the handler is closed') where asyncio raises a
    ConnectionError (redis-py writing to a transport its peer closed); any other
    RuntimeError stays a bug (not hidden)."""
    import pytest

    from rollout_gateway.errors import StoreError
    from rollout_gateway.sessions.redis_store import RedisSessionStore
    from rollout_gateway.store.redis_client import through_failover

    store = RedisSessionStore.__new__(RedisSessionStore)
    closed = RuntimeError("unable to perform operation on <TCPTransport closed=True "
                          "reading=False 0x55>; the handler is closed")
    with pytest.raises(StoreError, match="connection lost"):
        async with store._io("claim"):
            raise closed
    with pytest.raises(RuntimeError, match="a bug"):
        async with store._io("claim"):
            raise RuntimeError("a bug")
    tries = []

    async def flaky():
        tries.append(1)
        if len(tries) < 3:
            raise closed
        return "ok"
    assert await through_failover(flaky, wait_s=5) == "ok" and len(tries) == 3


async def test_redis_clients_own_failure_mid_failover_is_a_retryable_store_error():
    """redis-py's cluster client can trip over its own topology while a failover is under
    way (an AttributeError or KeyError inside it, not a RedisError): that call found Redis
    unavailable (503, retried by idempotent writes), where the same error from the
    gateway's own code stays a bug (500, not hidden)."""
    import os

    import pytest
    import redis

    from rollout_gateway.errors import StoreError
    from rollout_gateway.sessions.redis_store import RedisSessionStore
    from rollout_gateway.store.redis_client import client_internal, through_failover

    inside: dict = {}  # a function whose code lives in redis-py's package, as its frames do
    exec(compile("def node_name(node):\n    return node.name\n",
                 os.path.join(os.path.dirname(redis.__file__), "asyncio", "cluster.py"),
                 "exec"), inside)
    store = RedisSessionStore.__new__(RedisSessionStore)
    with pytest.raises(StoreError, match="Redis client error .AttributeError."):
        async with store._io("claim"):
            inside["node_name"](None)
    with pytest.raises(AttributeError):  # ours: passes as it is
        async with store._io("claim"):
            None.name  # noqa: B018
    with pytest.raises(KeyError):
        async with store._io("claim"):
            {}["slot"]
    tries = []

    async def flaky():
        tries.append(1)
        if len(tries) < 3:
            inside["node_name"](None)
        return "ok"
    assert await through_failover(flaky, wait_s=5) == "ok" and len(tries) == 3
    try:
        inside["node_name"](None)
    except AttributeError as exc:
        assert client_internal(exc)
    assert not client_internal(ValueError("x")) and not client_internal(AttributeError("x"))
