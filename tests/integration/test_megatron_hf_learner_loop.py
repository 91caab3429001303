"""The plain transformers learner against a real reference-engine process over HTTP.

Rollout (engine) -> pack -> logprobs with R3 (learner) equal to the engine's stamps ->
one PPO step -> save_for_engine -> /update_weights_from_disk -> the engine now samples
from exactly the learner's new weights.
"""

import base64

import httpx
import numpy as np
import pytest
import torch

from learner_client.corrections import LossInputs, compute_loss
from learner_client.hf import load_model, packed_logprobs, save_for_engine
from learner_client.megatron.packing import PackSample, pack_samples

pytestmark = pytest.mark.integration
torch.set_num_threads(1)
TEMP = 0.8


def _rollouts(url, prompts, n_new=12):
    out = []
    for i, prompt in enumerate(prompts):
        r = httpx.post(url + "/generate", timeout=60, json={
            "input_ids": prompt, "sampling_params": {"max_new_tokens": n_new, "temperature": TEMP,
                                                     "ignore_eos": True},
            "return_logprob": True, "return_entropy": True, "return_routed_experts": True})
        assert r.status_code == 200, r.text
        body = r.json()
        meta = body["meta_info"]
        out.append(dict(
            prompt=np.array(prompt), ids=np.array(body["output_ids"]),
            logprobs=np.array([t[0] for t in meta["output_token_logprobs"]], np.float32),
            entropy=np.array(meta["output_token_entropy"], np.float32),
            routed=np.frombuffer(base64.b64decode(meta["routed_experts"]), "<i4"),
            version=meta["weight_version"]))
    return out


def _pack(rollouts, model):
    cfg = model.config
    samples = []
    for i, r in enumerate(rollouts):
        routed = r["routed"].reshape(-1, cfg.num_hidden_layers, cfg.num_experts_per_tok)
        samples.append(PackSample(r["prompt"], r["ids"], {
            "rollout_logprobs": r["logprobs"], "entropy": r["entropy"],
            "advantages": np.float32(1.0 if i % 2 == 0 else -1.0)}, routed_experts=routed))
    return pack_samples(samples)


def test_learner_matches_engine_then_hot_swaps_its_weights(make_engine, checkpoint_v1, tmp_path):
    eng = make_engine(checkpoint=checkpoint_v1, weight_version="0")
    prompts = [[256, *b"hello"], [256, *b"rollout gateway"]]
    model = load_model(checkpoint_v1)
    first = _rollouts(eng.url, prompts)
    batch = _pack(first, model)
    lp, ent = packed_logprobs(model, batch, temperature=TEMP, replay=True)
    # the learner reproduces the engine's behavior logprobs and exact entropy
    torch.testing.assert_close(lp.detach(), batch.columns["rollout_logprobs"], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(ent.detach(), batch.columns["entropy"], atol=2e-4, rtol=1e-4)

    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss, metrics = compute_loss("ppo_clip", LossInputs(
        logprobs=lp, rollout_logprobs=batch.columns["rollout_logprobs"],
        advantages=batch.columns["advantages"], loss_mask=batch.loss_mask(),
        cu_seqlens=batch.cu_response))
    loss.backward()
    opt.step()
    new_dir = save_for_engine(model, tmp_path / "v1")
    up = httpx.post(eng.url + "/update_weights_from_disk", timeout=60, json={
        "model_path": str(new_dir), "weight_version": "1"})
    assert up.status_code == 200 and up.json()["success"] is True, up.text

    second = _rollouts(eng.url, prompts)
    assert {r["version"] for r in second} == {"1"}
    batch2 = _pack(second, model)
    with torch.no_grad():
        lp2, _ = packed_logprobs(model, batch2, temperature=TEMP, replay=True)
        lp_old, _ = packed_logprobs(load_model(checkpoint_v1), batch2, temperature=TEMP,
                                    replay=True)
    torch.testing.assert_close(lp2, batch2.columns["rollout_logprobs"], atol=2e-4, rtol=1e-4)
    assert (lp_old - lp2).abs().max() > 1e-3  # the swap really changed the policy
