"""An engine that changes behind the gateway, and a cache flush the engine refuses
(issue 19, findings 5 and 6), with reference engines in ``--sglang-strict`` mode as real
processes and the gateway as a real process.

* Restarted on the same URL with other weights and another version, the engine is
  registered again (new epoch, new version) before it serves a stamped token: whether the
  health probe sees the new identity first, or an answer carrying a version label the
  gateway cannot account for (then the sample resumes once the engine is registered
  again, and nothing of the changed engine's first answer is stamped).
* A drain swap whose cache flush the engine refuses (another controller paused it in
  place over a request sent to it directly) still swaps the weights; the gateway repairs the label the engine left behind
  and stamps the new version, checked against recomputation.
"""

from __future__ import annotations

import threading

import httpx
import pytest
from _gateway_support import GatewayProcess, check_against_ground_truth, rollout, wait_for

from reference_engine.config import ModelConfig
from rollout_gateway.commands.engine_process import EngineProcess

pytestmark = pytest.mark.integration

SEEDS = {0: 41, 1: 42, 5: 46}  # version -> seed of its weights
PROMPT = [7, 8, 9, 10]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from reference_engine.checkpoint import init_checkpoint

    root = tmp_path_factory.mktemp("restart_ckpts")
    return {v: init_checkpoint(root / f"v{v}", seed=s) for v, s in SEEDS.items()}


@pytest.fixture(scope="module")
def models(reference_model):
    return {v: reference_model((ModelConfig(), s)) for v, s in SEEDS.items()}


def engine_view(gw) -> dict:
    return httpx.get(gw.url + "/v1/engines/e0", timeout=10).json()


def restart(eng: EngineProcess, ckpt, version: str, **kw) -> EngineProcess:
    eng.stop()
    return EngineProcess(checkpoint=ckpt, weight_version=version, sglang_strict=True,
                         port=eng.port, **kw).start()


def stamped(traj) -> set[int]:
    return set(traj["policy_version"]) | set(traj["kv_version"])


def test_a_restart_seen_by_an_answer_is_registered_again_before_a_token_is_stamped(
        make_engine, ckpts, models):
    # no health probe runs during the test: only the answer can reveal the restart
    e0 = make_engine(checkpoint=ckpts[0], weight_version="0", sglang_strict=True)
    with GatewayProcess({"e0": e0.url}, env={"ROLLOUT_GATEWAY_HEALTH_INTERVAL_S": "600"}) as gw:
        before = rollout(gw.url, PROMPT, max_new_tokens=8)["trajectories"][0]
        assert stamped(before) == {0}
        check_against_ground_truth(before, models)
        assert engine_view(gw)["epoch"] == 0
        e1 = restart(e0, ckpts[5], "5")
        try:
            after = rollout(gw.url, PROMPT, max_new_tokens=8)["trajectories"][0]
            view = engine_view(gw)
            assert (view["epoch"], view["weight_version"], view["state"]) == (1, 5, "healthy")
            assert stamped(after) == {5}, after["segments"]
            check_against_ground_truth(after, models)
            assert "changed behind the gateway" in gw.log_tail(20000)
        finally:
            e1.stop()


def test_a_restart_seen_by_the_health_probe_is_registered_again(make_engine, ckpts, models):
    # the outage itself is never counted (unhealthy only after 1000 failed probes): only
    # the identity the probe reads can reveal the restart
    e0 = make_engine(checkpoint=ckpts[0], weight_version="0", sglang_strict=True)
    env = {"ROLLOUT_GATEWAY_HEALTH_INTERVAL_S": "0.2", "ROLLOUT_GATEWAY_UNHEALTHY_AFTER": "100"}
    with GatewayProcess({"e0": e0.url}, env=env) as gw:
        assert stamped(rollout(gw.url, PROMPT, max_new_tokens=4)["trajectories"][0]) == {0}
        e1 = restart(e0, ckpts[5], "5")
        try:
            view = wait_for(lambda: (v := engine_view(gw))["epoch"] == 1 and v, 60,
                            "the restarted engine registered again")
            assert (view["weight_version"], view["state"]) == (5, "healthy")
            after = rollout(gw.url, PROMPT, max_new_tokens=8)["trajectories"][0]
            assert stamped(after) == {5}
            check_against_ground_truth(after, models)
        finally:
            e1.stop()


