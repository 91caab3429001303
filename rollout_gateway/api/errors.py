"""The HTTP boundary's error mapping: every failure becomes ``{"error": {...}}``."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from rollout_gateway.api.serialize import dumps_parts
from rollout_gateway.errors import GatewayError

log = logging.getLogger(__name__)


class ORJSONResponse(Response):
    """JSON via orjson; numpy arrays are written natively (NaN/inf as null).

    The body is ``parts`` as :func:`~rollout_gateway.api.serialize.dumps_parts` made them,
    sent piece by piece (``more_body``) and never joined: an answer that carries the
    engine's routed-experts text (~2.6 MB for 1024 tokens of a 48-layer top-8 MoE) is not
    copied once more. ``body`` stays empty; ``b"".join(parts)`` is the whole body."""

    media_type = "application/json"

    def __init__(self, content: Any, status_code: int = 200,
                 headers: Mapping[str, str] | None = None, media_type: str | None = None,
                 background: BackgroundTask | None = None) -> None:
        self.parts = dumps_parts(content)
        super().__init__(None, status_code, headers, media_type, background)

    def render(self, content: Any) -> bytes:
        return b""  # the body is self.parts

    def init_headers(self, headers: Mapping[str, str] | None = None) -> None:
        super().init_headers(headers)  # Content-Length of the empty body: the parts' instead
        size = str(sum(len(p) for p in self.parts)).encode()
        self.raw_headers = [(k, size if k == b"content-length" else v)
                            for k, v in self.raw_headers]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        last = len(self.parts) - 1
        for i, part in enumerate(self.parts):
            await send({"type": "http.response.body", "body": part, "more_body": i < last})
        if self.background is not None:
            await self.background()


def error_response(status: int, code: str, message: str, details: dict | None = None) -> ORJSONResponse:
    body: dict = {"code": code, "message": message}
    if details:
        body["details"] = details
    return ORJSONResponse({"error": body}, status_code=status)


def _safe(text: str, limit: int = 300) -> str:
    """Caller-supplied text fit to echo: valid UTF-8 (lone surrogates replaced), bounded."""
    text = text.encode("utf-8", "replace").decode("utf-8")
    return text if len(text) <= limit else text[:limit] + "..."


def _field(x: object) -> bool:
    """A location step that names a field or an index (not "body", not a pydantic union
    branch such as ``function-after[_utf8(), str]``)."""
    return x != "body" and not (isinstance(x, str) and ("[" in x or "(" in x))


def validation_text(errors: list) -> str:
    """pydantic errors as one message: ``field.path: what is wrong; ...``."""
    return _validation_lines(errors)[0]


def _validation_message(exc: RequestValidationError) -> tuple[str, list[dict]]:
    return _validation_lines(exc.errors())


def _validation_lines(errors: list) -> tuple[str, list[dict]]:
    errs: list[dict] = []
    parts: list[str] = []
    for e in list(errors)[:20]:
        loc = _safe(".".join(str(x) for x in e.get("loc", ()) if _field(x)))
        msg = _safe(str(e.get("msg", "invalid")))
        if {"loc": loc, "msg": msg} in errs:
            continue
        parts.append(f"{loc}: {msg}" if loc else msg)
        errs.append({"loc": loc, "msg": msg})
    return "; ".join(parts) or "invalid request", errs


def client_error_body(req: Request, exc: GatewayError) -> dict:
    """The error as the caller may see it: no class names or tracebacks; no addresses or
    paths unless the caller is the authenticated admin (see :mod:`api.security`)."""
    from rollout_gateway.api.security import is_admin
    from rollout_gateway.redact import clean

    return clean(exc.to_dict(), private=not is_admin(req))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def _gateway(req: Request, exc: GatewayError) -> ORJSONResponse:
        if exc.http_status >= 500:
            log.warning("request failed: %s", exc.message)
        headers = None
        gw = getattr(req.app.state, "gateway", None)
        if (exc.http_status in (429, 503) or exc.retryable) and gw is not None:  # try again later
            headers = {"Retry-After": str(gw.settings.retry_after_s)}
        return ORJSONResponse({"error": client_error_body(req, exc)},
                              status_code=exc.http_status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, exc: RequestValidationError) -> ORJSONResponse:
        msg, errs = _validation_message(exc)
        # malformed JSON is a 400; well-formed but invalid fields are 422
        status = 400 if any(e.get("type") == "json_invalid" for e in exc.errors()) else 422
        return error_response(status, "INVALID_ARGUMENT", msg, {"errors": errs})

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException) -> ORJSONResponse:
        code = {404: "NOT_FOUND", 405: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED",
                403: "PERMISSION_DENIED"}.get(exc.status_code, "INVALID_ARGUMENT")
        return error_response(exc.status_code, code, _safe(str(exc.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(_req: Request, exc: Exception) -> ORJSONResponse:
        log.exception("unexpected error")
        return error_response(500, "INTERNAL", "internal error")
