"""One error hierarchy for the whole gateway.

Core code raises these; each boundary maps them exactly once:
HTTP handlers via :data:`HTTP_STATUS`, gRPC servicers via ``grpc.StatusCode[err.code.value]``
(the code values are gRPC status names). Nothing else should translate errors.
Wrap foreign exceptions at the adapter that sees them: ``raise EngineError(...) from exc``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class ErrorCode(StrEnum):
    """Canonical error codes. Values are gRPC status code names."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    ABORTED = "ABORTED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    INTERNAL = "INTERNAL"


#: HTTP status for each code (the HTTP boundary's single mapping table).
HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.ALREADY_EXISTS: 409,
    ErrorCode.FAILED_PRECONDITION: 409,
    ErrorCode.RESOURCE_EXHAUSTED: 429,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.DEADLINE_EXCEEDED: 504,
    ErrorCode.ABORTED: 409,
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.PERMISSION_DENIED: 403,
    ErrorCode.INTERNAL: 500,
}


class GatewayError(Exception):
    """Base of every error the gateway raises on purpose.

    ``message`` is safe to show to a client; ``details`` is a small JSON-able dict.
    """

    code: ErrorCode = ErrorCode.INTERNAL
    #: the same request may succeed soon: HTTP answers carry Retry-After (429s always do)
    retryable: bool = False

    def __init__(self, message: str, *, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details or {}

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.code]

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code.value, "message": self.message}
        if self.details:
            body["details"] = self.details
        return body


class InvalidArgument(GatewayError):
    """The caller sent something malformed or out of bounds."""

    code = ErrorCode.INVALID_ARGUMENT


class NotFound(GatewayError):
    """A named thing (engine, consumer group, trajectory) does not exist."""

    code = ErrorCode.NOT_FOUND


class AlreadyExists(GatewayError):
    """A unique thing (rid, engine id) is already in use."""

    code = ErrorCode.ALREADY_EXISTS


class FailedPrecondition(GatewayError):
    """The request is well-formed but the system is not in a state to do it
    (e.g. a weight version going backwards, a swap already in progress)."""

    code = ErrorCode.FAILED_PRECONDITION


class ResourceExhausted(GatewayError):
    """Admission control or a size limit refused the work; retry later."""

    code = ErrorCode.RESOURCE_EXHAUSTED


class Unavailable(GatewayError):
    """A dependency (engine, store) cannot be reached right now."""

    code = ErrorCode.UNAVAILABLE


class VersionPolicyUnmet(Unavailable):
    """Engines are in rotation but none runs a version the request's version policy
    admits (``core.version_policy``): a 503 with Retry-After, never another version."""

    retryable = True


class EngineError(Unavailable):
    """An inference engine failed or answered something we cannot use."""


class EngineChanged(EngineError):
    """An engine answered after it changed behind the gateway (restarted, other weights or
    version label than the request was sent under): the answer is not stamped; the sample
    resumes elsewhere as after an engine failure, without counting against the engine's
    circuit (the pool registers it again)."""


class StoreError(Unavailable):
    """The trajectory store or version registry failed."""


class Timeout(GatewayError):
    """A phase (connect, generate, weight load) ran past its deadline."""

    code = ErrorCode.DEADLINE_EXCEEDED


class Aborted(GatewayError):
    """The operation was aborted (e.g. by a concurrent weight swap or shutdown)."""

    code = ErrorCode.ABORTED


class Unauthenticated(GatewayError):
    code = ErrorCode.UNAUTHENTICATED


class PermissionDenied(GatewayError):
    code = ErrorCode.PERMISSION_DENIED
