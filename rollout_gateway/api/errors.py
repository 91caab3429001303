"""The HTTP boundary's error mapping: every failure becomes ``{"error": {...}}``."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout_gateway.api.serialize import dumps
from rollout_gateway.errors import GatewayError

log = logging.getLogger(__name__)


class ORJSONResponse(Response):
    """JSON via orjson; numpy arrays are written natively (NaN/inf as null)."""

    media_type = "application/json"

    def render(self, content) -> bytes:
        return dumps(content)


def error_response(status: int, code: str, message: str, details: dict | None = None) -> ORJSONResponse:
    body: dict = {"code": code, "message": message}
    if details:
        body["details"] = details
    return ORJSONResponse({"error": body}, status_code=status)


def _safe(text: str, limit: int = 300) -> str:
    """Caller-supplied text fit to echo: valid UTF-8 (lone surrogates replaced), bounded."""
    text = text.encode("utf-8", "replace").decode("utf-8")
    return text if len(text) <= limit else text[:limit] + "..."


def _validation_message(exc: RequestValidationError) -> tuple[str, list[dict]]:
    errs = []
    parts = []
    for e in exc.errors()[:20]:
        loc = _safe(".".join(str(x) for x in e.get("loc", ()) if x != "body"))
        msg = _safe(str(e.get("msg", "invalid")))
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
        if (exc.http_status == 429 or exc.retryable) and gw is not None:
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
