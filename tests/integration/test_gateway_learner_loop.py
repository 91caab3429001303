"""The whole loop over real processes: rollouts over HTTP, a learner pulls them over gRPC
(learner_client), announces a new version over gRPC, and the gateway hot-swaps the engines."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
from _gateway_support import GatewayProcess, redis_urls, rollout

pytestmark = pytest.mark.integration


def test_learner_pulls_stamped_trajectories_and_announces_a_version(make_engine,
                                                                    checkpoint_v2):
    from learner_client.client import TrajectoryClient

    second = make_engine(seed=1)
    store, registry = redis_urls()
    with GatewayProcess({"e0": second.url}, store_url=store, registry_url=registry) as gw:
        body = rollout(gw.url, [3, 1, 4, 1, 5], n=2, max_new_tokens=7, group_id="pi")
        sent = {t["trajectory_id"]: t for t in body["trajectories"]}
        client = TrajectoryClient(f"127.0.0.1:{gw.grpc_port}", group="trainer")
        try:
            client.create_group()
            got = client.pull(2, timeout=10)
            assert sorted(r.trajectory_id for r in got) == sorted(sent)
            for r in got:
                t = sent[r.trajectory_id]
                assert r.token_ids.tolist() == t["token_ids"]
                assert r.policy_version.tolist() == t["policy_version"]
                assert r.kv_version.tolist() == t["kv_version"]
                assert np.array_equal(r.logprobs, np.asarray(t["logprobs"], np.float32))
                re = t["routed_experts"]
                want = np.frombuffer(base64.b64decode(re["data_b64"]), np.uint8).reshape(re["shape"])
                assert r.routed_experts.dtype == np.uint8
                assert np.array_equal(r.routed_experts, want)
                assert [s.engine_id for s in r.segments] == ["e0"]
            assert client.ack(got) == 2
            res = client.announce(1, str(checkpoint_v2), kind="path", mode="retract")
            assert res.accepted, res
            st = client.status()
            assert st.learner_version == 1
            eng = httpx.get(gw.url + "/v1/engines/e0").json()
            assert eng["weight_version"] == 1
            t = rollout(gw.url, [2, 7], max_new_tokens=3)["trajectories"][0]
            assert t["policy_version"] == [1, 1, 1]
        finally:
            client.close()