def test_a_restart_with_the_same_weights_and_label_is_a_new_incarnation(make_engine, ckpts):
    """Only the process fingerprint (/server_info startup_time, random_seed) tells: a new
    epoch, so the fresh process's cache gets a KV namespace of its own."""
    e0 = make_engine(checkpoint=ckpts[0], weight_version="0", sglang_strict=True)
    env = {"ROLLOUT_GATEWAY_HEALTH_INTERVAL_S": "0.2", "ROLLOUT_GATEWAY_UNHEALTHY_AFTER": "100"}
    with GatewayProcess({"e0": e0.url}, env=env) as gw:
        seed = httpx.get(e0.url + "/server_info").json()["random_seed"]
        e1 = restart(e0, ckpts[0], "0")
        try:
            assert httpx.get(e1.url + "/server_info").json()["random_seed"] != seed
            view = wait_for(lambda: (v := engine_view(gw))["epoch"] == 1 and v, 60,
                            "the new process registered again")
            assert (view["weight_version"], view["state"]) == (0, "healthy")
            assert "a new process" in gw.log_tail(20000)
        finally:
            e1.stop()


def test_a_refused_cache_flush_during_a_swap_still_stamps_the_new_version(
        make_engine, ckpts, models):
    e0 = make_engine(checkpoint=ckpts[0], weight_version="0", sglang_strict=True,
                     step_delay_ms=20)
    with GatewayProcess({"e0": e0.url}) as gw:
        assert stamped(rollout(gw.url, PROMPT, max_new_tokens=4)["trajectories"][0]) == {0}
        # another controller paused the engine in place over a request the gateway does
        # not know of: the update does not wait for it (paused), and the flush a drain swap
        # asks for is refused (SGLang: HTTP 400 "Weights were updated, but the cache was
        # not flushed ..."), though the weights are swapped
        direct = threading.Thread(target=httpx.post, args=(e0.url + "/generate",), kwargs={
            "json": {"rid": "outsider", "input_ids": [1, 2, 3],
                     "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}},
            "timeout": 120})
        direct.start()
        try:
            wait_for(lambda: httpx.get(e0.url + "/server_info").json()["internal_states"][0][
                "num_running_reqs"], 60, "the outside request running on the engine")
            paused = httpx.post(e0.url + "/pause_generation", json={"mode": "in_place"})
            assert paused.status_code == 200, paused.text
            r = httpx.post(gw.url + "/v1/weights", timeout=120, json={
                "version": 1, "mode": "drain",
                "source": {"kind": "disk", "path": str(ckpts[1])}})
            assert r.status_code == 200, r.text
            out = r.json()["engines"]["e0"]
            assert (out["ok"], out["cache_kept"], out["version_after"]) == (True, True, 1)
            # the label SGLang leaves at the old version was repaired
            assert httpx.get(e0.url + "/model_info").json()["weight_version"] == "1"
            httpx.post(e0.url + "/continue_generation", json={})  # the controller resumes
            # another prompt: the unflushed cache still holds the first one's v0 KV (the
            # strict engine's radix cache has no cache_salt namespaces)
            after = rollout(gw.url, [20, 21, 22, 23], max_new_tokens=8)["trajectories"][0]
            assert stamped(after) == {1}
            check_against_ground_truth(after, models)
            # the controller's resume is seen by the next health probe: healthy again, the
            # same registration (a swap's refused flush is no change of engine)
            view = wait_for(lambda: (v := engine_view(gw))["state"] == "healthy" and v, 60,
                            "the resumed engine healthy again")
            assert (view["weight_version"], view["epoch"]) == (1, 0)
        finally:
            httpx.post(e0.url + "/abort_request", json={"rid": "outsider"})
            direct.join(60)
