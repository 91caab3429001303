"""``rollout-gateway engine``: run the reference engine (torch is imported only in ``run``)."""

from __future__ import annotations

import argparse
import os
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="HTTP port (default 30000)")
    p.add_argument("--model-config", default=None,
                   help="architecture: inline JSON or a config.json path (default: toy model)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights (default 0)")
    p.add_argument("--checkpoint", default=None,
                   help="load this checkpoint dir at start (overrides --model-config/--seed)")
    p.add_argument("--weight-version", default=None,
                   help="initial weight version (default 0; 'default' with --sglang-strict, "
                   "as SGLang)")
    p.add_argument("--sglang-strict", action="store_true",
                   help="answer exactly as SGLang 0.5.23 does: no entropy extension, SGLang's "
                   "/model_info keys only (no expert counts), string weight versions, routed "
                   "experts only with --enable-return-routed-experts, a HF config.json under "
                   "the reported model_path")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="with --sglang-strict: return routed experts when asked (SGLang's flag)")
    p.add_argument("--emulate-version", default=None,
                   help="SGLang version to report and emulate, e.g. 0.5.20 (no weight_versions "
                   "spans, no begin/end_weight_update) or 0.5.5 (no pause modes)")
    p.add_argument("--model-path", default=None,
                   help="directory reported as model_path (strict mode writes config.json "
                   "there if missing; default: the checkpoint dir or a temp dir)")
    p.add_argument("--incremental-streaming-output", action="store_true",
                   help="SSE chunks carry deltas instead of cumulative output")
    p.add_argument("--max-running-requests", type=int, default=64,
                   help="requests decoded together per step (default 64)")
    p.add_argument("--step-delay-ms", type=float, default=0.0,
                   help="sleep between decode steps (test knob; default 0)")
    radix = p.add_mutually_exclusive_group()
    radix.add_argument("--disable-radix-cache", dest="radix_cache", action="store_false",
                       default=None, help="no prefix cache: every prefill recomputes its whole "
                       "prompt, cached_tokens 0 (SGLang's flag; the default outside strict mode)")
    radix.add_argument("--enable-radix-cache", dest="radix_cache", action="store_true",
                       help="SGLang's prefix (radix) cache: requests sharing a prefix with "
                       "earlier ones reuse its KV, even KV computed by older weights, and report "
                       "it as cached_tokens (the default with --sglang-strict, as in SGLang)")
    p.add_argument("--max-total-tokens", type=int, default=65536,
                   help="KV pool size in tokens; the prefix cache evicts least recently used "
                   "prefixes beyond it (default 65536)")
    overlap = p.add_mutually_exclusive_group()
    overlap.add_argument("--disable-overlap-schedule", dest="overlap_schedule",
                         action="store_false", default=None,
                         help="exact version switch: every token is labelled with the weights "
                         "that computed it (SGLang's flag; the default outside strict mode)")
    overlap.add_argument("--enable-overlap-schedule", dest="overlap_schedule",
                         action="store_true",
                         help="emulate SGLang's overlap scheduler: results are processed one "
                         "step late, so after pause(in_place) + update + continue the first "
                         "token labelled with the new version was computed by the old weights "
                         "(the default with --sglang-strict, as in SGLang)")
    p.add_argument("--timeout-keep-alive", type=float, default=None,
                   help="seconds before an idle keep-alive connection is closed (default: "
                   "$SGLANG_TIMEOUT_KEEP_ALIVE, else 5, as uvicorn under SGLang)")
    p.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")


def keep_alive_seconds(flag: float | None) -> float:
    """The flag, else ``SGLANG_TIMEOUT_KEEP_ALIVE`` (SGLang environ.py: an int, default 5)."""
    if flag is not None:
        return flag
    raw = os.environ.get("SGLANG_TIMEOUT_KEEP_ALIVE", "").strip()
    if not raw:
        return 5.0
    try:
        return float(int(raw))
    except ValueError:
        raise ValueError(f"SGLANG_TIMEOUT_KEEP_ALIVE must be an integer, got {raw!r}") from None


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from reference_engine.config import ModelConfig
    from reference_engine.server import EngineSettings, create_app

    try:
        model = ModelConfig.from_arg(args.model_config)
        if args.checkpoint:
            from reference_engine.checkpoint import read_config

            read_config(args.checkpoint)  # fail fast with one clear line
        settings = EngineSettings(
            model=model, seed=args.seed,
            checkpoint=args.checkpoint,
            weight_version=str(args.weight_version if args.weight_version is not None
                               else ("default" if args.sglang_strict else "0")),
            sglang_strict=args.sglang_strict,
            enable_return_routed_experts=args.enable_return_routed_experts,
            model_path=args.model_path,
            **({"emulate_version": args.emulate_version} if args.emulate_version else {}),
            incremental_streaming_output=args.incremental_streaming_output,
            max_running_requests=args.max_running_requests, step_delay_ms=args.step_delay_ms,
            radix_cache=args.radix_cache, max_total_tokens=args.max_total_tokens,
            overlap_schedule=args.overlap_schedule,
            timeout_keep_alive=keep_alive_seconds(args.timeout_keep_alive),
        )
    except (ValueError, OSError) as exc:
        print(f"rollout-gateway engine: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=2, timeout_keep_alive=settings.timeout_keep_alive)
    return 0
