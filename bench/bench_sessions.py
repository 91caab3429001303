#!/usr/bin/env python
"""Per-turn cost of keeping agent sessions in the session store (docs/agents.md, "Where
session state lives").

    python bench/bench_sessions.py [--turns 20] [--sessions 20] [--model 256] [--context 32]

No engines: each turn is what the manager does around an engine call (claim the session,
build the turn's record, apply it, commit), on the embedded store and on Redis
(``--redis``, default the local test Redis; a fresh key prefix, deleted afterwards), side
by side in one run. Reported: microseconds per turn when the same replica serves every
turn (warm: nothing to read back), when each turn comes to a replica that has not seen
the session (cold: the branch is rebuilt from the store), and the bytes a turn writes.
The Redis figures are also given in PING round trips measured in the same run. On a
shared 2-core machine the absolute figures move with the load; the ratios are measured in
the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import Report  # noqa: E402

from rollout_gateway.core.trajectory import (FinishReason, Segment, TokenColumns,  # noqa: E402
                                             Trajectory)
from rollout_gateway.sessions import records  # noqa: E402
from rollout_gateway.sessions.records import BranchStart, apply, turn_record  # noqa: E402
from rollout_gateway.sessions.store import Head, MemorySessionStore  # noqa: E402


def _turn(prompt_len: int, n: int, rng: np.random.Generator) -> Trajectory:
    v = np.zeros(n, np.int32)
    cols = TokenColumns(rng.integers(0, 256, n, dtype=np.int32),
                        rng.standard_normal(n).astype(np.float32), np.zeros(n, np.float32), v, v)
    return Trajectory("t", np.zeros(prompt_len, np.int32), cols, FinishReason(type="stop"),
                      [Segment(0, n, 0, "e0")])


async def _run(store, args, *, cold: bool, rng) -> tuple[float, int]:
    """Seconds per turn over every turn of every session, and bytes written per turn."""
    spent, nbytes, turns = 0.0, 0, 0
    for s in range(args.sessions):
        key = ("bench", f"s{s}-{uuid.uuid4().hex[:6]}")
        head = Head(*key, branches=1, n=1)
        start = BranchStart(f"{key[1]}.b0", 0, np.arange(args.prompt, dtype=np.int32))
        assert await store.create(head, "o", 30, 1 << 30, 1 << 30) == "ok"
        assert await store.commit(key, "o", head, [start], True)
        branch = apply(None, start)
        msgs = [{"role": "user", "content": "x" * 200}]
        for k in range(args.turns):
            ctx = rng.integers(0, 256, args.context if k else 0).tolist()
            seq = int(branch.prompt_ids.shape[0]) + branch.output_len + len(ctx)
            turn = _turn(seq, args.model, rng)
            t0 = time.perf_counter()
            got = await store.claim(key, "o", 30, None if cold else (head.branches, head.n))
            if cold:  # a replica that never saw it: rebuild the branch
                branch = None
                for r in got.records:
                    branch = apply(branch, r)
            else:
                for r in got.records:
                    branch = apply(branch, r)
            rec = turn_record(branch, ctx, turn, kind="chat", plan_input=msgs,
                              prompt_text="p" * (100 * (k + 1)), content="reply",
                              reply_msg={"role": "assistant", "content": "reply"},
                              group_id="", metadata={})
            apply(branch, rec)
            head.n += 1
            assert await store.commit(key, "o", head, [rec], False)
            spent += time.perf_counter() - t0
            nbytes += len(records.encode(rec))
            turns += 1
            msgs = msgs + [{"role": "assistant", "content": "reply"},
                           {"role": "user", "content": "y" * 200}]
        assert (await store.claim(key, "o", 30, (head.branches, head.n))).status == "ok"
        assert await store.finish(key, "o", "end", 60)
    return spent / turns, nbytes // turns


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--sessions", type=int, default=20)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--model", type=int, default=256, help="model tokens per turn")
    ap.add_argument("--context", type=int, default=32, help="context tokens per turn")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rep = Report("sessions", "Agent sessions in the session store", turns=args.turns,
                 sessions=args.sessions, prompt=args.prompt, model=args.model,
                 context=args.context)
    rng = np.random.default_rng(0)
    stores = {"embedded": MemorySessionStore()}
    prefix = f"bench-sessions-{uuid.uuid4().hex[:8]}"
    client = None
    try:
        import redis.asyncio as aioredis

        from rollout_gateway.sessions.redis_store import RedisSessionStore
        from rollout_gateway.store.keys import KeyLayout

        client = aioredis.Redis.from_url(args.redis)
        await client.ping()
        stores["redis"] = RedisSessionStore(client, KeyLayout(prefix))
    except Exception as exc:  # noqa: BLE001 - the embedded figures still stand
        rep.note(f"redis not measured: {exc}")
    try:
        if client is not None:  # the unit of the Redis figures on this machine, now
            t0 = time.perf_counter()
            for _ in range(200):
                await client.ping()
            ping = (time.perf_counter() - t0) / 200
            rep.row("per turn", "redis PING round trip", ping * 1e6, "us")
            print(f"redis PING round trip: {ping * 1e6:8.1f} us", flush=True)
        for name, store in stores.items():
            for cold in (False, True):
                per_turn, nb = await _run(store, args, cold=cold, rng=rng)
                label = f"{name}, {'cold' if cold else 'warm'}"
                rep.row("per turn", label, per_turn * 1e6, "us")
                print(f"{label:>16}: {per_turn * 1e6:8.1f} us/turn, {nb} B written/turn",
                      flush=True)
                if not cold:
                    rep.row("bytes per turn", name, nb, "B")
    finally:
        if client is not None:
            keys = [k async for k in client.scan_iter(f"{prefix}:*")]
            if keys:
                await client.delete(*keys)
            await client.aclose()
    rows = {r["name"]: r["value"] for r in rep.doc["rows"] if r["section"] == "per turn"}
    for name in ("redis, warm", "redis, cold", "embedded, cold"):
        if name in rows:
            rep.row("ratios", f"{name} / embedded, warm", rows[name] / rows["embedded, warm"],
                    "x")
    for name in ("redis, warm", "redis, cold"):
        if name in rows:
            rep.row("ratios", f"{name} / PING round trip",
                    rows[name] / rows["redis PING round trip"], "x")
    rep.write(args.json)


if __name__ == "__main__":
    asyncio.run(main())
