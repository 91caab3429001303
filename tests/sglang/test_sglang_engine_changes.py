"""The real SGLang 0.5.23 server changing behind the gateway, and refusing a cache flush
(issue 19, findings 5 and 6); every stamp checked against recomputation
(``_stamp_truth.GroundTruth``).

* SGLang restarted on the same port with another checkpoint and version while the gateway
  runs (no health probe in between: the answer reveals it) is registered again (a new
  epoch, the new version read back) before a token of it is stamped; its ``/server_info``
  identifies the new process (``startup_time``, ``random_seed``).
* SGLang paused in place by another controller over a resident request refuses the flush
  of a drain swap (HTTP 400 ``success: false``, ``/model_info`` left at the old version)
  though it swapped the weights: the gateway repairs the label and stamps the new version.
"""

from __future__ import annotations

import threading

import httpx
import pytest
from _stamp_truth import GatewayServe, GroundTruth, from_rollout

from rollout_gateway.engines.identity import process_marker

NEW = 12


@pytest.fixture(scope="module")
def truth(sglang_reference) -> GroundTruth:
    return GroundTruth(sglang_reference)


def rollout(gw: GatewayServe, ids: list[int], label: str):
    r = httpx.post(gw.url + "/v1/rollouts", timeout=300, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": NEW, "temperature": 1.0,
                                              "ignore_eos": True}})
    assert r.status_code == 200, r.text + gw.log_tail()
    return from_rollout(r.json()["trajectories"][0], 1.0, label)


def engine_view(gw: GatewayServe) -> dict:
    return httpx.get(gw.url + "/v1/engines/e0", timeout=10).json()


def assert_exact(truth: GroundTruth, items, versions, gw: GatewayServe) -> None:
    rep = truth.check_all(items, versions)
    print("\n" + rep.summary("engine changes"))
    assert rep.total == 0, rep.summary("engine changes") + gw.log_tail()


def test_sglang_restarted_with_other_weights_is_registered_again_before_it_serves(
        make_sglang, sglang_checkpoints, sglang_logs, truth):
    srv = make_sglang()
    env = {"ROLLOUT_GATEWAY_HEALTH_INTERVAL_S": "600"}  # only the answer can tell
    with GatewayServe({"e0": srv.url}, env=env, log_dir=sglang_logs) as gw:
        before = rollout(gw, [5, 40, 41, 42, 43], "before")
        info = srv.server_info()  # what tells processes apart (engines.identity)
        assert isinstance(info["random_seed"], int) and "load_weight" in info["startup_time"]
        first = process_marker(info)
        srv.restart(model_path=sglang_checkpoints.path("2"), weight_version="2")
        second = process_marker(srv.server_info())
        assert None not in (first, second) and first != second
        after = rollout(gw, [6, 50, 51, 52, 53], "after")
        view = engine_view(gw)
        assert (view["epoch"], view["weight_version"], view["state"]) == (1, 2, "healthy")
        assert set(before.policy_version) == {0} and set(after.policy_version) == {2}
        assert set(after.kv_version) == {2}
        assert_exact(truth, [before, after], (0, 2), gw)


def test_a_flush_sglang_refuses_during_a_swap_still_stamps_the_new_version(
        sglang, sglang_checkpoints, sglang_logs, truth):
    with GatewayServe({"e0": sglang.url}, log_dir=sglang_logs) as gw:
        before = rollout(gw, [7, 60, 61, 62, 63], "before")
        started = threading.Event()

        def outsider() -> None:  # a request the gateway does not know of
            body = {"rid": "outsider", "input_ids": [8, 70, 71], "stream": True,
                    "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
            with httpx.stream("POST", sglang.url + "/generate", json=body, timeout=300) as r:
                for _ in r.iter_lines():
                    started.set()

        t = threading.Thread(target=outsider, daemon=True)
        t.start()
        try:
            assert started.wait(120), "the outside request never streamed"
            r = httpx.post(sglang.url + "/pause_generation", json={"mode": "in_place"})
            assert r.status_code == 200, r.text
            path0 = sglang.model_info()["model_path"]
            r = httpx.post(gw.url + "/v1/weights", timeout=300, json={
                "version": 1, "mode": "drain",
                "source": {"kind": "disk", "path": str(sglang_checkpoints.path("1"))}})
            assert r.status_code == 200, r.text + gw.log_tail()
            out = r.json()["engines"]["e0"]
            assert (out["ok"], out["cache_kept"], out["version_after"]) == (True, True, 1)
            info = sglang.model_info()
            # repaired label; SGLang's model_path stays where the refused update left it
            assert (info["weight_version"], info["model_path"]) == ("1", path0)
            assert "cache was not flushed" in gw.log_tail(20000)
        finally:
            httpx.post(sglang.url + "/continue_generation", json={})
            httpx.post(sglang.url + "/abort_request", json={"rid": "outsider"})
            t.join(60)
        after = rollout(gw, [9, 80, 81, 82, 83], "after")
        assert set(after.policy_version) == {1}
        assert_exact(truth, [before, after], (0, 1), gw)
