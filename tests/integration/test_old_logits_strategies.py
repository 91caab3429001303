"""The gateway's exact old-logit strategies over real processes: two reference engines (the
generation pool and a dedicated scorer), ``rollout-gateway serve --old-logits ...``, a swap
landing in the middle of generation, and a learner pulling over gRPC. Every delivered
token's ``old_logprobs`` must equal a fresh forward pass under the weights of the version
that produced it (in-process recomputation from the checkpoint)."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
from _gateway_support import GatewayProcess, Streams, rollout

from reference_engine.config import ModelConfig
from rollout_gateway.commands.engine_process import EngineProcess
from reference_engine.reference import score

pytestmark = pytest.mark.integration

BASE_SEED = 31  # version v has seed BASE_SEED + v
STEP_MS = 25
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from reference_engine.checkpoint import init_checkpoint

    root = tmp_path_factory.mktemp("oldlogit_ckpts")
    return {v: init_checkpoint(root / f"v{v}", seed=BASE_SEED + v) for v in range(3)}


@pytest.fixture(scope="module")
def models(reference_model):
    return {v: reference_model((ModelConfig(), BASE_SEED + v)) for v in range(3)}


def _metrics(gw) -> dict[str, float]:
    out = {}
    for line in httpx.get(gw.url + "/metrics").text.splitlines():
        if line.startswith("rollout_gateway_old_logits_"):
            k, v = line.rsplit(" ", 1)
            out[k.removeprefix("rollout_gateway_old_logits_").removesuffix("_total")] = float(v)
    return out


def _run(mode: str, ckpts, models, swap_mode: str = "abort_resume"):
    from learner_client.client import TrajectoryClient

    with EngineProcess(checkpoint=ckpts[0], step_delay_ms=STEP_MS) as e0, \
            EngineProcess(checkpoint=ckpts[0]) as scorer:
        gw = GatewayProcess({"e0": e0.url})
        gw.args += ["--old-logits", mode, "--old-logits-scorer", scorer.url,
                    "--old-logits-initial-source", str(ckpts[0])]
        with gw:
            # rollouts in flight while the weights change: abort_resume splits them
            with Streams(gw.url) as st:
                futs = [st.start([5 + i, 6, 7 + i], max_new_tokens=NEW_TOKENS)
                        for i in range(3)]
                st.wait_tokens(2)  # every sample generating when the weights change
                r = httpx.post(gw.url + "/v1/weights", timeout=120, json={
                    "version": 1, "mode": swap_mode,
                    "source": {"kind": "disk", "path": str(ckpts[1])}})
                assert r.status_code == 200, r.text
                sent = [t for f in futs for t in f.result()["trajectories"]]
            after = rollout(gw.url, [9, 2], n=2, max_new_tokens=6)["trajectories"]
            sent += after
            spanning = [t for t in sent if len(set(t["policy_version"])) > 1]
            assert spanning, "no rollout spanned the swap"
            client = TrajectoryClient(f"127.0.0.1:{gw.grpc_port}", group="learner")
            try:
                client.create_group()
                got = []
                deadline = time.monotonic() + 60
                while len(got) < len(sent) and time.monotonic() < deadline:
                    got += client.pull(len(sent) - len(got), timeout=5)
                assert sorted(x.trajectory_id for x in got) == sorted(
                    t["trajectory_id"] for t in sent)
                for rr in got:
                    assert rr.old_logprobs is not None, rr.trajectory_id
                    assert not np.isnan(rr.old_logprobs).any()
                    ids = rr.prompt_token_ids.tolist() + rr.token_ids.tolist()
                    p = len(rr.prompt_token_ids)
                    want = np.full(rr.num_tokens, np.nan)
                    for v in set(rr.policy_version.tolist()):
                        sel = rr.policy_version == v
                        want[sel] = score(models[v], ids, p).logprobs[sel]
                    np.testing.assert_allclose(rr.old_logprobs, want, atol=2e-3, rtol=0)
                client.ack(got)
            finally:
                client.close()
            m = _metrics(gw)
            # the values came from the scorer (every token scored at least once)
            assert m["scorer_scored_tokens"] >= sum(t["num_tokens"] for t in sent)
            return m, len(spanning)


def test_dedicated_old_logit_model_fills_every_token_under_its_version(ckpts, models):
    m, _ = _run("model", ckpts, models)
    assert m["trajectories_filled"] >= 5 and m["fill_failed"] == 0
    assert m["tokens_at_swaps"] == 0  # nothing at the swap: all at finish
    assert m["scorer_weight_loads"] >= 1  # v1 loaded, and v0 again for the spanning ones


def test_interruption_sync_scores_partial_rollouts_at_the_swap(ckpts, models):
    m, spanning = _run("interruption", ckpts, models)
    assert m["swaps_scored"] == 1 and m["fill_failed"] == 0
    assert m["tokens_at_swaps"] > 0  # the partial prefixes were scored before the load
    # the scorer followed the pool once (inside the pause) and went back to the old version
    # only for a request caught in flight by the pause (none in the usual run)
    assert 1 <= m["scorer_weight_loads"] <= 1 + m["late_at_swaps"]


def test_interruption_sync_refuses_swaps_it_cannot_follow(ckpts, make_engine):
    e0 = make_engine(checkpoint=ckpts[0])
    scorer = make_engine(checkpoint=ckpts[0])
    gw = GatewayProcess({"e0": e0.url})
    gw.args += ["--old-logits", "interruption", "--old-logits-scorer", scorer.url]
    with gw:
        r = httpx.post(gw.url + "/v1/weights", timeout=60, json={
            "version": 1, "mode": "in_place", "source": {"kind": "disk", "path": str(ckpts[1])}})
        assert r.status_code == 409, r.text  # FAILED_PRECONDITION
        assert "abort_resume" in r.json()["error"]["message"]
        assert httpx.get(gw.url + "/v1/engines/e0").json()["weight_version"] == 0
