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
    p.add_argument("--weight-version", default="0", help="initial weight version (default 0)")
    p.add_argument("--incremental-streaming-output", action="store_true",
                   help="SSE chunks carry deltas instead of cumulative output")
    p.add_argument("--max-running-requests", type=int, default=64,
                   help="requests decoded together per step (default 64)")
    p.add_argument("--step-delay-ms", type=float, default=0.0,
                   help="sleep between decode steps (test knob; default 0)")
    p.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from rollout_gateway.reference_engine.config import ModelConfig
    from rollout_gateway.reference_engine.server import EngineSettings, create_app

    try:
        model = ModelConfig.from_arg(args.model_config)
        if args.checkpoint:
            from rollout_gateway.reference_engine.checkpoint import read_config

            read_config(args.checkpoint)  # fail fast with one clear line
    except (ValueError, OSError) as exc:
        print(f"rollout-gateway engine: {exc}", file=sys.stderr)
        return 2
    settings = EngineSettings(
        model=model, seed=args.seed,
        checkpoint=args.checkpoint, weight_version=str(args.weight_version),
        incremental_streaming_output=args.incremental_streaming_output,
        max_running_requests=args.max_running_requests, step_delay_ms=args.step_delay_ms,
    )
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=2)
    return 0
