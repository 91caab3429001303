#!/usr/bin/env python
"""A/B: this checkout's gateway beside another revision's, in one run, on one replay engine.

    python bench/ab_gateway.py --base HEAD~1 [--streamed true|false] [--rounds 6]

The base revision is checked out in a git worktree (its native module built in place),
both gateways run at once in front of one replay engine, and the load visits direct, base
and this checkout in turn for ``--rounds`` rounds, so a drifting machine hits every column
alike (bench_gateway's part B, for a change instead of a setting). Prints, per column,
tokens per second, the ratio to direct, and gateway CPU per output token (the figure a
change to the gateway's own work moves; the ratio also carries the client and engine).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_gateway import (
    HERE,
    LAYERS,
    TOPK,
    _cpu_seconds,
    _free_port,
    _load,
    _stop,
    _wait_http,
    gateway_env,
    start_replay_engine,
)

ROOT = HERE.parent


def _worktree(rev: str, where: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(where),
                    rev], check=True, stdout=subprocess.DEVNULL)
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=where,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    probe = "import rollout_gateway._native as m; print(m.__file__)"
    got = subprocess.run([sys.executable, "-c", probe], cwd=where,
                         env=dict(os.environ, PYTHONPATH=str(where)),
                         check=True, capture_output=True, text=True).stdout.strip()
    if not got.startswith(str(where)):  # an installed copy would shadow the base revision
        raise SystemExit(f"the base revision's package does not import from {where}: {got}")
    return where


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--base", required=True, help="the revision to compare with (git rev)")
    ap.add_argument("--streamed", default="true", choices=["true", "false"],
                    help="how the gateways read engines (ROLLOUT_GATEWAY_STREAM_FROM_ENGINES)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=4.0, help="per column per round")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--out", type=int, default=1024)
    args = ap.parse_args(argv)
    body = {"input_ids": list(range(1, args.prompt + 1)),
            "sampling_params": {"max_new_tokens": args.out, "temperature": 1.0},
            "return_logprob": True, "top_logprobs_num": 5, "return_routed_experts": True}
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="ab-gateway-") as tmp:
        base_tree = _worktree(args.base, Path(tmp) / "base")
        try:
            env = gateway_env()
            engine = start_replay_engine(procs, env)
            cols: dict[str, tuple[str, subprocess.Popen | None]] = {"direct": (engine, None)}
            for name, tree in ((f"base {args.base}", base_tree), ("this checkout", ROOT)):
                port = _free_port()
                path = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH")) if p)
                gw = subprocess.Popen(
                    [sys.executable, "-m", "rollout_gateway", "serve", "--host", "127.0.0.1",
                     "--port", str(port), "--grpc-host", "127.0.0.1", "--grpc-port", "0",
                     "--engine", f"replay={engine}", "--log-level", "warning"],
                    cwd=tree, env=dict(env, PYTHONPATH=path,
                                       ROLLOUT_GATEWAY_STREAM_FROM_ENGINES=args.streamed),
                    stdout=subprocess.DEVNULL)
                procs.append(gw)
                cols[name] = (f"http://127.0.0.1:{port}", gw)
                _wait_http(cols[name][0] + "/health", gw)
            for url, _ in cols.values():  # warm up
                asyncio.run(_load(url + "/generate", body, args.out, args.concurrency, 1.0))
            acc = {name: [0.0, 0, 0, 0.0] for name in cols}  # seconds, ok, errors, gw CPU
            for r in range(args.rounds):
                for name, (url, proc) in cols.items():
                    c0 = _cpu_seconds(proc.pid) if proc else 0.0
                    t0 = time.perf_counter()
                    _, ok, err = asyncio.run(_load(url + "/generate", body, args.out,
                                                   args.concurrency, args.seconds))
                    a = acc[name]
                    a[0] += time.perf_counter() - t0
                    a[1] += ok
                    a[2] += err
                    a[3] += (_cpu_seconds(proc.pid) - c0) if proc else 0.0
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
        finally:
            _stop(procs)
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(base_tree)], check=False, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    direct = acc["direct"][1] * args.out / acc["direct"][0]
    print(f"\nstreamed={args.streamed}, top-5 + {LAYERS}x{TOPK} routing, "
          f"{args.prompt}+{args.out} tokens, {args.concurrency} concurrent, "
          f"{args.rounds} rounds x {args.seconds:g} s per column")
    print(f"{'column':<28} {'tok/s':>9} {'/direct':>8} {'gw us/tok':>10} {'errors':>7}")
    for name, (secs, ok, err, cpu) in acc.items():
        tps = ok * args.out / secs
        us = f"{cpu / max(ok * args.out, 1) * 1e6:.2f}" if name != "direct" else "-"
        print(f"{name:<28} {tps:>9.0f} {tps / direct:>8.3f} {us:>10} {err:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
