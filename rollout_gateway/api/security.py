"""The HTTP boundary's guards: bearer-token dependencies, what a non-admin may see, and an
ASGI layer bounding request bodies and concurrent generation requests.

Roles and tokens: :mod:`rollout_gateway.auth`. Error bodies shown to a caller never carry
a traceback or an exception class name; to anyone but an authenticated admin they carry no
URL, IP address or filesystem path either (the full text goes to the gateway's log).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import orjson
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from rollout_gateway.auth import Principal, Role
from rollout_gateway.redact import clean_message

log = logging.getLogger(__name__)

#: documents the scheme in the OpenAPI schema; the check itself is :func:`_require`
bearer_scheme = HTTPBearer(auto_error=False, description="Bearer token (admin or client).")


def _require(request: Request, role: Role) -> Principal:
    p = request.app.state.gateway.auth.require(request.headers.get("authorization"), role)
    request.state.principal = p
    return p


async def require_admin(request: Request, _: HTTPAuthorizationCredentials | None
                        = Depends(bearer_scheme)) -> None:
    """Dependency: the admin token (when ``admin_api_key`` is set)."""
    _require(request, Role.ADMIN)


async def require_client(request: Request, _: HTTPAuthorizationCredentials | None
                         = Depends(bearer_scheme)) -> None:
    """Dependency: a client token (when ``client_api_key`` / ``client_tenants`` is set) or
    the admin's; the caller is kept as ``request.state.principal`` (:func:`caller`)."""
    _require(request, Role.CLIENT)


def caller(request: Request) -> Principal:
    """Who made this client request (set by :func:`require_client`)."""
    return request.state.principal


def is_admin(request: Request) -> bool:
    """The request carries the configured admin token."""
    gw = getattr(request.app.state, "gateway", None)
    return gw is not None and gw.auth.is_admin(request.headers.get("authorization"))


# ---- what a client may see ---------------------------------------------------------------

_ADMIN_ONLY_KEYS = frozenset({"source", "leader", "swap_leader", "url", "model_path"})


def public_view(obj: Any) -> Any:
    """What a non-admin sees of an admin-facing record (versions, swaps, engines): no
    weight source paths, replica host names or engine URLs; messages cleaned."""
    if isinstance(obj, dict):
        return {k: public_view(v) for k, v in obj.items() if k not in _ADMIN_ONLY_KEYS}
    if isinstance(obj, list):
        return [public_view(v) for v in obj]
    if isinstance(obj, str):
        return clean_message(obj)
    return obj


# ---- the ASGI guard ----------------------------------------------------------------------

#: routes that start generation: bounded by ``max_pending_requests``
GENERATION_PATHS = frozenset({"/v1/rollouts", "/generate", "/v1/chat/completions",
                              "/v1/completions"})


def _json(status: int, code: str, message: str, extra_headers: list | None = None):
    body = orjson.dumps({"error": {"code": code, "message": message}})
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())] + (extra_headers or [])
    return ({"type": "http.response.start", "status": status, "headers": headers},
            {"type": "http.response.body", "body": body})


