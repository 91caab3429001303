"""``rollout-gateway demo``: the main job (see rollout_demo.job)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    from rollout_demo.job import DemoConfig
    from rollout_gateway.core.swap_mode import SwapMode

    d = DemoConfig()
    p.add_argument("--loss", default=d.loss,
                   help="registered correction loss (learner_client.corrections.LOSSES), "
                        f"default {d.loss}")
    p.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps (default {d.steps})")
    p.add_argument("--out", default=str(d.out), help="report directory (default ./demo-out)")
    p.add_argument("--swap-mode", type=SwapMode, choices=list(SwapMode), default=d.swap_mode,
                   help="how engines take each new version mid-generation (default in_place)")
    p.add_argument("--engines", type=int, default=d.engines, help="reference engines (default 1)")
    p.add_argument("--redis-url", help="use Redis (store + registry) instead of the embedded "
                   "store: redis://host:port/db or redis+cluster://host:port[,...]/?shards=N")
    p.add_argument("--by-reference", action="store_true",
                   help="the learner reads trajectory bytes from Redis itself (gRPC carries "
                        "references, credit and acks); needs --redis-url")
    p.add_argument("--compare-sync", action="store_true",
                   help="also run the synchronous baseline and report the async/sync ratio")
    p.add_argument("--batch-groups", type=int, default=d.batch_groups,
                   help=f"GRPO groups per optimizer step (default {d.batch_groups})")
    p.add_argument("--group-size", type=int, default=d.group_size,
                   help=f"samples per prompt (default {d.group_size})")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--lr", type=float, default=d.lr, help=f"Adam learning rate (default {d.lr})")
    p.add_argument("--max-lag", type=int, default=d.max_lag,
                   help="the gateway's staleness bound, in versions (default 2)")
    p.add_argument("--learner", choices=("torch", "megatron"), default=d.learner,
                   help="torch: transformers Qwen3-MoE (default); megatron: a megatron-core "
                        "GPTModel of the same weights (rollout_demo.megatron_learner)")
    p.add_argument("--no-replay", action="store_true", help="no routing replay (R3)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--log-level", default="warning")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from learner_client.corrections import LOSSES
    from rollout_demo.job import DemoConfig, run_demo

    if args.loss not in LOSSES:
        print(f"rollout-gateway demo: unknown --loss {args.loss!r}; known: {', '.join(sorted(LOSSES))}")
        return 2
    for name in ("steps", "engines", "batch_groups", "group_size", "max_new_tokens"):
        if getattr(args, name) < 1:
            print(f"rollout-gateway demo: --{name.replace('_', '-')} must be >= 1")
            return 2
    if args.by_reference and not args.redis_url:
        print("rollout-gateway demo: --by-reference needs --redis-url (the learner reads "
              "the gateway's Redis)")
        return 2
    if args.max_lag < 0 or args.lr <= 0:
        print("rollout-gateway demo: --max-lag must be >= 0 and --lr > 0")
        return 2
    cfg = DemoConfig(loss=args.loss, steps=args.steps, out=Path(args.out),
                     swap_mode=args.swap_mode, engines=args.engines, redis_url=args.redis_url,
                     by_reference=args.by_reference,
                     batch_groups=args.batch_groups, group_size=args.group_size,
                     max_new_tokens=args.max_new_tokens, lr=args.lr, max_lag=args.max_lag,
                     replay=not args.no_replay, learner=args.learner, seed=args.seed, progress=not args.no_progress)
    print(f"rollout-gateway demo: {cfg.engines} reference engine(s) + gateway "
          f"({'redis' if cfg.redis_url else 'embedded store'}), learner over gRPC; "
          f"learner={cfg.learner} loss={cfg.loss} swap={cfg.swap_mode} steps={cfg.steps}", flush=True)
    report = run_demo(cfg, compare_sync=args.compare_sync)
    print(f"reward: first fifth {report['reward_first_fifth']:.3f} -> last fifth "
          f"{report['reward_last_fifth']:.3f}; {report['tokens_per_s']:.0f} trained tok/s; "
          f"lag histogram {report['lag_histogram']}", flush=True)
    if "async_sync_ratio" in report:
        print(f"async/sync throughput ratio: {report['async_sync_ratio']:.2f} "
              f"({report['tokens_per_s']:.0f} vs {report['sync']['tokens_per_s']:.0f} tok/s)",
              flush=True)
    print(f"report: {Path(args.out) / 'report.json'} (+ {', '.join(report['plots'])})", flush=True)
    return 0
