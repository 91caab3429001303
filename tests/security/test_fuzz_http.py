"""Schema-driven fuzzing (schemathesis) of a real ``rollout-gateway serve`` with a real
reference engine behind it: every operation of the OpenAPI document, valid and invalid
bodies, 0 server errors. The client routes are fuzzed with the client token so that valid
cases reach generation (counted and asserted); admin routes are fuzzed without a token and,
for ``/v1/weights``, with the admin token on invalid bodies only (a valid one would really
swap weights). Bounded: ``FUZZ_EXAMPLES`` cases per operation (env
``ROLLOUT_GATEWAY_FUZZ_EXAMPLES``), about a minute on 2 cores."""

from __future__ import annotations

import collections
import os

import pytest
import schemathesis
from _gateway_support import GatewayProcess
from _support import PATIENT_HEALTH
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode

pytestmark = pytest.mark.integration

FUZZ_EXAMPLES = int(os.environ.get("ROLLOUT_GATEWAY_FUZZ_EXAMPLES", "25"))
ADMIN, CLIENT = "admin-key-0123456789", "client-key-0123456789"


@pytest.fixture(scope="module")
def fuzz_gateway(engine):
    # small enough that every valid case finishes quickly on the toy model
    env = {**PATIENT_HEALTH,
           "ROLLOUT_GATEWAY_ADMIN_API_KEY": ADMIN, "ROLLOUT_GATEWAY_CLIENT_API_KEY": CLIENT,
           "ROLLOUT_GATEWAY_MAX_NEW_TOKENS_LIMIT": "128",
           "ROLLOUT_GATEWAY_MAX_SAMPLES_PER_REQUEST": "2",
           "ROLLOUT_GATEWAY_MAX_PROMPT_TOKENS": "64", "ROLLOUT_GATEWAY_MAX_PROMPT_CHARS": "256",
           "ROLLOUT_GATEWAY_ADMISSION__ENABLED": "false"}
    with GatewayProcess({"e0": engine.url}, env=env) as gw:
        yield gw
        log = gw.log_tail(20000)
    assert "unexpected error" not in log, log  # nothing reached the last-resort handler


@pytest.fixture(scope="module")
def api(fuzz_gateway):
    """The gateway's own OpenAPI document, as schemathesis reads it."""
    return schemathesis.openapi.from_url(fuzz_gateway.url + "/openapi.json")


FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


Seen = dict[tuple[str, str], collections.Counter]


def fuzz(api, select, headers: dict[str, str], modes=(GenerationMode.POSITIVE,
                                                       GenerationMode.NEGATIVE)
         ) -> tuple[int, Seen]:
    """Run FUZZ_EXAMPLES cases per selected operation and mode; returns (operations run,
    (method, path) -> status codes seen by this call: each test judges its own cases).
    (schemathesis' pytest plugin does not run on pytest 9: hypothesis is driven here.)"""
    seen: Seen = collections.defaultdict(collections.Counter)
    ops = [r.ok() for r in api.get_all_operations()]
    chosen = [op for op in ops if select(op.method.upper(), op.path)]
    for op in chosen:
        for mode in modes:
            @FUZZ
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                if case.headers:  # our token, not a generated one (security scheme)
                    case.headers = {k: v for k, v in case.headers.items()
                                    if k.lower() != "authorization"} or None
                resp = case.call(headers=headers, timeout=120)
                seen[(case.method.upper(), case.path)][resp.status_code] += 1
                case.validate_response(resp, checks=[not_a_server_error])
            try:
                run()
            except Unsatisfiable:  # nothing to make invalid (e.g. GET /health)
                assert mode is GenerationMode.NEGATIVE
    return len(chosen), seen


CLIENT_ROUTES = ("/v1/rollouts", "/generate", "/v1/chat/completions", "/v1/completions",
                 "/v1/sessions/{session_id}/end", "/v1/trajectories/{trajectory_id}/reward",
                 "/v1/models", "/v1/models/{model_id}")


def no_5xx(seen: Seen) -> None:
    print({f"{m} {p}": dict(c) for (m, p), c in seen.items()})  # shown with -s
    assert not any(code >= 500 for c in seen.values() for code in c), dict(seen)


def test_client_routes(api):
    """Every client route fuzzed; valid cases were generated and served (not all refused
    by validation)."""
    ran, seen = fuzz(api, lambda m, p: p in CLIENT_ROUTES, {"Authorization": f"Bearer {CLIENT}"})
    assert ran == len(CLIENT_ROUTES)
    for op in (("POST", "/v1/rollouts"), ("POST", "/generate")):
        assert seen[op][200] > 0, dict(seen)
    no_5xx(seen)


def test_read_routes(api):
    ran, seen = fuzz(api, lambda m, p: m == "GET" and p not in CLIENT_ROUTES, {})
    assert ran >= 5
    no_5xx(seen)


def test_admin_routes_without_a_token(api):
    ran, seen = fuzz(api, lambda m, p: m != "GET" and p.startswith(("/v1/weights",
                                                                      "/v1/engines")), {})
    assert ran == 3 and len(seen) == 3, dict(seen)
    for (m, p), codes in seen.items():
        assert set(codes) <= {400, 401, 404, 405, 422}, (m, p, codes)
        assert codes[401] > 0


def test_weights_with_invalid_bodies_as_admin(api):
    ran, seen = fuzz(api, lambda m, p: (m, p) == ("POST", "/v1/weights"),
                     {"Authorization": f"Bearer {ADMIN}"}, modes=(GenerationMode.NEGATIVE,))
    assert ran == 1 and seen[("POST", "/v1/weights")], dict(seen)
    no_5xx(seen)