class RequestGuard:
    """Pure ASGI middleware (inside Starlette's error middleware, outside the routes):

    - a body larger than ``max_body_bytes`` is refused with 413 (by Content-Length before
      reading, or while reading a chunked body);
    - at most ``max_pending_requests`` generation requests at once (``max_pending_per_tenant``
      of one tenant); the next gets 429 with ``Retry-After`` without being read (a stream
      counts until its generation ends: :class:`Hold`);
    - while the gateway drains (SIGTERM), a new generation request gets 503 with
      ``Retry-After``;
    - an unexpected exception becomes a generic 500 body and is logged here, not re-raised,
      so the server keeps the keep-alive connection open."""

    def __init__(self, app, *, max_body_bytes: int, max_pending: int, retry_after_s: int,
                 max_pending_per_tenant: int | None = None,
                 tenant_of: Callable[[str | None], str | None] | None = None,
                 draining: Callable[[], bool] = lambda: False):
        self.app = app
        self.max_body = max_body_bytes
        self.max_pending = max_pending
        self.per_tenant = max_pending_per_tenant or max_pending
        self.tenant_of = tenant_of  # Authorization header -> tenant (None: no client's)
        self.retry_after = str(retry_after_s).encode()
        self.pending = 0
        self.by_tenant: dict[str, int] = {}
        self.draining = draining  # shutting down: new generation requests get 503

    def _release(self, tenant: str) -> None:
        self.pending -= 1
        left = self.by_tenant[tenant] - 1
        if left:
            self.by_tenant[tenant] = left
        else:
            del self.by_tenant[tenant]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        cl = None
        for k, v in scope["headers"]:
            if k == b"content-length":
                cl = v
                break
        if cl is not None:
            try:
                n = int(cl)
            except ValueError:
                return await self._send(send, 400, "INVALID_ARGUMENT", "bad Content-Length")
            if n > self.max_body:
                return await self._send(send, 413, "INVALID_ARGUMENT",
                                        f"request body of {n} bytes exceeds the limit of "
                                        f"{self.max_body} bytes")
        limited = scope["method"] == "POST" and scope["path"] in GENERATION_PATHS
        hold: Hold | None = None
        if limited and self.draining():
            return await self._send(send, 503, "UNAVAILABLE", "the gateway is shutting down; "
                                    "retry on another replica or later",
                                    [(b"retry-after", self.retry_after)])
        if limited:
            tenant = ""
            if self.tenant_of is not None:
                auth = next((v for k, v in scope["headers"] if k == b"authorization"), None)
                tenant = self.tenant_of(auth.decode("latin-1") if auth else None) or ""
            mine = self.by_tenant.get(tenant, 0)
            if self.pending >= self.max_pending or mine >= self.per_tenant:
                which = (f"{self.pending} generation requests in progress (the limit)"
                         if self.pending >= self.max_pending else
                         f"this tenant has {mine} generation requests in progress (the limit "
                         "per tenant)")
                return await self._send(send, 429, "RESOURCE_EXHAUSTED",
                                        f"{which}; retry later",
                                        [(b"retry-after", self.retry_after)])
            self.pending += 1
            self.by_tenant[tenant] = mine + 1
            hold = Hold(lambda: self._release(tenant))
            scope.setdefault("state", {})[HOLD] = hold
        seen = 0
        started = refused = False

        async def counted_receive():
            nonlocal seen, started, refused
            msg = await receive()
            if msg["type"] == "http.request" and not refused:
                seen += len(msg.get("body", b""))
                if seen > self.max_body:  # a chunked body past the limit: answer 413 now
                    if not started:
                        started = refused = True
                        await self._send(send, 413, "INVALID_ARGUMENT", "request body exceeds "
                                         f"the limit of {self.max_body} bytes")
                    return {"type": "http.disconnect"}  # the route stops reading
            return msg

        async def tracked_send(msg):
            nonlocal started
            if refused:
                return  # whatever the route answers after our 413 is dropped
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except Exception:  # noqa: BLE001 - the last resort; logged, never shown
            log.exception("unexpected error on %s %s", scope["method"], scope["path"])
            if not started:
                await self._send(send, 500, "INTERNAL", "internal error")
        finally:
            if hold is not None:
                hold.request_ended()

    async def _send(self, send, status, code, message, headers=None):
        start, body = _json(status, code, message, headers)
        await send(start)
        await send(body)


#: the request state key of a generation request's :class:`Hold`
HOLD = "generation_hold"


class Hold:
    """A generation request's place in the pending counts (``max_pending_requests``, per
    tenant ``max_pending_per_tenant``): freed when the request's response ends, unless the
    route :meth:`keep` s it: a stream whose generation runs on after its client went away
    keeps counting until the generation ends (the route frees it then)."""

    __slots__ = ("_free", "kept", "freed")

    def __init__(self, free: Callable[[], None]) -> None:
        self._free = free
        self.kept = False
        self.freed = False

    def keep(self) -> Callable[[], None]:
        """Count on past the response; the returned callable frees the place (idempotent)."""
        self.kept = True
        return self.free

    def free(self) -> None:
        if not self.freed:
            self.freed = True
            self._free()

    def request_ended(self) -> None:
        if not self.kept:
            self.free()


def keep_pending(request: Request) -> Callable[[], None]:
    """For a route whose generation may outlive the response (streams): the callable that
    frees this request's pending place, to call when the generation ends. Outside the
    guard (tests that build routes alone): a no-op."""
    hold = request.scope.get("state", {}).get(HOLD)
    return hold.keep() if hold is not None else (lambda: None)
