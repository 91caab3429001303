"""The gateway as a real process in front of real reference engines: rollouts, stamps
checked against ground truth, publishing to Redis, the SGLang pass-through, bad input."""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import orjson
import pytest

from rollout_gateway.commands.engine_process import free_port

from _gateway_support import GatewayProcess, check_against_ground_truth, redis_urls, rollout

pytestmark = pytest.mark.integration

SEED = 1  # the shared ``engine`` fixture's weights (version 0)


@pytest.fixture(scope="module")
def urls():
    return redis_urls()


@pytest.fixture(scope="module")
def gateway(engine, urls):
    from rollout_gateway.commands.engine_process import EngineProcess

    with EngineProcess(seed=SEED, weight_version="0") as second:
        with GatewayProcess({"e0": engine.url, "e1": second.url}, store_url=urls[0],
                            registry_url=urls[1]) as gw:
            yield gw


@pytest.fixture(scope="module")
def models(reference_model):
    from reference_engine.config import ModelConfig

    return {0: reference_model((ModelConfig(), SEED))}


def test_rollout_stamps_match_ground_truth_and_publish(gateway, models, urls):
    body = rollout(gateway.url, [1, 2, 3, 4, 5], n=3, max_new_tokens=10, group_id="g-1",
                   metadata={"task": "t"})
    trajs = body["trajectories"]
    assert len(trajs) == 3 and [t["sample_index"] for t in trajs] == [0, 1, 2]
    assert len({t["trajectory_id"] for t in trajs}) == 3
    for t in trajs:
        assert t["group_id"] == "g-1" and t["metadata"] == {"task": "t", "tenant": "default"}
        assert t["num_tokens"] == 10 and t["finish_reason"]["type"] == "length"
        assert t["entropy_kind"] == "exact" and all(e is not None and e >= 0 for e in t["entropy"])
        check_against_ground_truth(t, models)
        r = t["routed_experts"]
        assert r["dtype"] == "|u1" and r["shape"] == [5 + 10 - 1, 4, 2]
        data = np.frombuffer(base64.b64decode(r["data_b64"]), np.uint8).reshape(r["shape"])
        assert data.max() < 8
    # sticky by group: every sample of the group ran on one engine
    assert len({t["segments"][0]["engine_id"] for t in trajs}) == 1

    import asyncio

    from rollout_gateway.store.factory import store_from_url

    async def stats():
        store = store_from_url(urls[0])
        try:
            return await store.stats()
        finally:
            await store.close()

    assert asyncio.run(stats()).published == 3


