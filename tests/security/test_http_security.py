"""The HTTP API of a real ``rollout-gateway serve`` (reference engine behind it) as a hostile
caller sees it: tokens per role, bad input answered 4xx on a kept-alive connection, limits,
and no internals in what comes back."""

from __future__ import annotations

import http.client
import json
import threading

import httpx
import pytest
from _gateway_support import GatewayProcess
from _support import PATIENT_HEALTH

pytestmark = pytest.mark.integration

ADMIN, LEARNER, CLIENT = "admin-key-0123456789", "learner-key-0123456789", "client-key-0123456789"
KEYS = {"ROLLOUT_GATEWAY_ADMIN_API_KEY": ADMIN, "ROLLOUT_GATEWAY_LEARNER_API_KEY": LEARNER,
        "ROLLOUT_GATEWAY_CLIENT_API_KEY": CLIENT}


def h(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def gw(engine):
    env = {**PATIENT_HEALTH, **KEYS, "ROLLOUT_GATEWAY_MAX_BODY_BYTES": str(64 << 10),
           "ROLLOUT_GATEWAY_MAX_METADATA_BYTES": "1024"}
    with GatewayProcess({"e0": engine.url}, env=env) as g:
        yield g


def small(**extra) -> dict:
    return {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}, **extra}


def test_each_route_needs_its_role(gw):
    u = gw.url
    for headers, want in (({}, 401), (h("wrong-token-0123456789"), 401), (h(CLIENT), 403),
                          (h(LEARNER), 403)):
        r = httpx.post(u + "/v1/weights", json={"version": 1}, headers=headers, timeout=30)
        assert r.status_code == want, r.text
        assert httpx.delete(u + "/v1/engines/e0", headers=headers).status_code == want
        r = httpx.post(u + "/v1/engines", json={"id": "x", "url": "http://127.0.0.1:9"},
                       headers=headers)
        assert r.status_code == want
    gen = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
    for route, body in (("/v1/rollouts", small()), ("/generate", gen)):
        assert httpx.post(u + route, json=body, timeout=60).status_code == 401
        assert httpx.post(u + route, json=body, headers=h(LEARNER), timeout=60).status_code == 403
        assert httpx.post(u + route, json=body, headers=h(CLIENT), timeout=60).status_code == 200
        assert httpx.post(u + route, json=body, headers=h(ADMIN), timeout=60).status_code == 200
    r = httpx.post(u + "/v1/rollouts", json=small(), headers=h("x" * 10_000), timeout=30)
    assert r.status_code == 401 and "x" * 40 not in r.text  # the token is never echoed


def test_versions_hide_checkpoint_paths_from_non_admins(gw, tmp_path):
    from reference_engine.checkpoint import init_checkpoint

    ckpt = str(init_checkpoint(tmp_path / "secret-ckpt-v5", seed=1))
    r = httpx.post(gw.url + "/v1/weights", headers=h(ADMIN), timeout=120,
                   json={"version": 5, "source": {"kind": "disk", "path": ckpt},
                         "mode": "in_place"})
    assert r.status_code == 200, r.text
    for headers in ({}, h(CLIENT), h(LEARNER)):
        for route in ("/v1/versions", "/v1/engines", "/v1/engines/e0"):
            text = httpx.get(gw.url + route, headers=headers).text
            assert "secret-ckpt" not in text and "127.0.0.1" not in text, (route, text)
    snap = httpx.get(gw.url + "/v1/versions").json()
    assert snap["learner_version"] == 5 and snap["recent_swaps"][0]["version"] == 5
    admin = httpx.get(gw.url + "/v1/versions", headers=h(ADMIN)).json()
    assert admin["recent_swaps"][0]["source"] == ckpt
    assert httpx.get(gw.url + "/v1/engines", headers=h(ADMIN)).json()["engines"][0]["url"]


