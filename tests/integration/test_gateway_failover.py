"""An engine SIGKILLed mid-rollout: the rollouts finish on the other engine from the
tokens already generated, with segments that say so, and no token lost or duplicated."""

from __future__ import annotations

import httpx
import pytest
from _gateway_support import (GatewayProcess, Streams, check_against_ground_truth, redis_urls,
                              rollout)

from reference_engine.config import ModelConfig

pytestmark = pytest.mark.integration

SEED = 3


@pytest.mark.parametrize("incremental,strict", [(False, False), (True, False), (False, True)],
                         ids=["cumulative", "incremental", "sglang-strict"])
def test_sigkill_mid_rollout_fails_over_with_partial_output(make_engine, reference_model,
                                                            incremental, strict):
    kw = {"sglang_strict": True, "enable_return_routed_experts": True} if strict else {}
    a = make_engine(seed=SEED, step_delay_ms=30, incremental_streaming_output=incremental, **kw)
    b = make_engine(seed=SEED, step_delay_ms=30, incremental_streaming_output=incremental, **kw)
    models = {0: reference_model((ModelConfig(), SEED))}
    store, registry = redis_urls()
    with GatewayProcess({"a": a.url, "b": b.url}, store_url=store, registry_url=registry) as gw:
        with Streams(gw.url) as st:
            # one group -> sticky to one engine; that is the one we kill
            fut = st.start([9, 8, 7], n=3, max_new_tokens=20, group_id="grp")
            st.wait_tokens(3)  # every sample has tokens out
            (victim,) = set(st.engine.values())
            (a if victim == "a" else b).kill()
            trajs = fut.result()["trajectories"]
        survivor = "b" if victim == "a" else "a"
        assert len(trajs) == 3
        for t in trajs:
            assert t["num_tokens"] == 20 and t["finish_reason"]["type"] == "length"
            segs = t["segments"]
            assert [s["engine_id"] for s in segs] == [victim, survivor], segs
            assert segs[0]["ended"] == "failover" and segs[1]["began"] == "failover"
            assert 0 < segs[0]["end"] < 20  # partial output from the dead engine was kept
            check_against_ground_truth(t, models)
            if strict:  # routing from config.json, stitched across the failover; top-k entropy
                assert t["routed_experts"]["shape"] == [3 + 20 - 1, 4, 2]
                assert t["entropy_kind"] == "topk_estimate"
        # the dead engine left rotation; the gateway still serves
        e = httpx.get(gw.url + f"/v1/engines/{victim}").json()
        assert e["state"] == "unhealthy"
        t = rollout(gw.url, [1, 2, 3], max_new_tokens=4)["trajectories"][0]
        assert t["engine_ids"] == [survivor]
        m = httpx.get(gw.url + "/metrics").text
        assert "rollout_gateway_failovers_total 3" in m
        # each resubmission re-prefilled prompt (3) + the partial output it carried
        want = sum(3 + t["segments"][1]["start"] for t in trajs)
        assert f"rollout_gateway_tokens_reprefilled_total {want}" in m


def test_the_only_engine_restarting_mid_rollout_resumes_on_it(make_engine, reference_model):
    from rollout_gateway.commands.engine_process import EngineProcess

    a = make_engine(seed=SEED, step_delay_ms=30)
    models = {0: reference_model((ModelConfig(), SEED))}
    # the sample waits for the restart (torch import, load): minutes under heavy CPU load
    env = {"ROLLOUT_GATEWAY_TIMEOUTS__NO_ENGINE_S": "180"}
    with GatewayProcess({"a": a.url}, env=env) as gw:
        with Streams(gw.url) as st:
            fut = st.start([5, 5, 5], max_new_tokens=16)
            st.wait_tokens(2)
            a.kill()
            again = EngineProcess(seed=SEED, step_delay_ms=30, port=a.port).start()
            try:
                t = fut.result()["trajectories"][0]
            finally:
                again.stop()
        segs = t["segments"]
        assert [(s["engine_id"], s["began"]) for s in segs] == [("a", "start"), ("a", "failover")]
        assert 0 < segs[0]["end"] < 16 and t["num_tokens"] == 16
        check_against_ground_truth(t, models)
