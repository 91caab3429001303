"""Trajectories/s and bytes/s through the Redis store: a Redis Cluster of 1 master vs 3.

    .venv/bin/python bench/bench_cluster.py [--trajectories 96 --response 1024 --layers 48
                                             --top-k 8 --writers 12 --rounds 3]

Starts two throwaway Redis Clusters on loopback (``tests/integration/_cluster_support``,
no replicas: the masters' own work is measured): one master holding every slot (the store
in 1 shard) and three masters (the store in 3 shards, one per master). In interleaved
rounds, for each: ``--writers`` concurrent publishers store ``--trajectories`` synthetic
trajectories (``RedisStore.publish``, one Lua script per trajectory on the master of its
id's shard), then one consumer group reads them all back and acks them
(``RedisStore.read``: XREADGROUP per shard on the bulk thread, payloads included).
Reported: trajectories/s and MB/s of each phase (medians over the rounds), and the ratio 3
masters / 1 master measured side by side.

Caveat: the masters, this process and its bulk threads share the machine's cores (2 shared
cores here): 3 masters can only go faster than 1 where one master's single thread was the
limit, so on a small box the ratio says little about a real cluster of separate hosts,
where each master adds its own core and network link.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # doubles: synthetic trajectories
sys.path.insert(0, str(ROOT / "tests" / "integration"))  # _cluster_support: LocalCluster


async def one_round(url: str, shards: int, protos, args) -> tuple[float, float, int]:
    """(publish seconds, read+ack seconds, bytes) of one round on a fresh prefix."""
    from rollout_gateway.store.base import StoreConfig
    from rollout_gateway.store.factory import store_from_url

    store = store_from_url(f"{url}/?prefix=bench-{uuid.uuid4().hex[:8]}&shards={shards}",
                           StoreConfig(max_backlog=10**6))
    try:
        await store.create_group("bench")
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(args.trajectories):
            queue.put_nowait(i)
        nbytes = 0

        async def writer() -> None:
            nonlocal nbytes
            while not queue.empty():
                i = queue.get_nowait()
                t = protos[i % len(protos)]
                t.trajectory_id = f"bench-{uuid.uuid4().hex}"
                assert await store.publish(t)

        t0 = time.perf_counter()
        await asyncio.gather(*(writer() for _ in range(args.writers)))
        t1 = time.perf_counter()
        got = 0
        while got < args.trajectories:
            es = await store.read("bench", "c", 32, block_ms=1000)
            if not es:
                raise RuntimeError(f"read {got} of {args.trajectories}")
            got += len(es)
            nbytes += sum(e.size for e in es)
            await store.ack("bench", [e.entry_id for e in es])
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, nbytes
    finally:
        await store.close()


async def run(args) -> list[tuple[str, float, float, float, float]]:
    from _cluster_support import LocalCluster

    from doubles.trajectories import make_trajectory

    protos = [make_trajectory("p", prompt_len=args.prompt, num_tokens=args.response,
                              versions=(3, 4), num_layers=args.layers, top_k=args.top_k,
                              num_experts=128, seed=s) for s in range(4)]
    setups = {"1 master": (LocalCluster(masters=1, replicas=0), 1),
              "3 masters": (LocalCluster(masters=3, replicas=0), 3)}
    times: dict[str, list[tuple[float, float, int]]] = {k: [] for k in setups}
    try:
        for c, _ in setups.values():
            c.start()
        for name, (c, shards) in setups.items():  # warm-up, unmeasured
            await one_round(c.url, shards, protos, argparse.Namespace(
                **{**vars(args), "trajectories": min(16, args.trajectories)}))
        for r in range(args.rounds):
            for name, (c, shards) in setups.items():
                times[name].append(await one_round(c.url, shards, protos, args))
                pub, rd, nb = times[name][-1]
                print(f"round {r + 1} {name}: publish {args.trajectories / pub:.0f} traj/s, "
                      f"read+ack {args.trajectories / rd:.0f} traj/s ({nb / 1e6:.0f} MB)",
                      flush=True)
    finally:
        for c, _ in setups.values():
            c.stop()
    rows = []
    for name, ts in times.items():
        pub = statistics.median(args.trajectories / p for p, _, _ in ts)
        rd = statistics.median(args.trajectories / r for _, r, _ in ts)
        per = ts[0][2] / args.trajectories
        rows.append((name, pub, pub * per, rd, rd * per))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trajectories", type=int, default=96)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--response", type=int, default=1024)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--writers", type=int, default=12, help="concurrent publishers")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="write the results here (bench/run_all)")
    args = p.parse_args()
    rows = asyncio.run(run(args))
    for name, pub, pub_b, rd, rd_b in rows:
        print(f"{name}: publish {pub:.0f} traj/s {pub_b / 1e6:.0f} MB/s; read+ack {rd:.0f} "
              f"traj/s {rd_b / 1e6:.0f} MB/s")
    if args.json:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _report import Report

        rep = Report("cluster", "Redis Cluster store: 1 master vs 3 (bench_cluster.py)",
                     trajectories=args.trajectories, prompt=args.prompt,
                     response=args.response,
                     routed_experts=f"{args.layers}x{args.top_k} uint8",
                     writers=args.writers, rounds=args.rounds)
        base = rows[0]
        for name, pub, pub_b, rd, rd_b in rows:
            first = name == base[0]
            kw = {} if first else {"ratio_to": base[0]}
            rep.row("publish", f"{name} trajectories/s", pub, "traj/s",
                    ratio=None if first else pub / base[1], **kw)
            rep.row("publish", f"{name} MB/s", pub_b / 1e6, "MB/s")
            rep.row("read + ack", f"{name} trajectories/s", rd, "traj/s",
                    ratio=None if first else rd / base[3], **kw)
            rep.row("read + ack", f"{name} MB/s", rd_b / 1e6, "MB/s")
        rep.note("The masters, the benchmark and its threads share the machine's cores (2 "
                 "shared cores): 3 masters gain only where one master's thread was the "
                 "limit; on separate hosts each master adds a core and a network link.")
        rep.write(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