#: (route, raw JSON body): each was a 500 (or worse) once; all must be 4xx now
HOSTILE = [
    ("/v1/rollouts", '{"prompt": "a\\ud800b", "sampling_params": {"max_new_tokens": 2}}'),
    ("/v1/rollouts", '{"input_ids": [2147483648], "sampling_params": {"max_new_tokens": 2}}'),
    ("/v1/rollouts", '{"input_ids": [-1]}'),
    ("/v1/rollouts", '{"input_ids": [1], "sampling_params": {"top_k": %d}}' % 2**70),
    ("/v1/rollouts", '{"input_ids": [1], "sampling_params": {"sampling_seed": %d}}' % 2**70),
    ("/v1/rollouts", '{"input_ids": [1], "sampling_params": {"max_new_tokens": 99999999999}}'),
    ("/v1/rollouts", '{"input_ids": [1], "sampling_params": {"stop_token_ids": [4294967296]}}'),
    ("/v1/rollouts", '{"input_ids": [1], "sampling_params": {"temperature": NaN}}'),
    ("/v1/rollouts", '{"input_ids": [1], "n": 100000}'),
    ("/v1/rollouts", '{"input_ids": [1], "metadata": {"\\ud800": "x"}}'),
    ("/v1/rollouts", '{"input_ids": [1], "metadata": {"k": "' + "v" * 2000 + '"}}'),
    ("/v1/rollouts", '{"input_ids": [1], "group_id": "\\udfff"}'),
    ("/v1/rollouts", '[1, 2]'),
    ("/v1/rollouts", '{"input_ids": [1]'),
    ("/generate", '{"text": "hi", "top_logprobs_num": "abc"}'),
    ("/generate", '{"text": "hi", "top_logprobs_num": 1e300}'),
    ("/generate", '{"text": "hi", "sampling_params": [1, 2]}'),
    ("/generate", '{"text": "hi", "sampling_params": "max_new_tokens=2"}'),
    ("/generate", '{"text": "a\\ud800"}'),
    ("/generate", '{"input_ids": [9999999999999]}'),
    ("/generate", '{"text": "hi", "sampling_params": {"n": "many"}}'),
    ("/generate", '"just a string"'),
    ("/generate", '\xff\xfe'),
    ("/v1/engines", '{"id": "x", "url": "file:///etc/passwd"}'),
    ("/v1/engines", '{"id": "x", "url": "gopher://127.0.0.1:6379/_FLUSHALL"}'),
    ("/v1/weights", '{"version": 1180591620717411303424}'),
    ("/v1/weights", '{"version": 7, "source": {"kind": "disk", "path": 5}}'),
]


def test_hostile_bodies_get_4xx_on_a_kept_alive_connection(gw):
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=60)
    conn.connect()
    sock = conn.sock
    for route, body in HOSTILE:
        conn.request("POST", route, body=body.encode("utf-8", "surrogatepass"),
                     headers={"content-type": "application/json", **h(ADMIN)})
        resp = conn.getresponse()
        text = resp.read().decode()
        assert 400 <= resp.status < 500, (route, body[:80], resp.status, text)
        err = json.loads(text)["error"]
        assert err["code"] and err["message"]
        for leak in ("Traceback", "Error:", "Exception", "File \"", ".py"):
            assert leak not in text, (route, body[:80], text)
        assert not resp.will_close and conn.sock is sock, (route, body[:80])
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200 and conn.sock is sock
    conn.close()


def test_body_size_limits(gw):
    big = b'{"input_ids": [' + b"1," * (40 << 10) + b'1]}'
    r = httpx.post(gw.url + "/v1/rollouts", content=big, headers={
        "content-type": "application/json", **h(CLIENT)}, timeout=30)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted while read
        for _ in range(10):
            yield b" " * (16 << 10)
    r = httpx.post(gw.url + "/generate", content=chunks(), headers=h(CLIENT), timeout=30)
    assert r.status_code == 413
    assert httpx.get(gw.url + "/health").status_code == 200


def test_pending_requests_are_bounded_with_retry_after(make_engine):
    slow = make_engine(seed=1, weight_version="0", step_delay_ms=40)
    env = {**PATIENT_HEALTH, "ROLLOUT_GATEWAY_MAX_PENDING_REQUESTS": "2",
           "ROLLOUT_GATEWAY_RETRY_AFTER_S": "3"}
    with GatewayProcess({"e0": slow.url}, env=env) as g:
        body = {"input_ids": [1, 2],
                "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}}
        answers: list[httpx.Response] = []

        def post() -> None:
            answers.append(httpx.post(g.url + "/v1/rollouts", json=body, timeout=120))
        threads = [threading.Thread(target=post) for _ in range(5)]
        for t in threads:  # five at once; each takes seconds on the slowed engine
            t.start()
        for t in threads:
            t.join(120)
        codes = sorted(r.status_code for r in answers)
        assert codes.count(200) >= 2 and 429 in codes and set(codes) == {200, 429}, codes
        refused = next(r for r in answers if r.status_code == 429)
        assert refused.headers["retry-after"] == "3"
        assert refused.json()["error"]["code"] == "RESOURCE_EXHAUSTED"
        r = httpx.post(g.url + "/v1/rollouts", timeout=60,
                       json={**body, "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200  # the slots came back


def test_admission_429_carries_retry_after(engine):
    env = {**PATIENT_HEALTH, "ROLLOUT_GATEWAY_ADMISSION__MAX_CONCURRENT": "1"}
    with GatewayProcess({"e0": engine.url}, env=env) as g:
        r = httpx.post(g.url + "/v1/rollouts", json={**small(), "n": 2}, timeout=60)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
