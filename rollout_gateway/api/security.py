"""The HTTP boundary's guards: bearer-token dependencies, what a non-admin may see, and an
ASGI layer bounding request bodies and concurrent generation requests.

Roles and tokens: :mod:`rollout_gateway.auth`. Error bodies shown to a caller never carry
a traceback or an exception class name; to anyone but an authenticated admin they carry no
URL, IP address or filesystem path either (the full text goes to the gateway's log).
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from rollout_gateway.auth import Role
from rollout_gateway.redact import clean_message

log = logging.getLogger(__name__)

#: documents the scheme in the OpenAPI schema; the check itself is :func:`_require`
bearer_scheme = HTTPBearer(auto_error=False, description="Bearer token (admin or client).")


def _require(request: Request, role: Role) -> None:
    request.app.state.gateway.auth.require(request.headers.get("authorization"), role)


async def require_admin(request: Request, _: HTTPAuthorizationCredentials | None
                        = Depends(bearer_scheme)) -> None:
    """Dependency: the admin token (when ``admin_api_key`` is set)."""
    _require(request, Role.ADMIN)


async def require_client(request: Request, _: HTTPAuthorizationCredentials | None
                         = Depends(bearer_scheme)) -> None:
    """Dependency: the client token (when ``client_api_key`` is set) or the admin's."""
    _require(request, Role.CLIENT)


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
    - at most ``max_pending_requests`` generation requests at once; the next gets 429 with
      ``Retry-After`` without being read;
    - an unexpected exception becomes a generic 500 body and is logged here, not re-raised,
      so the server keeps the keep-alive connection open."""

    def __init__(self, app, *, max_body_bytes: int, max_pending: int, retry_after_s: int):
        self.app = app
        self.max_body = max_body_bytes
        self.max_pending = max_pending
        self.retry_after = str(retry_after_s).encode()
        self.pending = 0

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
        if limited:
            if self.pending >= self.max_pending:
                return await self._send(
                    send, 429, "RESOURCE_EXHAUSTED",
                    f"{self.pending} generation requests in progress (the limit); retry later",
                    [(b"retry-after", self.retry_after)])
            self.pending += 1
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
            if limited:
                self.pending -= 1

    async def _send(self, send, status, code, message, headers=None):
        start, body = _json(status, code, message, headers)
        await send(start)
        await send(body)
