"""Hot-swap from a distributed group: this test process plays the learner (rank 0 of a
gloo group) and broadcasts new weights into two engines through the gateway's swap."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from _gateway_support import GatewayProcess, check_against_ground_truth, rollout

from reference_engine.checkpoint import build_model, to_hub_state_dict
from reference_engine.config import ModelConfig
from reference_engine.distributed import init_custom_process_group
from rollout_gateway.commands.engine_process import free_port

pytestmark = pytest.mark.integration


def test_swap_from_a_distributed_group(make_engine, reference_model):
    torch.set_num_threads(1)
    a, b = make_engine(seed=1), make_engine(seed=1)
    new = build_model(ModelConfig(), 2)
    named = to_hub_state_dict(new)
    names = list(named)
    port = free_port()
    source = {"kind": "distributed", "master_address": "127.0.0.1", "master_port": port,
              "backend": "gloo", "world_size": 3, "group_name": "wu", "names": names,
              "dtypes": [str(named[n].dtype).removeprefix("torch.") for n in names],
              "shapes": [list(named[n].shape) for n in names]}
    with GatewayProcess({"a": a.url, "b": b.url}) as gw:
        r = httpx.post(gw.url + "/v1/weights", timeout=30,
                       json={"version": 1, "source": source, "mode": "in_place", "rolling": True})
        assert r.status_code == 422 and "rolling" in r.json()["error"]["message"]
        with ThreadPoolExecutor(1) as ex:
            swap = ex.submit(httpx.post, gw.url + "/v1/weights", timeout=120,
                             json={"version": 1, "source": source, "mode": "in_place"})
            pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 3, 0, "wu")
            for n in names:
                torch.distributed.broadcast(named[n], src=0, group=pg)
            r = swap.result()
            torch.distributed.destroy_process_group(pg)
        assert r.status_code == 200, r.text
        rec = r.json()
        assert rec["status"] == "succeeded" and rec["source"].startswith("distributed:wu@")
        assert {e["version_after"] for e in rec["engines"].values()} == {1}
        body = rollout(gw.url, [4, 5, 6], n=4, max_new_tokens=6)
        models = {1: reference_model((ModelConfig(), 2))}
        for t in body["trajectories"]:
            assert set(t["policy_version"]) == {1}
            check_against_ground_truth(t, models)
        assert {t["engine_ids"][0] for t in body["trajectories"]} == {"a", "b"}