def test_text_prompt_and_idempotent_request_id(gateway, models):
    body = {"prompt": "hi!", "n": 1, "request_id": "req-abc",
            "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
    r1 = httpx.post(gateway.url + "/v1/rollouts", json=body, timeout=60).json()
    t = r1["trajectories"][0]
    assert t["trajectory_id"] == "req-abc:0"
    assert t["prompt_token_ids"] == list(b"hi!")
    check_against_ground_truth(t, models)
    before = httpx.get(gateway.url + "/metrics").text
    r2 = httpx.post(gateway.url + "/v1/rollouts", json=body, timeout=60).json()
    # the retry answers the stored trajectory (not a new generation)
    assert r2["trajectories"] == r1["trajectories"]
    after = httpx.get(gateway.url + "/metrics").text
    rep = [line for line in after.splitlines() if line.startswith("rollout_gateway_replayed_total")]
    assert rep and float(rep[0].split()[-1]) >= 1, (before, after)


def test_stream_gives_stamped_chunks_then_trajectories(gateway, models):
    body = {"input_ids": [7, 8, 9], "n": 2, "stream": True,
            "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
    events = []
    with httpx.stream("POST", gateway.url + "/v1/rollouts", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    evs = [json.loads(e) for e in events[:-1]]
    chunks = [e for e in evs if e["type"] == "chunk"]
    finals = [e for e in evs if e["type"] == "trajectory"]
    assert len(finals) == 2 and len(chunks) >= 2 * 5  # live: one chunk per decode step
    for f in finals:
        t = f["trajectory"]
        check_against_ground_truth(t, models)
        mine = [c for c in chunks if c["trajectory_id"] == t["trajectory_id"]]
        assert [c["offset"] for c in mine] == list(range(0, 5))
        for key in ("token_ids", "policy_version", "kv_version", "logprobs"):
            assert [x for c in mine for x in c[key]] == t[key], key


def test_generate_passthrough_is_sglang_shaped_and_stamped(gateway, models):
    body = {"input_ids": [10, 11, 12, 13], "rid": "slime-1",
            "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "n": 2},
            "return_logprob": True, "return_routed_experts": True}
    r = httpx.post(gateway.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    outs = r.json()
    assert isinstance(outs, list) and len(outs) == 2
    for o in outs:
        m = o["meta_info"]
        assert len(o["output_ids"]) == 6 == m["completion_tokens"]
        assert [row[1] for row in m["output_token_logprobs"]] == o["output_ids"]
        assert m["policy_versions"] == [0] * 6 and m["kv_versions"] == [0] * 6
        assert m["weight_version"] == "0" and m["finish_reason"]["type"] == "length"
        flat = np.frombuffer(base64.b64decode(m["routed_experts"]), "<i4")
        assert flat.size == (4 + 6 - 1) * 4 * 2
        traj = {"prompt_token_ids": body["input_ids"], "token_ids": o["output_ids"],
                "num_tokens": 6, "policy_version": m["policy_versions"],
                "kv_version": m["kv_versions"],
                "logprobs": [row[0] for row in m["output_token_logprobs"]],
                "segments": m["segments"]}
        check_against_ground_truth(traj, models)


def test_generate_passthrough_streams_cumulative_sglang_chunks(gateway):
    body = {"input_ids": [10, 11, 12], "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    chunks = []
    with httpx.stream("POST", gateway.url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    outs = [json.loads(c) for c in chunks[:-1]]
    assert [len(o["output_ids"]) for o in outs] == [1, 2, 3, 4, 4]
    assert all(o["meta_info"]["finish_reason"] is None for o in outs[:-1])
    final = outs[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    assert final["output_ids"][:3] == outs[2]["output_ids"]
    assert final["meta_info"]["policy_versions"] == [0, 0, 0, 0]
    assert len(final["meta_info"]["output_token_logprobs"]) == 4


@pytest.mark.parametrize("body,status,needle", [
    ({"input_ids": [1], "n": 1000}, 400, "n=1000"),  # the configured limit (64)
    ({"input_ids": [1], "n": 100000}, 422, "n: Input should be less than or equal to"),
    ({"prompt": "x", "input_ids": [1]}, 422, "exactly one"),
    ({"input_ids": []}, 422, "input_ids: List should have at least 1 item"),
    ({"input_ids": "abc"}, 422, "input_ids"),
    ({"input_ids": [1], "sampling_params": {"bogus": 1}}, 422, "bogus"),
    ({"input_ids": [-5]}, 422, "input_ids.0: Input should be greater than or equal to 0"),
    # outside the model's vocabulary: the gateway refuses it (SGLang would not)
    ({"input_ids": [99999]}, 400, "out of the model's vocabulary; valid ids are [0, 259)"),
])
def test_bad_rollout_requests_are_clear_4xx(gateway, body, status, needle):
    r = httpx.post(gateway.url + "/v1/rollouts", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and "Traceback" not in r.text


def test_malformed_json_and_unknown_engine(gateway):
    r = httpx.post(gateway.url + "/v1/rollouts", content=b"{nope",
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "INVALID_ARGUMENT"
    r = httpx.get(gateway.url + "/v1/engines/nope")
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    r = httpx.delete(gateway.url + "/v1/engines/nope")
    assert r.status_code == 404
    r = httpx.post(gateway.url + "/generate", content=b"[1,2", timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(gateway.url + "/generate", json={"text": ["a", "b"], "image_data": "x.png"},
                   timeout=30)
    assert r.status_code == 400 and "image_data" in r.json()["error"]["message"]


def test_swap_naming_an_unknown_engine_is_404(gateway, tmp_path):
    r = httpx.post(gateway.url + "/v1/weights", timeout=30, json={
        "version": 9, "engines": ["nope"], "source": {"kind": "disk", "path": str(tmp_path)}})
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    r = httpx.post(gateway.url + "/v1/weights", timeout=30, json={
        "version": 9, "mode": "sideways", "source": {"kind": "disk", "path": str(tmp_path)}})
    assert r.status_code == 422 and "mode" in r.json()["error"]["message"]


def test_version_going_backwards_is_refused(gateway):
    r = httpx.post(gateway.url + "/v1/weights", json={"version": 0}, timeout=30)
    assert r.status_code == 409, r.text
    assert "does not increase" in r.json()["error"]["message"]
    r = httpx.post(gateway.url + "/v1/weights", json={"version": -1}, timeout=30)
    assert r.status_code == 422


def test_engines_admin_and_versions(gateway, engine):
    r = httpx.get(gateway.url + "/v1/engines").json()
    assert {e["id"] for e in r["engines"]} == {"e0", "e1"}
    assert all(e["state"] == "healthy" and e["weight_version"] == 0 for e in r["engines"])
    r = httpx.post(gateway.url + "/v1/engines", json={"id": "e0", "url": engine.url})
    assert r.status_code == 409
    r = httpx.post(gateway.url + "/v1/engines", json={"id": "dead", "url": f"http://127.0.0.1:{free_port()}"})
    assert r.status_code == 503 and "dead" in r.json()["error"]["message"]
    v = httpx.get(gateway.url + "/v1/versions").json()
    assert v["learner_version"] == 0 and set(v["engines"]) == {"e0", "e1"}
    m = httpx.get(gateway.url + "/metrics").text
    assert 'rollout_gateway_engine_weight_version{engine="e0"} 0' in m


class _Garbage(BaseHTTPRequestHandler):
    """Answers discovery correctly and /generate with garbage."""

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802
        if self.path == "/server_info":
            self._send(200, orjson.dumps({"version": "0.5.23"}))
        elif self.path == "/model_info":
            self._send(200, orjson.dumps({"weight_version": "0"}))
        else:
            self._send(200, b"{}")

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self._send(200, b'data: {"text": 5, "meta_info": "garbage"}\n\ndata: [DONE]\n\n')

    def log_message(self, *a):
        pass


def test_engine_answering_garbage_is_a_clean_error(urls):
    srv = ThreadingHTTPServer(("127.0.0.1", free_port()), _Garbage)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        with GatewayProcess({"junk": f"http://127.0.0.1:{srv.server_address[1]}"},
                            env={"ROLLOUT_GATEWAY_TIMEOUTS__NO_ENGINE_S": "0.5"}) as gw:
            r = httpx.post(gw.url + "/v1/rollouts", json={"input_ids": [1, 2]}, timeout=60)
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["code"] == "UNAVAILABLE" and "Traceback" not in r.text
            r = httpx.post(gw.url + "/generate", json={"input_ids": [1, 2]}, timeout=60)
            assert r.status_code == 503 and "error" in r.json()
    finally:
        srv.shutdown()


def test_record_routing_off_asks_for_routing_only_when_the_caller_does(engine, urls):
    """ROLLOUT_GATEWAY_RECORD_ROUTING=false: a request that leaves return_routed_experts
    unset gets no routing (the engine is not asked), one that says true still gets it."""
    env = {"ROLLOUT_GATEWAY_RECORD_ROUTING": "false"}
    with GatewayProcess({"e0": engine.url}, env=env) as gw:
        plain = rollout(gw.url, [1, 2, 3], max_new_tokens=4)["trajectories"][0]
        assert "routed_experts" not in plain and plain["num_tokens"] == 4
        asked = rollout(gw.url, [1, 2, 3], max_new_tokens=4,
                        return_routed_experts=True)["trajectories"][0]
        assert asked["routed_experts"]["shape"] == [3 + 4 - 1, 4, 2]
        r = httpx.post(gw.url + "/generate", json={
            "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}}, timeout=60)
        assert r.status_code == 200, r.text
        assert "routed_experts" not in r.json()["meta_info"]
    # the default records routing for every request the engine can give it for
    with GatewayProcess({"e0": engine.url}) as gw:
        t = rollout(gw.url, [1, 2, 3], max_new_tokens=4)["trajectories"][0]
        assert t["routed_experts"]["shape"] == [3 + 4 - 1, 4, 2]


def _engine_chunks(gw) -> float:
    for line in httpx.get(gw.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("rollout_gateway_engine_chunks_total "):
            return float(line.split()[1])
    raise AssertionError("no rollout_gateway_engine_chunks_total metric")


@pytest.mark.parametrize("interval", [None, 16, 1])
def test_engine_stream_interval_sets_the_chunks_of_a_caller_who_does_not_stream(
        engine, models, interval):
    """A caller who does not stream: the gateway asks the engine for a chunk per
    engine_stream_interval tokens (default 64; the first token at once, the last chunk
    always), not one per token; 1 is SGLang's one per token. A streaming caller's engine
    request is left at one per token (it sees every token as it comes)."""
    env = {} if interval is None else {"ROLLOUT_GATEWAY_ENGINE_STREAM_INTERVAL": str(interval)}
    with GatewayProcess({"e0": engine.url}, env=env) as gw:
        before = _engine_chunks(gw)
        t = rollout(gw.url, [1, 2, 3], max_new_tokens=40)["trajectories"][0]
        assert t["num_tokens"] == 40
        check_against_ground_truth(t, models)  # stamps exact whatever the chunking
        chunks = _engine_chunks(gw) - before
        if interval is None:  # 1, 40 (+ the final chunk if it stands alone)
            assert 2 <= chunks <= 3, chunks
        elif interval == 16:  # 1, 17, 33, 40 (+ the final chunk if it stands alone)
            assert 4 <= chunks <= 5, chunks
        else:
            assert chunks >= 40, chunks
        if interval is None:  # a streaming caller: one engine chunk per token
            before = _engine_chunks(gw)
            with httpx.stream("POST", gw.url + "/v1/rollouts", timeout=120, json={
                    "input_ids": [1, 2, 3], "stream": True, "sampling_params": {
                        "max_new_tokens": 40, "ignore_eos": True}}) as r:
                assert r.status_code == 200
                r.read()
            assert _engine_chunks(gw) - before >= 40
