"""``rollout-gateway up``: everything on one machine on embedded defaults.

Starts ``--engines N`` reference engine subprocesses, the gateway HTTP API on :8000 and the
learner gRPC service on :50051 with the embedded memory store. It writes two seeded
checkpoints (versions 0 and 1) so a hot-swap can be tried right away, prints the URLs and
curl examples, and stops everything on Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
from pathlib import Path

from rollout_gateway.core.swap_mode import SwapMode
from rollout_gateway.settings import OldLogitsMode


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", type=int, default=1, help="reference engines to start (default 1)")
    p.add_argument("--port", type=int, default=8000, help="gateway HTTP port (default 8000)")
    p.add_argument("--grpc-port", type=int, default=50051, help="learner gRPC port (default 50051)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--store", default="memory://", help="trajectory store URL (default memory://)")
    p.add_argument("--registry", default="memory://", help="version registry URL")
    p.add_argument("--workdir", help="where checkpoints go (default: a temp dir)")
    p.add_argument("--old-logits", type=OldLogitsMode, choices=list(OldLogitsMode),
                   default=OldLogitsMode.OFF,
                   help="exact old logits: start a scorer engine and fill old_logprobs with "
                        "it for every trajectory (model) or at swaps (interruption)")
    p.add_argument("--insecure", action="store_true", default=None,
                   help="allow a non-loopback --host without the admin and learner keys")
    p.add_argument("--log-level", default="warning")


def _examples(http: str, ckpt1: Path, swap_mode: SwapMode = SwapMode.IN_PLACE,
              settings=None) -> str:
    # with keys set, the examples send them (named by env var: the values are never printed)
    client = admin = ""
    if settings is not None and settings.admin_api_key:
        admin = " -H \"Authorization: Bearer $ROLLOUT_GATEWAY_ADMIN_API_KEY\""
    if settings is not None and settings.client_api_key:
        client = " -H \"Authorization: Bearer $ROLLOUT_GATEWAY_CLIENT_API_KEY\""
    return f"""
  rollout:   curl -s {http}/v1/rollouts{client} -H 'content-type: application/json' \\
               -d '{{"prompt": "hello", "n": 2, "sampling_params": {{"max_new_tokens": 8}}}}'
  hot-swap:  curl -s {http}/v1/weights{admin} -H 'content-type: application/json' \\
               -d '{{"version": 1, "source": {{"kind": "disk", "path": "{ckpt1}"}}, "mode": "{swap_mode}"}}'
  versions:  curl -s {http}/v1/versions
  engines:   curl -s {http}/v1/engines
  metrics:   curl -s {http}/metrics
  agent:     curl -s {http}/v1/chat/completions -H 'content-type: application/json' \
               -H 'x-session-id: s1' -d '{{"messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 8}}'
             curl -s {http}/v1/sessions/s1/end -H 'content-type: application/json' -d '{{"reward": 1}}'
"""


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.engines < 1:
        print("rollout-gateway up: --engines must be >= 1")
        return 2
    from reference_engine.checkpoint import init_checkpoint
    from rollout_gateway.commands.engine_process import EngineProcess
    from rollout_gateway.errors import GatewayError
    from rollout_gateway.commands.serve import check_bind, serve_async
    from rollout_gateway.settings import load_settings

    over = {"http_host": args.host, "grpc_host": args.host}
    if args.insecure:
        over["insecure"] = True
    try:  # keys come from ROLLOUT_GATEWAY_* env vars; refuse before starting engines
        check_bind(load_settings(**over))
    except GatewayError as exc:
        print(f"rollout-gateway up: {exc.message}")
        return 2
    work = Path(args.workdir or tempfile.mkdtemp(prefix="rollout-gateway-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt0 = init_checkpoint(work / "v0", seed=0)
    ckpt1 = init_checkpoint(work / "v1", seed=1)
    engines: list[EngineProcess] = []
    try:
        for _ in range(args.engines):
            engines.append(EngineProcess(checkpoint=ckpt0, weight_version="0", host=args.host).start())
        extra = {}
        mode = getattr(args, "old_logits", OldLogitsMode.OFF)
        if mode is not OldLogitsMode.OFF:  # a dedicated scorer engine, outside the generation pool
            scorer = EngineProcess(checkpoint=ckpt0, weight_version="0", host=args.host).start()
            engines.append(scorer)
            extra["old_logits"] = {"mode": mode, "scorer_url": scorer.url,
                                   "initial_source": str(ckpt0)}
        pool = engines[:args.engines]
        settings = load_settings(
            engines=[{"id": f"engine-{i}", "url": e.url} for i, e in enumerate(pool)],
            http_host=args.host, http_port=args.port, grpc_host=args.host,
            grpc_port=args.grpc_port, store_url=args.store, registry_url=args.registry,
            **extra, **({"insecure": True} if args.insecure else {}))

        def ready(http_port: int, grpc_port: int) -> None:
            http = f"http://{args.host}:{http_port}"
            print(f"rollout-gateway up: {len(pool)} reference engine(s) "
                  f"({', '.join(e.url for e in pool)})", flush=True)
            if mode is not OldLogitsMode.OFF:
                print(f"  old logits:    {mode} (scorer {engines[-1].url})", flush=True)
            print(f"  gateway HTTP:  {http}\n  learner gRPC:  {args.host}:{grpc_port}\n"
                  f"  checkpoints:   {ckpt0} (v0, loaded), {ckpt1} (v1)", flush=True)
            # interruption sync scores partial rollouts only for abort_resume / drain swaps
            swap = (SwapMode.ABORT_RESUME if mode is OldLogitsMode.INTERRUPTION
                    else SwapMode.IN_PLACE)
            print(_examples(http, ckpt1, swap, settings), flush=True)
            print("Ctrl-C stops everything.", flush=True)

        asyncio.run(serve_async(settings, ready=ready))
    except KeyboardInterrupt:
        pass
    finally:
        for e in engines:
            e.stop()
        print("rollout-gateway up: stopped", flush=True)
    return 0
