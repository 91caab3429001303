"""Errors the learner client raises (learner_client never imports rollout_gateway)."""

from __future__ import annotations


class TrajectoryClientError(Exception):
    """A call failed. ``code`` is the gRPC status name (e.g. NOT_FOUND, INVALID_ARGUMENT)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE


#: status names worth a reconnect with backoff
RETRYABLE = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED",
                       "INTERNAL", "UNKNOWN", "CANCELLED"})


class DecodeError(TrajectoryClientError):
    """A delivered trajectory could not be decoded (malformed columns)."""

    def __init__(self, message: str):
        super().__init__("DATA_LOSS", message)
