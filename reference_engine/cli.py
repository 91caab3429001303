"""``rollout-gateway engine``: run the reference engine (torch is imported only in ``run``)."""

from __future__ import annotations

import argparse
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
    p.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")


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
        )
    except (ValueError, OSError) as exc:
        print(f"rollout-gateway engine: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=2)
    return 0
