"""The learner gRPC service alone, over a store and the in-memory control plane, as a
process for transport tests and benchmarks: ``PYTHONPATH=<repo>:<repo>/tests python -m
doubles.grpc_server --store URL`` (SIGTERM / SIGINT stop it gracefully within --grace s)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path

from doubles.control_plane import InProcessControlPlane
from rollout_gateway.core.staleness import StalePolicy
from rollout_gateway.transport.server import GrpcServer


async def serve(args: argparse.Namespace) -> None:
    from rollout_gateway.store.factory import store_from_url

    store = store_from_url(args.store)
    control = InProcessControlPlane(version=args.version)
    server = GrpcServer(store, control, args.host, args.port,
                        default_policy=StalePolicy(args.stale_policy),
                        auth_token=args.token or None,
                        target_message_bytes=args.message_kb << 10)
    port = await server.start()
    if args.port_file:
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(str(port))
        tmp.rename(args.port_file)
    await server.set_serving(True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(args.grace)
    await store.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="run the learner gRPC service standalone")
    p.add_argument("--store", default="memory://", help="store URL (see store.factory)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    p.add_argument("--port-file", default="", help="write the bound port here once listening")
    p.add_argument("--grace", type=float, default=5.0, help="seconds for in-flight calls on stop")
    p.add_argument("--stale-policy", default="drop", choices=[x.value for x in StalePolicy])
    p.add_argument("--version", type=int, default=0, help="initial policy version")
    p.add_argument("--token", default="", help="require this bearer token")
    p.add_argument("--message-kb", type=int, default=4 << 10,
                   help="soft size of one Pull response message (KiB)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
