"""Decode throughput of the reference engine at 1, 8 and 32 concurrent requests.

    python bench/bench_engine.py [--new-tokens 64] [--prompt-len 16]

Starts one real engine process (toy config) and measures, side by side in one run, the
output tokens/s with N streams generating concurrently (ignore_eos, fixed length), plus the
ratio to the single-request figure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import httpx  # noqa: E402

from rollout_gateway.commands.engine_process import EngineProcess  # noqa: E402


async def run_level(url: str, n: int, new_tokens: int, prompt_len: int) -> float:
    async with httpx.AsyncClient(timeout=600) as c:
        async def one(i: int) -> int:
            r = await c.post(url + "/generate", json={
                "input_ids": [256] + [(i * 7 + j) % 250 for j in range(prompt_len - 1)],
                "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True,
                                    "sampling_seed": i},
                "return_logprob": True, "return_entropy": True})
            r.raise_for_status()
            return r.json()["meta_info"]["completion_tokens"]

        await one(0)  # warm-up
        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(i) for i in range(n)))
        return sum(done) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--json", help="write the results here (bench/run_all)")
    args = ap.parse_args()
    with EngineProcess(seed=0) as eng:
        results = {n: asyncio.run(run_level(eng.url, n, args.new_tokens, args.prompt_len))
                   for n in (1, 8, 32)}
    base = results[1]
    print(f"reference engine decode throughput (toy Qwen3-MoE, {args.new_tokens} new tokens, "
          f"prompt {args.prompt_len}, cpu threads=1)")
    for n, tps in results.items():
        print(f"  concurrency {n:>2}: {tps:8.1f} tok/s   x{tps / base:5.2f} vs 1")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _report import Report

    rep = Report("engine", "Reference engine decode throughput (bench_engine.py)",
                 new_tokens=args.new_tokens, prompt=args.prompt_len, torch_threads=1)
    for n, tps in results.items():
        rep.row("decode tokens/s, concurrent requests", f"{n} concurrent", tps, "tok/s",
                ratio=None if n == 1 else tps / base, ratio_to=None if n == 1 else "1 concurrent")
    rep.write(args.json)


if __name__ == "__main__":
    main()
