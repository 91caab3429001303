"""The learner-facing gRPC server: TrajectoryService + grpc.health.v1 + reflection.

``GrpcServer`` runs in the caller's event loop (the gateway's ``serve`` runs it next to
uvicorn). Health is NOT_SERVING until ``set_serving(True)`` and again from the start of
``stop()``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rollout_gateway.auth import Authenticator, Role
from rollout_gateway.core.staleness import StalePolicy
from rollout_gateway.errors import GatewayError, Unavailable
from rollout_gateway.store.base import StoredEntry, TrajectoryStore
from rollout_gateway.transport.control_plane import ControlPlane
from rollout_gateway.transport.servicer import SERVICE_NAME, TrajectoryServicer, generic_handler

if TYPE_CHECKING:
    from rollout_gateway.observe.lag import LagReport

log = logging.getLogger(__name__)

_OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")


#: the role each TrajectoryService method needs (rollout_gateway.auth)
METHOD_ROLES = {"AnnounceVersion": Role.ADMIN, "Pull": Role.LEARNER, "Ack": Role.LEARNER,
                "Nack": Role.LEARNER, "CreateGroup": Role.LEARNER, "GetStatus": Role.LEARNER,
                "WatchVersions": Role.LEARNER, "ExtendLease": Role.LEARNER}


def _metadata_value(md, key: str) -> str | None:
    for k, v in md or ():
        if k == key:
            return v if isinstance(v, str) else None
    return None


class _RoleAuth(grpc.aio.ServerInterceptor):
    """Checks the ``authorization`` metadata against the role each method needs (health
    and reflection are open); consumer-group limits are checked by the servicer."""

    def __init__(self, auth: Authenticator):
        self._auth = auth

    async def intercept_service(self, continuation, details):
        if details.method.startswith(_OPEN_METHODS):
            return await continuation(details)
        prefix = f"/{SERVICE_NAME}/"
        role = (METHOD_ROLES.get(details.method[len(prefix):])
                if details.method.startswith(prefix) else None)
        try:
            self._auth.require(_metadata_value(details.invocation_metadata, "authorization"),
                               role or Role.ADMIN)
            return await continuation(details)
        except GatewayError as exc:
            code, message = grpc.StatusCode[exc.code.value], exc.message
        handler = await continuation(details)
        if handler is None:
            return None

        async def deny_stream(request_or_iterator, context):
            await context.abort(code, message)
            yield b""  # pragma: no cover - abort raises

        if handler.response_streaming:
            make = (grpc.stream_stream_rpc_method_handler if handler.request_streaming
                    else grpc.unary_stream_rpc_method_handler)
            return make(deny_stream, request_deserializer=handler.request_deserializer)
        make = (grpc.stream_unary_rpc_method_handler if handler.request_streaming
                else grpc.unary_unary_rpc_method_handler)

        async def deny(request, context):
            await context.abort(code, message)

        return make(deny, request_deserializer=handler.request_deserializer)


class GrpcServer:
    def __init__(self, store: TrajectoryStore, control: ControlPlane, host: str = "127.0.0.1",
                 port: int = 50051, *, default_policy: StalePolicy = StalePolicy.DROP,
                 max_send_bytes: int = 256 << 20, max_receive_bytes: int = 4 << 20,
                 auth_token: str | None = None, auth: Authenticator | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None,
                 tls_client_ca: str | None = None, poll_ms: int = 200,
                 target_message_bytes: int = 4 << 20,
                 on_deliver: Callable[[list[StoredEntry], int], None] | None = None,
                 lag_report: Callable[[], Awaitable[LagReport]] | None = None,
                 reuse_port: bool = False):
        """``auth``: tokens per role (``auth_token`` is shorthand for one token that is both
        admin and learner). ``tls_cert``/``tls_key``: PEM files to serve TLS;
        ``tls_client_ca``: also require client certificates signed by this CA (mTLS).
        ``on_deliver``, ``lag_report``: the servicer's observers (see there).
        ``reuse_port``: bind with SO_REUSEPORT (``serve --workers N``: the workers share the
        port). Off otherwise: gRPC turns it on by default, and then a second gateway started
        on a port another one serves binds it too and the kernel splits learners between
        the two; off, that start fails (``Unavailable``: the port is in use)."""
        self.store = store
        self.control = control
        self.host = host
        self.port = port
        if auth is None and auth_token:
            auth = Authenticator(admin=auth_token, learner=auth_token)
        self.auth = auth if auth is not None and auth.enabled else None
        if tls_client_ca and not tls_cert:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        self.servicer = TrajectoryServicer(store, control, default_policy=default_policy,
                                           auth=self.auth,
                                           max_batch_bytes=max_send_bytes - (64 << 10),
                                           poll_ms=poll_ms,
                                           target_batch_bytes=target_message_bytes,
                                           on_deliver=on_deliver, lag_report=lag_report)
        self._opts = [("grpc.max_send_message_length", max_send_bytes),
                      ("grpc.max_receive_message_length", max_receive_bytes),
                      ("grpc.keepalive_time_ms", 30_000),
                      ("grpc.http2.lookahead_bytes", 64 << 20),
                      ("grpc.http2.max_pings_without_data", 0),
                      ("grpc.http2.min_recv_ping_interval_without_data_ms", 20_000),
                      ("grpc.keepalive_permit_without_calls", 1),
                      ("grpc.so_reuseport", int(reuse_port))]
        self._tls = (tls_cert, tls_key, tls_client_ca)
        self._server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()

    async def start(self) -> int:
        """Bind and start (health NOT_SERVING). Returns the bound port."""
        interceptors = [_RoleAuth(self.auth)] if self.auth is not None else []
        server = grpc.aio.server(options=self._opts, interceptors=interceptors)
        server.add_generic_rpc_handlers((generic_handler(self.servicer),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        addr = f"{self.host}:{self.port}"
        creds = None
        if self._tls[0]:
            ca = Path(self._tls[2]).read_bytes() if self._tls[2] else None
            creds = grpc.ssl_server_credentials(
                [(Path(self._tls[1]).read_bytes(), Path(self._tls[0]).read_bytes())],
                root_certificates=ca, require_client_auth=ca is not None)
        try:
            self.port = (server.add_secure_port(addr, creds) if creds is not None
                         else server.add_insecure_port(addr))
        except RuntimeError as exc:  # grpc: "Failed to bind to address ..."
            raise Unavailable(f"learner gRPC cannot listen on {addr}: the port is in use (another "
                              "gateway?) or the address is not this host's",
                              details={"address": addr}) from exc
        await self.set_serving(False)
        await server.start()
        self._server = server
        log.info("learner gRPC service on %s:%d", self.host, self.port)
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def stop(self, grace: float | None = 5.0) -> None:
        """NOT_SERVING, refuse new calls, let running ones finish for ``grace`` seconds."""
        if self._server is None:
            return
        await self.set_serving(False)
        await self._server.stop(grace)
        self._server = None

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()
