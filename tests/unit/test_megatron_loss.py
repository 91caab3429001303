"""make_loss_func through megatron-core 0.16.1's own forward_step_calc_loss (CPU)."""

import numpy as np
import pytest
import torch

from learner_client.corrections import LOSSES, LossInputs, compute_loss
from learner_client.megatron.loss import make_loss_func
from learner_client.megatron.packing import PackSample, pack_samples

torch.set_num_threads(1)
V = 17


def _microbatch(seed, lens):
    rng = np.random.default_rng(seed)
    samples = []
    for i, (p, t) in enumerate(lens):
        mask = (rng.random(t) > 0.2).astype(np.float32)
        samples.append(PackSample(
            prompt_ids=rng.integers(0, V, p), response_ids=rng.integers(0, V, t),
            columns={"rollout_logprobs": np.log(rng.uniform(0.05, 0.9, t)).astype(np.float32),
                     "advantages": np.float32(rng.normal()), "loss_mask": mask}))
    batch = pack_samples(samples)
    logits = torch.randn(1, batch.total_len, V, generator=torch.Generator().manual_seed(seed))
    return batch, logits.requires_grad_()


def _reference_inputs(mbs, temp):
    """LossInputs over all microbatches concatenated, logprobs from plain log_softmax."""
    lp, ro, adv, mask, lens = [], [], [], [], []
    for batch, logits in mbs:
        ls = torch.log_softmax(logits[0] / temp, -1)
        lp.append(ls[batch.logit_positions, batch.targets])
        ro.append(batch.columns["rollout_logprobs"])
        adv.append(batch.columns["advantages"])
        mask.append(batch.columns["loss_mask"])
        lens.append(batch.response_lens)
    lens = torch.cat(lens)
    cu = torch.zeros(lens.numel() + 1, dtype=torch.long)
    cu[1:] = lens.cumsum(0)
    return LossInputs(logprobs=torch.cat(lp), rollout_logprobs=torch.cat(ro),
                      advantages=torch.cat(adv), loss_mask=torch.cat(mask), cu_seqlens=cu)


def _run(mbs, name, per_token, temp=1.0, config=None):
    from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                            calculate_per_token_loss=per_token)
    outs, nums, store = [], [], []
    for batch, logits in mbs:
        lf = make_loss_func(batch, name, config, temperature=temp, tp_group=None)
        out, num = forward_step_calc_loss(
            model=None, output_tensor=logits, loss_func=lf, config=cfg, vp_stage=None,
            collect_non_loss_data=False, num_microbatches=len(mbs), forward_data_store=store,
            cp_group_size=1, is_last_stage=True)
        outs.append(out)
        nums.append(num)
    return outs, nums, store


@pytest.mark.parametrize("name,config", [
    ("ppo_clip", None), ("grpo", {"kl_coef": 0.0}),
    # token-local fused losses: their micro-batch sums add up to the global batch too
    ("decoupled_ppo", {"ratio_mode": "bypass"}),
    ("decoupled_ppo", {"ratio_mode": "bypass", "aggregation": "seq_mean_token_mean"})])
def test_per_token_mode_equals_loss_over_the_whole_global_batch(name, config):
    mbs = [_microbatch(1, [(3, 5), (2, 4)]), _microbatch(2, [(4, 6), (1, 3), (2, 2)])]
    outs, nums, store = _run(mbs, name, per_token=True, temp=0.8, config=config)
    # Megatron (calculate_per_token_loss): sum the losses, scale grads by 1/sum(num_tokens)
    total = sum(outs) / sum(int(n) for n in nums)
    ref, _ = compute_loss(name, _reference_inputs(mbs, 0.8), config)
    torch.testing.assert_close(total, ref, atol=1e-5, rtol=1e-5)
    assert nums[0].dtype == torch.int
    if LOSSES[name].config(config).aggregation == "token_mean":  # n = active tokens
        assert [int(n) for n in nums] == [int(b.columns["loss_mask"].sum()) for b, _ in mbs]
    else:  # GRPO per-sequence mean: n = live sequences
        assert [int(n) for n in nums] == [2, 3]
    g = torch.autograd.grad(total, [lg for _, lg in mbs])
    g_ref = torch.autograd.grad(ref, [lg for _, lg in mbs])
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert set(store[0]) >= {"loss", "clipfrac", "num_active_tokens", "entropy_current"}
    assert all(v.shape == (2,) for v in store[0].values())
    # Megatron-LM reduces report values as sum(v[0]) / sum(v[1]): the weighted global loss
    rep = torch.stack([s["loss"] for s in store]).sum(0)
    torch.testing.assert_close(rep[0] / rep[1], ref.detach(), atol=1e-5, rtol=1e-5)


