"""Gateway replicas: gateway CPU per stamped token with 1 vs 3 ``serve`` replicas on one Redis.

One command: ``python bench/bench_replicas.py`` (``--quick``: 2 rounds of 2 s per setup).

A replay engine process (bench/replay_engine.py: 48 layers x top-8 routed experts), a
private ``redis-server`` on a free port, and four ``rollout-gateway serve`` processes all
alive at once: one replica alone (its own key prefix) and three replicas sharing another
prefix of the same Redis (store, registry, admission, idempotency shared). A closed-loop
client posts SGLang /generate with top-5 logprobs + routing, the same concurrency for
both setups (spread evenly over the three replicas' URLs), visiting the setups in turn
(interleaved rounds) so drifting load hits both alike. Per setup: output tokens/s and
gateway CPU microseconds per stamped token, summed over its replicas (utime + stime of each
``serve`` process tree from /proc), and each replica's own CPU per token it stamped.
Redis's own CPU is not counted.

Caveat: on a machine with 2 shared cores the engine, the client, Redis and every replica
compete for the same cores: wall-clock tokens/s cannot show what more replicas buy; CPU per
token says what a replica costs, and whether sharing state through Redis adds to it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_gateway import LAYERS, TOPK, _free_port, _load, _stop, _wait_http
from bench_workers import generate_body, start_redis_and_replay, tree_cpu_seconds

SETUPS = {"1 replica": 1, "3 replicas": 3}


def _gateway(engine: str, redis_url: str, env: dict[str, str]) -> tuple[str, subprocess.Popen]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_gateway", "serve", "--host", "127.0.0.1",
         "--port", str(port), "--grpc-host", "127.0.0.1", "--grpc-port", "0",
         "--engine", f"replay={engine}", "--store", redis_url, "--registry", redis_url,
         "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL)
    return f"http://127.0.0.1:{port}", proc


async def _spread(urls: list[str], body: dict, out: int, concurrency: int,
                  duration: float) -> list[tuple[int, int]]:
    """The closed loop over ``urls`` at once, ``concurrency`` split evenly: (ok, errors) each."""
    per = [concurrency // len(urls) + (i < concurrency % len(urls)) for i in range(len(urls))]
    got = await asyncio.gather(*(_load(u + "/generate", body, out, max(c, 1), duration)
                                 for u, c in zip(urls, per, strict=True)))
    return [(ok, err) for _, ok, err in got]


def run(concurrency: int, duration: float, rounds: int, prompt: int, out: int) -> dict:
    body = generate_body(prompt, out)
    procs: list[subprocess.Popen] = []
    tmp = tempfile.mkdtemp(prefix="bench-replicas-")
    try:
        r_port, engine, env = start_redis_and_replay(procs, tmp)
        setups: dict[str, list[tuple[str, subprocess.Popen]]] = {}
        for name, n in SETUPS.items():
            url = f"redis://127.0.0.1:{r_port}/0?prefix=r{n}"
            setups[name] = [_gateway(engine, url, env) for _ in range(n)]
            procs += [p for _, p in setups[name]]
        for name, gws in setups.items():  # ready, then a warm-up, unmeasured
            for url, p in gws:
                _wait_http(url + "/health", p, timeout=120)
            asyncio.run(_spread([u for u, _ in gws], body, out, concurrency,
                                min(2.0, duration)))
        # per setup, per replica: [ok, errors, cpu seconds]; per setup: wall seconds
        acc = {name: [[0, 0, 0.0] for _ in gws] for name, gws in setups.items()}
        wall = dict.fromkeys(setups, 0.0)
        for i in range(rounds):
            for name, gws in setups.items():
                c0, t0 = [tree_cpu_seconds(p.pid) for _, p in gws], time.perf_counter()
                got = asyncio.run(_spread([u for u, _ in gws], body, out, concurrency,
                                          duration))
                wall[name] += time.perf_counter() - t0
                for a, (ok, err), (_, p), c in zip(acc[name], got, gws, c0, strict=True):
                    a[0] += ok
                    a[1] += err
                    a[2] += tree_cpu_seconds(p.pid) - c
            print(f"  round {i + 1}/{rounds} done", flush=True)
        res = {}
        for name, reps in acc.items():
            ok = sum(a[0] for a in reps)
            cpu = sum(a[2] for a in reps)
            res[name] = {"tok_s": ok * out / wall[name], "ok": ok,
                         "errors": sum(a[1] for a in reps), "cpu_s": cpu,
                         "us_per_tok": cpu / (ok * out) * 1e6 if ok else 0.0,
                         "per_replica_us_per_tok": [a[2] / (a[0] * out) * 1e6 if a[0] else 0.0
                                                    for a in reps]}
        return res
    finally:
        _stop(procs)
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 rounds of 2 s per setup")
    ap.add_argument("--concurrency", type=int, default=9, help="client streams per setup")
    ap.add_argument("--duration", type=float, default=4.0, help="seconds per setup per round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--out", type=int, default=512)
    ap.add_argument("--json", help="write the results here (bench/run_all)")
    args = ap.parse_args(argv)
    from _report import Report

    duration, rounds = (2.0, 2) if args.quick else (args.duration, args.rounds)
    rep = Report("replicas", "Gateway replicas on one Redis (bench_replicas.py)",
                 concurrency=args.concurrency, seconds_per_setup=duration * rounds,
                 prompt=args.prompt, output=args.out, routed_experts=f"{LAYERS}x{TOPK}")
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"1 vs 3 serve replicas on one Redis, /generate top-5 logprobs + routing "
          f"{LAYERS}x{TOPK}, {args.concurrency} concurrent per setup, {rounds} interleaved "
          f"rounds of {duration:.0f} s; {os.cpu_count()} cores shared by everything; load "
          f"average at start {load}")
    res = run(args.concurrency, duration, rounds, args.prompt, args.out)
    one = res["1 replica"]
    for name, r in res.items():
        ratio = r["us_per_tok"] / one["us_per_tok"] if one["us_per_tok"] else 0.0
        each = ", ".join(f"{x:.1f}" for x in r["per_replica_us_per_tok"])
        print(f"  {name}: {r['tok_s'] / 1e3:7.1f}k tok/s  {r['us_per_tok']:6.1f} gateway "
              f"CPU-us per stamped token (x{ratio:.2f} of 1 replica; each replica: {each})  "
              f"({r['ok']} requests, {r['errors']} errors, {r['cpu_s']:.1f} CPU-s)")
        first = name == "1 replica"
        rep.row("gateway CPU-us per stamped token (all replicas)", name, r["us_per_tok"],
                "us/tok", ratio=None if first else ratio,
                ratio_to=None if first else "1 replica")
        for i, x in enumerate(r["per_replica_us_per_tok"]):
            rep.row("gateway CPU-us per token a replica stamped", f"{name}: replica {i}", x,
                    "us/tok")
        rep.row("output tokens/s (wall; 2 shared cores cannot show scaling)", name,
                r["tok_s"], "tok/s")
    rep.note(f"load average at start {load}; the client, the engine, Redis and every "
             "replica share the machine's 2 cores")
    rep.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
