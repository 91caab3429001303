"""``rollout-gateway serve``: HTTP API (uvicorn) + learner gRPC service in one process.

SIGTERM/SIGINT: health goes off (HTTP /health 503, gRPC NOT_SERVING) and new generation
requests get 503 with Retry-After; in-flight rollouts get ``drain_grace_s`` to finish and
publish. Near its end, samples still running are cut short: they end with the output they
have (finish_reason abort, counted ``cut_short``) and are published as any other; then both
servers stop and open sessions are published. The process exits within ``drain_grace_s``
(plus the store's close).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Callable
from typing import Any

from rollout_gateway.settings import OldLogitsMode

log = logging.getLogger("rollout_gateway.serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="config file (.toml/.json/.yaml); env ROLLOUT_GATEWAY_* wins")
    p.add_argument("--host", help="HTTP bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default 8000)")
    p.add_argument("--grpc-host", help="gRPC bind address (default 127.0.0.1)")
    p.add_argument("--grpc-port", type=int, help="gRPC port (default 50051)")
    p.add_argument("--engine", action="append", default=[], metavar="[ID=]URL",
                   help="an engine to register (repeatable)")
    p.add_argument("--store", help="trajectory store URL (memory://, redis://... or "
                   "redis+cluster://host:port[,host:port...])")
    p.add_argument("--store-shards", type=int, metavar="N",
                   help="trajectory streams of a Redis store, spread over a cluster's masters "
                        "(default 1; a URL's ?shards= wins)")
    p.add_argument("--registry", help="version registry URL (memory://, redis://... or "
                   "redis+cluster://...)")
    p.add_argument("--old-logits", type=OldLogitsMode, choices=list(OldLogitsMode),
                   help="fill old_logprobs exactly: a dedicated scorer (model) or at swaps "
                        "(interruption); default off")
    p.add_argument("--old-logits-scorer", metavar="URL",
                   help="the scorer engine (outside the pool) for --old-logits")
    p.add_argument("--old-logits-initial-source", metavar="DIR",
                   help="checkpoint dir of the scorer's start-up weight version")
    p.add_argument("--chat-template", help="agent sessions: 'reference' (default) or a model / "
                   "tokenizer directory with a chat template (docs/agents.md)")
    p.add_argument("--served-model-name", help="model id of the OpenAI routes (default reference)")
    p.add_argument("--insecure", action="store_true", default=None,
                   help="allow a non-loopback bind without the admin, learner and client keys")
    p.add_argument("--tls-cert", help="PEM certificate chain: HTTPS and gRPC over TLS")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--grpc-client-ca", help="PEM CA: require learner client certificates (mTLS)")
    p.add_argument("--workers", type=int, help="gateway processes sharing the HTTP and gRPC "
                   "ports (default 1; more needs redis:// store and registry; "
                   "docs/gateway.md)")
    p.add_argument("--log-level", default="info")


def settings_from_args(args: argparse.Namespace, **extra: Any):
    from rollout_gateway.settings import load_settings

    over: dict[str, Any] = dict(extra)
    for attr, key in (("host", "http_host"), ("port", "http_port"), ("grpc_host", "grpc_host"),
                      ("grpc_port", "grpc_port"), ("store", "store_url"),
                      ("store_shards", "store_shards"),
                      ("registry", "registry_url"), ("insecure", "insecure"),
                      ("tls_cert", "tls_cert_file"), ("tls_key", "tls_key_file"),
                      ("grpc_client_ca", "grpc_client_ca_file"),
                      ("chat_template", "chat_template"),
                      ("served_model_name", "served_model_name"), ("workers", "workers")):
        v = getattr(args, attr, None)
        if v is not None:
            over[key] = v
    ol = {k: v for k, v in (("mode", getattr(args, "old_logits", None)),
                            ("scorer_url", getattr(args, "old_logits_scorer", None)),
                            ("initial_source", getattr(args, "old_logits_initial_source", None)))
          if v is not None}
    if ol:
        over["old_logits"] = ol
    if getattr(args, "engine", None):
        engines = []
        for i, spec in enumerate(args.engine):
            eid, sep, url = spec.partition("=")
            engines.append({"id": eid, "url": url} if sep and not eid.startswith("http")
                           else {"id": f"engine-{i}", "url": spec})
        over["engines"] = engines
    return load_settings(getattr(args, "config", None), **over)


def is_loopback(host: str) -> bool:
    """``host`` is a loopback address (127.0.0.0/8, ::1) or ``localhost``."""
    import ipaddress

    if host.strip().lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # another host name: it may resolve anywhere


def check_bind(settings) -> None:
    """Refuse (InvalidArgument) to listen on a non-loopback address while the admin or the
    learner key is unset, or (a non-loopback HTTP bind: the client routes are there) the
    client key, unless ``settings.insecure``."""
    from rollout_gateway.errors import InvalidArgument

    exposed = [h for h in (settings.http_host, settings.grpc_host) if not is_loopback(h)]
    keys = [("ROLLOUT_GATEWAY_ADMIN_API_KEY", settings.admin_api_key),
            ("ROLLOUT_GATEWAY_LEARNER_API_KEY", settings.learner_api_key or settings.learner_jobs)]
    if not is_loopback(settings.http_host):
        # client tenants (when configured) are client keys too
        keys.append(("ROLLOUT_GATEWAY_CLIENT_API_KEY",
                     settings.client_api_key or getattr(settings, "client_tenants", None)))
    missing = [name for name, v in keys if not v]
    if exposed and missing and not settings.insecure:
        raise InvalidArgument(
            f"refusing to listen on {', '.join(sorted(set(exposed)))} (not loopback) without "
            f"{' and '.join(missing)}: anyone who reaches the port could swap weights or read "
            "trajectories (or, without the client key, generate on your engines). Set the "
            "keys, bind 127.0.0.1, or pass --insecure "
            "(ROLLOUT_GATEWAY_INSECURE=true) to accept that.")


def tune_gc(young_threshold: int) -> None:
    """Started: freeze what start-up allocated (modules, app, settings: never garbage) out
    of later collections, and collect the young generation every ``young_threshold``
    container allocations (0: Python's defaults stay)."""
    import gc

    if young_threshold <= 0:
        return
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(young_threshold, older, oldest)


def uvicorn_tls(settings) -> dict[str, Any]:
    if not settings.tls_cert_file:
        return {}
    return {"ssl_certfile": settings.tls_cert_file, "ssl_keyfile": settings.tls_key_file}


async def serve_async(settings, *, ready: Callable[[int, int], None] | None = None,
                      stop_event: asyncio.Event | None = None,
                      sockets: list[socket.socket] | None = None,
                      worker: int | None = None) -> None:
    """Run until ``stop_event`` (or SIGTERM/SIGINT); then shut down gracefully.
    ``sockets``: HTTP listening sockets already bound (``--workers``: SO_REUSEPORT);
    ``worker``: this process's index among them (shown by /health)."""
    import functools

    import uvicorn

    from rollout_gateway.api.app import create_app
    from rollout_gateway.gateway import Gateway
    from rollout_gateway.observe.lag import lag_report
    from rollout_gateway.transport.server import GrpcServer

    check_bind(settings)
    gw = Gateway(settings)
    await gw.start()
    app = create_app(gw, manage_gateway=False)
    app.state.worker = worker
    grpc_server = GrpcServer(gw.store, gw.control, settings.grpc_host, settings.grpc_port,
                             default_policy=settings.admission.stale_policy, auth=gw.auth,
                             tls_cert=settings.tls_cert_file, tls_key=settings.tls_key_file,
                             tls_client_ca=settings.grpc_client_ca_file,
                             on_deliver=gw.tracker.on_delivered,
                             lag_report=functools.partial(lag_report, gw.view),
                             reuse_port=settings.workers > 1)
    try:
        grpc_port = await grpc_server.start()
    except BaseException:
        await gw.stop()
        raise
    config = uvicorn.Config(app, host=settings.http_host, port=settings.http_port,
                            log_level="warning", lifespan="on", access_log=False,
                            http="httptools" if _fast_io(settings) else "h11",
                            **uvicorn_tls(settings))
    server = uvicorn.Server(config)
    # we handle SIGTERM/SIGINT ourselves (health off, drain, then stop uvicorn)
    server.capture_signals = contextlib.nullcontext  # uvicorn >= 0.29
    server.install_signal_handlers = lambda: None  # older uvicorn
    stop = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    http_task = asyncio.create_task(server.serve(sockets=sockets))
    while not server.started and not http_task.done():
        await asyncio.sleep(0.02)
    if http_task.done():  # failed to bind etc.
        await grpc_server.stop(0)
        await gw.stop()
        http_task.result()
        raise SystemExit(f"HTTP server did not start on {settings.http_host}:{settings.http_port}")
    http_port = server.servers[0].sockets[0].getsockname()[1] if server.servers else settings.http_port
    await grpc_server.set_serving(True)
    tune_gc(settings.gc_young_threshold)
    if gw.heap.enabled:  # the trimmer gives back what the heap keeps
        from rollout_gateway.heaptrim import keep_freed_heap

        keep_freed_heap()
    log.info("gateway HTTP on %s:%d, learner gRPC on %s:%d", settings.http_host, http_port,
             settings.grpc_host, grpc_port)
    if ready:
        ready(http_port, grpc_port)
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({http_task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    # graceful shutdown, all of it within drain_grace_s: refuse new work, drain, cut short
    # what still runs (published as partial), stop the servers, publish open sessions
    grace = settings.drain_grace_s
    deadline = loop.time() + grace
    tail = min(2.0, grace / 2)  # the end of the grace: cutting short and stopping
    log.info("shutting down: draining in-flight rollouts (up to %ss)", grace)
    gw.draining = True  # new generation requests: 503 + Retry-After
    gw.serving = False
    await grpc_server.set_serving(False)
    drained = await gw.rollouts.wait_idle(max(0.0, deadline - tail - loop.time()))
    if not drained:
        log.warning("%d samples still in flight %.1fs after SIGTERM; cutting them short "
                    "(published with the output so far)", gw.rollouts.inflight_samples,
                    grace - tail)
        gw.rollouts.cut_short()
        await gw.rollouts.wait_idle(max(0.0, deadline - tail / 2 - loop.time()))
    # connections still open past the deadline are closed, their handlers cancelled
    config.timeout_graceful_shutdown = max(0.1, deadline - loop.time() - 0.3)
    server.should_exit = True
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.gather(grpc_server.stop(grace=max(0.0, deadline - loop.time() - 0.3)),
                             http_task)
    stopper.cancel()
    await gw.stop()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per engine call otherwise
    from rollout_gateway.errors import GatewayError

    try:
        settings = settings_from_args(args)
        check_bind(settings)
    except GatewayError as exc:
        print(f"rollout-gateway serve: {exc.message}")
        return 2
    scheme = "https" if settings.tls_cert_file else "http"

    def ready(http_port: int, grpc_port: int) -> None:
        print(f"gateway: {scheme}://{settings.http_host}:{http_port}  learner gRPC"
              f"{' (TLS)' if settings.tls_cert_file else ''}: "
              f"{settings.grpc_host}:{grpc_port}", flush=True)

    if settings.workers > 1:
        from rollout_gateway.commands.workers import run_workers

        def ready_all(http_port: int, grpc_port: int) -> None:
            ready(http_port, grpc_port)
            print(f"gateway: {settings.workers} workers", flush=True)

        return run_workers(settings, ready_all, run_gateway, args.log_level)
    try:
        run_gateway(settings, ready)
    except GatewayError as exc:  # e.g. a chat template that cannot be loaded
        print(f"rollout-gateway serve: {exc.message}")
        return 2
    return 0


def run_gateway(settings, ready, sockets=None, worker: int | None = None) -> None:
    """One gateway in this process, run to its end (uvloop when ``fast_io``)."""
    coro = serve_async(settings, ready=ready, sockets=sockets, worker=worker)
    if _fast_io(settings):
        import uvloop

        uvloop.run(coro)
    else:
        asyncio.run(coro)


def _fast_io(settings) -> bool:
    """settings.fast_io, when uvloop and httptools are importable (base dependencies; a
    platform without wheels falls back to asyncio + h11)."""
    import importlib.util

    return settings.fast_io and all(importlib.util.find_spec(m) is not None
                                    for m in ("uvloop", "httptools"))