def test_legacy_mode_averages_each_microbatch_loss():
    mbs = [_microbatch(3, [(3, 5)]), _microbatch(4, [(2, 7), (3, 3)])]
    outs, nums, _ = _run(mbs, "ppo_clip", per_token=False)
    for (batch, logits), out in zip(mbs, outs):
        ref, _ = compute_loss("ppo_clip", _reference_inputs([(batch, logits)], 1.0))
        torch.testing.assert_close(out, ref / 2, atol=1e-6, rtol=1e-5)


def test_empty_microbatch_contributes_nothing():
    batch, logits = _microbatch(5, [(3, 4)])
    batch.columns["loss_mask"].zero_()
    out, num, _ = make_loss_func(batch, "ppo_clip", tp_group=None)(logits)
    assert int(num) == 0 and float(out.detach()) == 0.0


def test_non_loss_data_returns_logprobs_and_keeps_logits():
    batch, logits = _microbatch(6, [(2, 5), (4, 3)])
    before = logits.detach().clone()
    data = make_loss_func(batch, "ppo_clip", tp_group=None)(logits, non_loss_data=True)
    ls = torch.log_softmax(before[0], -1)
    torch.testing.assert_close(data["logprobs"], ls[batch.logit_positions, batch.targets])
    torch.testing.assert_close(data["entropy"], -(ls.exp() * ls).sum(-1)[batch.logit_positions])
    assert torch.equal(logits.detach(), before)


def test_refusals():
    batch, logits = _microbatch(7, [(2, 3)])
    with pytest.raises(ValueError, match="unknown loss"):
        make_loss_func(batch, "no_such_loss", tp_group=None)
    lf = make_loss_func(batch, "ppo_clip", tp_group=None)
    with pytest.raises(ValueError, match="gather context-parallel"):
        lf(logits[:, :-1])
    with pytest.raises(ValueError, match="not an integer"):
        make_loss_func(batch, "dr_grpo", {"constant_normalizer": 2.5}, tp_group=None)
    del batch.columns["advantages"]
    with pytest.raises(ValueError, match="advantages"):
        make_loss_func(batch, "ppo_clip", tp_group=None)(logits)


def _full_microbatch(seed):
    rng = np.random.default_rng(seed)
    samples = []
    for p, t in [(3, 6), (2, 5), (4, 7)]:
        ro = np.log(rng.uniform(0.05, 0.9, t)).astype(np.float32)
        samples.append(PackSample(
            prompt_ids=rng.integers(0, V, p), response_ids=rng.integers(0, V, t),
            columns={"rollout_logprobs": ro,
                     "old_logprobs": (ro + rng.normal(0, 0.1, t)).astype(np.float32),
                     "ref_logprobs": (ro + rng.normal(0, 0.1, t)).astype(np.float32),
                     "entropy": rng.uniform(0.1, 2.0, t).astype(np.float32),
                     "versions": rng.integers(7, 10, t).astype(np.int32),
                     "advantages": np.float32(rng.normal()),
                     "loss_mask": (rng.random(t) > 0.1).astype(np.float32)}))
    batch = pack_samples(samples)
    logits = torch.randn(1, batch.total_len, V, generator=torch.Generator().manual_seed(seed))
    return batch, logits.requires_grad_()


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_registered_loss_runs_through_the_adapter(name):
    from learner_client.megatron.loss import loss_inputs_from_batch

    batch, logits = _full_microbatch(8)
    loss, num, report = make_loss_func(batch, name, tp_group=None, learner_version=10)(logits)
    ls = torch.log_softmax(logits[0], -1)
    inputs = loss_inputs_from_batch(batch, ls[batch.logit_positions, batch.targets], 10)
    assert inputs.versions is not None and inputs.entropy is not None
    ref, metrics = compute_loss(name, inputs)
    assert int(num) >= 1 and torch.isfinite(loss)
    torch.testing.assert_close(loss / num, ref, atol=1e-5, rtol=1e-5)
    (g,) = torch.autograd.grad(loss, logits)
    assert torch.isfinite(g).all() and g.abs().sum() > 0
    assert all(torch.isfinite(v).all() and v.shape == (2,) for v in report.values())
