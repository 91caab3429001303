"""Bad input gets SGLang-style 400s with a message; the engine keeps serving."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from reference_engine.checkpoint import init_checkpoint
from reference_engine.config import ModelConfig

pytestmark = pytest.mark.integration


def post(engine, body, path="/generate"):
    return httpx.post(engine.url + path, json=body, timeout=60)


def error_message(r: httpx.Response) -> str:
    err = r.json()["error"]
    return err if isinstance(err, str) else err["message"]


@pytest.mark.parametrize("body,needle", [
    ({"input_ids": []}, "input_ids cannot be empty"),
    ({"text": ""}, "cannot be empty"),
    ({}, "Either text or input_ids"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}},
     "max_new_tokens must be at least 0, got -1"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": -0.5}}, "temperature"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p must be in (0, 1]"),
    ({"input_ids": [1, 999999]}, "Input token id 999999 is out of vocabulary"),
    ({"input_ids": [-1]}, "out of vocabulary"),
    ({"input_ids": ["a"]}, "input_ids must be a list of integers"),
    ({"input_ids": [1], "sampling_params": {"regex": "a+"}}, "not supported"),
])
def test_bad_generate_is_400(engine, body, needle):
    r = post(engine, body)
    assert r.status_code == 400, r.text
    assert needle in error_message(r)


def test_unknown_sampling_key_uses_sglang_contract_text(engine):
    r = post(engine, {"input_ids": [1, 2], "sampling_params": {"max_new_token": 3}})
    assert r.status_code == 400
    body = r.json()
    assert isinstance(body["error"], str)
    assert body["error"].startswith("unknown field `max_new_token`, expected one of "
                                    "`max_new_tokens`, `stop`, ")


def test_not_json_is_400(engine):
    r = httpx.post(engine.url + "/generate", content=b"{nope", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "Invalid JSON" in error_message(r)


async def test_duplicate_inflight_rid(make_engine):
    eng = make_engine(seed=1, step_delay_ms=20)
    async with httpx.AsyncClient(timeout=60) as c:
        first = asyncio.create_task(c.post(eng.url + "/generate", json={
            "input_ids": [1, 2], "rid": "dup",
            "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}}))
        for _ in range(100):
            info = (await c.get(eng.url + "/server_info")).json()
            if info["num_running_reqs"] + info["num_waiting_reqs"]:
                break
            await asyncio.sleep(0.02)
        r = await c.post(eng.url + "/generate", json={"input_ids": [1], "rid": "dup"})
        assert r.status_code == 400
        assert error_message(r) == "Duplicate request ID detected: dup"
        done = await first
        assert done.status_code == 200 and done.json()["meta_info"]["completion_tokens"] == 60
        # once finished, the rid is free again
        again = await c.post(eng.url + "/generate", json={
            "input_ids": [1], "rid": "dup", "sampling_params": {"max_new_tokens": 1}})
        assert again.status_code == 200


def _greedy(eng):
    return post(eng, {"input_ids": [256, 7, 8], "sampling_params": {
        "max_new_tokens": 8, "temperature": 0}}).json()["output_ids"]


def test_bad_checkpoints_keep_old_weights(make_engine, tmp_path):
    eng = make_engine(seed=1)
    before = _greedy(eng)
    r = post(eng, {"model_path": str(tmp_path / "missing"), "weight_version": "9"},
             "/update_weights_from_disk")
    assert r.status_code == 400 and r.json()["success"] is False
    assert "does not exist" in r.json()["message"]
    wrong = init_checkpoint(tmp_path / "wrong", ModelConfig(hidden_size=32), seed=3)
    r = post(eng, {"model_path": str(wrong), "weight_version": "9"}, "/update_weights_from_disk")
    assert r.status_code == 400 and r.json()["success"] is False
    assert "shape" in r.json()["message"]
    (tmp_path / "empty").mkdir()
    r = post(eng, {"model_path": str(tmp_path / "empty")}, "/update_weights_from_disk")
    assert r.json()["success"] is False
    assert httpx.get(eng.url + "/model_info").json()["weight_version"] == "0"
    assert _greedy(eng) == before
    r = post(eng, {}, "/update_weights_from_disk")
    assert r.status_code == 400


def test_bad_control_requests(engine):
    assert post(engine, {"mode": "sideways"}, "/pause_generation").status_code == 400
    assert post(engine, {}, "/update_weight_version").status_code == 400
    r = post(engine, {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]},
             "/update_weights_from_distributed")
    assert r.status_code == 400 and r.json()["success"] is False
    assert "begin_weight_update" in r.json()["message"]
    r = post(engine, {"names": ["x"], "dtypes": ["nope"], "shapes": [[1]]},
             "/update_weights_from_distributed")
    assert r.status_code == 400 and "dtype" in error_message(r)
    assert httpx.get(engine.url + "/health").status_code == 200
