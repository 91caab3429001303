"""``serve --workers N``: stamped tokens per gateway CPU-second with 1 and 2 worker processes.

One command: ``python bench/bench_workers.py`` (``--quick``: 2 rounds of 2 s per target).

A replay engine process (bench/replay_engine.py: 48 layers x top-8 routed experts), a
private ``redis-server`` on a free port (store and registry: --workers > 1 needs them
shared) and two gateways, ``serve --workers 1`` and ``serve --workers 2``, all alive at
once; a closed-loop client posts SGLang /generate with top-5 logprobs + routing, visiting
the gateways in turn (interleaved rounds), so drifting load hits both alike. Per gateway:
output tokens/s and stamped tokens per gateway CPU-second, where the CPU is the whole
process tree (the supervising parent and every worker, utime + stime from /proc). Redis's
own CPU is not counted (the same for both).

On a machine with 2 shared cores the wall-clock figure cannot show what a second worker
buys (the engine, the client and the workers compete for the same cores); tokens per CPU
second says whether a worker costs more or less CPU per token than one process does.
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

from bench_gateway import (LAYERS, TOPK, _cpu_seconds, _free_port, _load,  # noqa: E402
                           _stop, gateway_env, start_replay_engine)


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and all its live descendants."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += _cpu_seconds(p)
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def _wait_workers(url: str, n: int, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Until /health has answered from each of the n workers (fresh connections)."""
    import httpx

    seen: set[int] = set()
    deadline = time.time() + timeout
    while len(seen) < n:
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"{url}: {len(seen)}/{n} workers answered")
        try:
            r = httpx.get(url + "/health", timeout=2.0)
            if r.status_code == 200:
                seen.add(r.json().get("worker", 0))
        except httpx.HTTPError:
            time.sleep(0.2)


def generate_body(prompt: int, out: int) -> dict:
    """The measured /generate request: top-5 logprobs and routed experts."""
    return {"input_ids": list(range(1, prompt + 1)),
            "sampling_params": {"max_new_tokens": out, "temperature": 1.0},
            "return_logprob": True, "top_logprobs_num": 5, "return_routed_experts": True}


def start_redis_and_replay(procs: list[subprocess.Popen], tmp: str) -> tuple[int, str, dict]:
    """A private redis-server (data in ``tmp``) and a replay engine, appended to ``procs``;
    returns (Redis port, engine URL, environment for the gateway processes)."""
    redis = shutil.which("redis-server")
    if redis is None:
        raise SystemExit("redis-server not found (scripts/setup-env.sh installs it)")
    env = gateway_env()
    r_port = _free_port()
    procs.append(subprocess.Popen(
        [redis, "--port", str(r_port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL))
    return r_port, start_replay_engine(procs, env), env


def run(concurrency: int, duration: float, rounds: int, prompt: int, out: int) -> dict:
    body = generate_body(prompt, out)
    procs: list[subprocess.Popen] = []
    tmp = tempfile.mkdtemp(prefix="bench-workers-")
    try:
        r_port, engine, env = start_redis_and_replay(procs, tmp)
        targets: dict[int, tuple[str, subprocess.Popen]] = {}
        for n in (1, 2):
            g_port = _free_port()
            redis_url = f"redis://127.0.0.1:{r_port}/0?prefix=w{n}"
            gw = subprocess.Popen(
                [sys.executable, "-m", "rollout_gateway", "serve", "--host", "127.0.0.1",
                 "--port", str(g_port), "--grpc-host", "127.0.0.1", "--grpc-port", "0",
                 "--engine", f"replay={engine}", "--store", redis_url, "--registry",
                 redis_url, "--workers", str(n), "--log-level", "warning"],
                env=env, stdout=subprocess.DEVNULL)
            procs.append(gw)
            targets[n] = (f"http://127.0.0.1:{g_port}", gw)
        for n, (url, gw) in targets.items():
            _wait_workers(url, n, gw)
            asyncio.run(_load(url + "/generate", body, out, concurrency, min(2.0, duration)))
        acc = {n: [0.0, 0, 0, 0.0] for n in targets}  # seconds, ok, errors, cpu
        for i in range(rounds):
            for n, (url, gw) in targets.items():
                c0, t0 = tree_cpu_seconds(gw.pid), time.perf_counter()
                _, ok, err = asyncio.run(_load(url + "/generate", body, out, concurrency,
                                               duration))
                a = acc[n]
                a[0] += time.perf_counter() - t0
                a[1] += ok
                a[2] += err
                a[3] += tree_cpu_seconds(gw.pid) - c0
            print(f"  round {i + 1}/{rounds} done", flush=True)
        return {n: {"tok_s": ok * out / secs, "ok": ok, "errors": err,
                    "tok_per_cpu_s": ok * out / cpu if cpu > 0 else 0.0, "cpu_s": cpu}
                for n, (secs, ok, err, cpu) in acc.items()}
    finally:
        _stop(procs)
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 rounds of 2 s per target")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--duration", type=float, default=4.0, help="seconds per target per round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--out", type=int, default=512)
    ap.add_argument("--json", help="write the results here (bench/run_all)")
    args = ap.parse_args(argv)
    from _report import Report

    duration, rounds = (2.0, 2) if args.quick else (args.duration, args.rounds)
    rep = Report("workers", "Gateway worker processes (bench_workers.py)",
                 concurrency=args.concurrency, seconds_per_target=duration * rounds,
                 prompt=args.prompt, output=args.out, routed_experts=f"{LAYERS}x{TOPK}")
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"serve --workers 1 vs 2, /generate top-5 logprobs + routing {LAYERS}x{TOPK}, "
          f"{args.concurrency} concurrent, {rounds} interleaved rounds of {duration:.0f} s; "
          f"{os.cpu_count()} cores shared by everything; load average at start {load}")
    res = run(args.concurrency, duration, rounds, args.prompt, args.out)
    one = res[1]
    for n, r in res.items():
        ratio = r["tok_per_cpu_s"] / one["tok_per_cpu_s"] if one["tok_per_cpu_s"] else 0.0
        print(f"  --workers {n}: {r['tok_s'] / 1e3:7.1f}k tok/s  "
              f"{r['tok_per_cpu_s'] / 1e3:7.1f}k tok per gateway CPU-s (x{ratio:.2f} of 1 "
              f"worker)  ({r['ok']} requests, {r['errors']} errors, {r['cpu_s']:.1f} CPU-s)")
        rep.row("stamped output tokens per gateway CPU-second (parent + workers)",
                f"--workers {n}", r["tok_per_cpu_s"], "tok/CPU-s",
                ratio=None if n == 1 else ratio, ratio_to=None if n == 1 else "--workers 1")
        rep.row("output tokens/s (wall; 2 shared cores cannot show scaling)",
                f"--workers {n}", r["tok_s"], "tok/s")
    rep.note(f"load average at start {load}; the client, the engine, Redis and the gateways "
             "share the machine's cores")
    rep.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
