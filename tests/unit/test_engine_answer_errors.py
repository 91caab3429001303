"""Engine error answers (SGLang 0.5.23's shapes): the request's fault or the engine's."""

from __future__ import annotations

import orjson
import pytest

from rollout_gateway.engines.client import answer_error, refusal
from rollout_gateway.errors import EngineError, InvalidArgument


def event(code, retryable=False, message="bad") -> bytes:  # http_server.py stream_results
    return orjson.dumps({"error": {"message": message, "type": "invalid_request_error",
                                   "code": code, "retryable": retryable}})


@pytest.mark.parametrize("status,body,client", [
    (200, event(400), True),  # text to a --skip-tokenizer-init engine, streamed
    (200, event(400, retryable=True), False),
    (200, event(503), False),
    (200, event(500), False),
    (200, b'{"error":{"message":"no code"}}', False),
    (400, b'{"error":{"message":"bad"}}', True),  # _create_error_response
    (400, b'{"error":"bad"}', True),  # a request contract violation
    (413, b"too large", True),
    (429, b'{"error":{"message":"busy"}}', False),
    (401, b"no key", False), (403, b"", False), (408, b"", False),
    (500, b'{"error":{"message":"bad"}}', False),
    (503, b"<html>", False),
])
def test_the_request_is_at_fault_only_for_a_non_retryable_4xx(status, body, client):
    err = answer_error("e0", "/generate", status, body)
    assert isinstance(err, InvalidArgument if client else EngineError)
    assert err.details["engine_id"] == "e0"
    if client:
        assert err.message.startswith("the engine rejected the request: ")
        assert err.http_status == 400


def test_the_engines_message_is_passed_on():
    msg = "The engine initialized with skip_tokenizer_init=True cannot accept text prompts."
    err = answer_error("e0", "/generate", 200, event(400, message=msg))
    assert err.message == f"the engine rejected the request: {msg}"
    assert err.details == {"engine_id": "e0", "status": 400}
    err = answer_error("e0", "/generate", 503, b'{"error":{"message":"overloaded"}}')
    assert err.message == "engine e0 /generate: HTTP 503: overloaded"


@pytest.mark.parametrize("finish,client", [
    ({"type": "abort", "message": "too long", "status_code": 400,
      "err_type": "BadRequestError"}, True),
    ({"type": "abort", "message": "Retracted without a KV backup", "status_code": 503}, False),
    ({"type": "abort", "message": "Aborted", "status_code": None}, False),  # pause, abort
    ({"type": "abort", "message": "Aborted"}, False),
    ({"type": "length", "length": 4}, False),
    (None, False),
])
def test_a_finish_that_refuses_the_request(finish, client):
    got = refusal("e0", finish)
    assert (got is not None) == client
    if client:
        assert isinstance(got, InvalidArgument) and "too long" in got.message
