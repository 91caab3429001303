"""PPO-family losses and the aggregation rules vs straightforward loop computations."""

from __future__ import annotations

import math

import pytest
import torch

from learner_client.corrections import LOSSES, LossInputError, LossInputs, compute_loss


def _data(b=3, t=5, seed=0, spread=0.4, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    mu = -torch.rand(b, t, generator=g, dtype=dtype) * 2 - 0.1
    lp = mu + torch.randn(b, t, generator=g, dtype=dtype) * spread
    old = mu + torch.randn(b, t, generator=g, dtype=dtype) * spread / 2
    adv = torch.randn(b, t, generator=g, dtype=dtype)
    mask = torch.ones(b, t, dtype=dtype)
    mask[0, -2:] = 0
    mask[-1, -1] = 0
    return lp, mu, old, adv, mask


def _ref_ppo_terms(lp, old, adv, el, eh):
    out = []
    for x, o, a in zip(lp.flatten().tolist(), old.flatten().tolist(), adv.flatten().tolist()):
        r = math.exp(x - o)
        c = min(max(r, 1 - el), 1 + eh)
        out.append(-min(r * a, c * a))
    return out


def test_ppo_clip_matches_loop_token_mean():
    lp, mu, old, adv, mask = _data()
    inp = LossInputs(logprobs=lp, rollout_logprobs=mu, old_logprobs=old, advantages=adv,
                     loss_mask=mask)
    loss, m = compute_loss("ppo_clip", inp)
    terms = _ref_ppo_terms(lp, old, adv, 0.2, 0.2)
    mk = mask.flatten().tolist()
    expect = sum(t * k for t, k in zip(terms, mk)) / sum(mk)
    assert loss.item() == pytest.approx(expect, rel=1e-10)
    assert m["normalizer"].item() == sum(mk) == m["num_active_tokens"].item()
    # clipfrac: fraction of active tokens where the clipped branch is the min
    n_clip = 0
    for x, o, a, k in zip(lp.flatten().tolist(), old.flatten().tolist(),
                          adv.flatten().tolist(), mk):
        r = math.exp(x - o)
        c = min(max(r, 0.8), 1.2)
        n_clip += k * (c * a < r * a)
    assert m["clipfrac"].item() == pytest.approx(n_clip / sum(mk))


def test_ppo_without_old_uses_behavior():
    lp, mu, _, adv, mask = _data(seed=1)
    a, _ = compute_loss("ppo_clip", LossInputs(lp, mu, adv, mask))
    b, _ = compute_loss("ppo_clip", LossInputs(lp, mu, adv, mask, old_logprobs=mu.clone()))
    assert a.item() == pytest.approx(b.item(), rel=1e-12)


def test_dual_clip_caps_negative_advantage_loss():
    lp = torch.tensor([2.0, 2.0, 0.0], dtype=torch.float64)  # r = e^2 ~ 7.39
    mu = torch.zeros(3, dtype=torch.float64)
    adv = torch.tensor([-1.0, 1.0, -1.0], dtype=torch.float64)
    inp = LossInputs(lp, mu, adv, torch.ones(3))
    loss, m = compute_loss("ppo_clip", inp, {"dual_clip": 3.0})
    # token0: -S = max(r*1, 0.8... ) -> -min(-7.39, -1.2) = 7.39 -> capped at 3; token1: -1.2
    # token2: r=1 -> 1
    assert loss.item() == pytest.approx((3.0 - 1.2 + 1.0) / 3)
    assert m["dual_clipfrac"].item() == pytest.approx(1 / 3)


def test_dapo_clip_higher_defaults():
    cfg = LOSSES["dapo"].config_cls()
    assert (cfg.eps_low, cfg.eps_high, cfg.aggregation) == (0.2, 0.28, "token_mean")
    lp = torch.tensor([math.log(1.25)], dtype=torch.float64)
    inp = LossInputs(lp, torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64),
                     torch.ones(1))
    assert compute_loss("dapo", inp)[0].item() == pytest.approx(-1.25)  # inside 1.28
    assert compute_loss("ppo_clip", inp)[0].item() == pytest.approx(-1.2)  # clipped at 1.2


def test_grpo_seq_mean_token_mean_and_k3():
    lp, mu, old, adv, mask = _data(seed=2)
    ref = mu + 0.3
    inp = LossInputs(lp, mu, adv, mask, old_logprobs=old, ref_logprobs=ref)
    loss, m = compute_loss("grpo", inp)
    terms = _ref_ppo_terms(lp, old, adv, 0.2, 0.2)
    b, t = lp.shape
    per_seq = []
    for i in range(b):
        s, n = 0.0, 0.0
        for j in range(t):
            k = mask[i, j].item()
            d = ref[i, j].item() - lp[i, j].item()
            kl = math.exp(d) - d - 1
            s += k * (terms[i * t + j] + 0.04 * kl)
            n += k
        per_seq.append(s / n)
    assert loss.item() == pytest.approx(sum(per_seq) / b, rel=1e-10)
    assert m["normalizer"].item() == b
    with pytest.raises(LossInputError, match="ref_logprobs"):
        compute_loss("grpo", LossInputs(lp, mu, adv, mask))
    no_kl, _ = compute_loss("grpo", LossInputs(lp, mu, adv, mask, old_logprobs=old),
                            {"kl_coef": 0.0})
    assert no_kl.item() < loss.item()  # k3 >= 0 adds a positive term


def test_dr_grpo_constant_normalizer():
    lp, mu, old, adv, mask = _data(seed=3)
    inp = LossInputs(lp, mu, adv, mask, old_logprobs=old)
    loss, m = compute_loss("dr_grpo", inp)
    terms = _ref_ppo_terms(lp, old, adv, 0.2, 0.2)
    s = sum(t * k for t, k in zip(terms, mask.flatten().tolist()))
    assert loss.item() == pytest.approx(s / lp.numel(), rel=1e-10)  # G * L_max slots
    assert m["normalizer"].item() == lp.numel()
    loss2, m2 = compute_loss("dr_grpo", inp, {"constant_normalizer": 100.0})
    assert loss2.item() == pytest.approx(s / 100.0, rel=1e-10)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_masked_tokens_leave_denominators(name):
    """Changing any input at masked positions changes neither loss nor gradient."""
    lp, mu, old, adv, mask = _data(seed=4, spread=0.1)
    ent = torch.rand_like(lp) + 0.5
    ver = torch.tensor([[1, 1, 2, 2, 2], [0, 1, 1, 1, 2], [2, 2, 2, 2, 2]])

    def run(lp_, mu_, old_, adv_, ent_):
        x = lp_.clone().requires_grad_()
        inp = LossInputs(x, mu_, adv_, mask, old_logprobs=old_, ref_logprobs=mu_ - 0.1,
                         entropy=ent_, versions=ver, learner_version=3)
        cfg = {"tau": 0.5, "target_mask_rate": None} if name == "estr" else None
        loss, m = compute_loss(name, inp, cfg)
        loss.backward()
        return loss.detach(), x.grad, m

    a, ga, ma = run(lp, mu, old, adv, ent)
    junk = (mask == 0)
    noisy = [t.masked_fill(junk, v) for t, v in
             ((lp, -9.0), (mu, -0.01), (old, -5.0), (adv, 50.0), (ent, 1e-3))]
    b, gb, mb = run(*noisy)
    assert a.item() == pytest.approx(b.item(), rel=1e-9, abs=1e-12)
    assert torch.allclose(ga[~junk], gb[~junk], rtol=1e-9, atol=1e-12)
    assert torch.all(gb[junk] == 0)
    assert ma["num_active_tokens"].item() == mask.sum().item()


# gspo_token's value is sg[s_i]-based on purpose (its gradient is not the derivative of its
# value), so it is checked against the closed-form gradient in test_corrections_sequence.py.
@pytest.mark.parametrize("backend", ["reference", "fused"])
@pytest.mark.parametrize("name", sorted(set(LOSSES) - {"gspo_token"}))
def test_gradcheck_float64(name, backend):
    lp, mu, old, adv, mask = _data(b=2, t=4, seed=5, spread=0.05)
    ent = torch.rand_like(lp) + 0.5
    cfg = {"tau": 10.0, "target_mask_rate": None} if name == "estr" else {}
    cfg["backend"] = backend

    def f(x):
        inp = LossInputs(x, mu, adv, mask, old_logprobs=old, ref_logprobs=mu - 0.1,
                         entropy=ent, versions=torch.tensor([[1, 2, 2, 2], [0, 1, 2, 2]]),
                         learner_version=3)
        return compute_loss(name, inp, cfg)[0]

    assert torch.autograd.gradcheck(f, (lp.clone().requires_grad_(),), eps=1e-6, atol=1e-6)


def test_flat_layout_with_seq_ids_equals_padded():
    lp, mu, old, adv, mask = _data(seed=6)
    keep = mask.flatten() > 0
    seq = torch.arange(3).repeat_interleave(5)[keep]
    flat = [t.flatten()[keep] for t in (lp, mu, old, adv, mask)]
    cu = torch.tensor([0, 3, 8, 12])
    for name in ("grpo", "gspo", "sat_gspo", "mis"):
        cfg = {"kl_coef": 0.0} if name == "grpo" else ({"level": "geometric"}
                                                        if name == "mis" else None)
        p = compute_loss(name, LossInputs(lp, mu, adv, mask, old_logprobs=old), cfg)[0]
        s = compute_loss(name, LossInputs(flat[0], flat[1], flat[3], flat[4],
                                          old_logprobs=flat[2], seq_ids=seq * 7), cfg)[0]
        c = compute_loss(name, LossInputs(flat[0], flat[1], flat[3], flat[4],
                                          old_logprobs=flat[2], cu_seqlens=cu), cfg)[0]
        assert p.item() == pytest.approx(s.item(), rel=1e-10), name
        assert p.item() == pytest.approx(c.item(), rel=1e-10), name


def test_bad_inputs_raise_clear_errors():
    x = torch.zeros(4)
    with pytest.raises(LossInputError, match="shape"):
        LossInputs(x, torch.zeros(3), x, x)
    with pytest.raises(LossInputError, match="cu_seqlens"):
        LossInputs(x, x, x, x, cu_seqlens=torch.tensor([0, 2, 3]))
    with pytest.raises(LossInputError, match="sequence boundaries"):
        compute_loss("gspo", LossInputs(x, x, x, torch.ones(4)))
    with pytest.raises(LossInputError, match="unknown loss"):
        compute_loss("nope", LossInputs(x, x, x, torch.ones(4)))
    with pytest.raises(LossInputError, match="old_logprobs"):
        compute_loss("tis", LossInputs(x, x, x, torch.ones(4)))
    with pytest.raises(ValueError):
        compute_loss("ppo_clip", LossInputs(x, x, x, torch.ones(4)), {"eps_low": 2.0})


def test_registry_is_complete_and_exposes_aggregation():
    want = {"ppo_clip", "grpo", "dr_grpo", "dapo", "gspo", "gspo_token", "tis", "mis", "icepop",
            "decoupled_ppo", "sat", "sat_gspo", "estr", "ppo_ewma"}
    assert want <= set(LOSSES)
    aggs = {n: LOSSES[n].aggregation for n in want}
    assert aggs["dr_grpo"] == "constant" and aggs["grpo"] == "seq_mean_token_mean"
    assert aggs["gspo"] == "seq_mean_token_mean" and aggs["sat"] == "token_mean"


def test_all_masked_batch_gives_zero_loss_not_nan():
    x = torch.zeros(2, 3, requires_grad=True)
    inp = LossInputs(x, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3),
                     old_logprobs=torch.zeros(2, 3), entropy=torch.ones(2, 3))
    for name in ("ppo_clip", "grpo", "gspo", "sat", "estr", "mis", "decoupled_ppo"):
        cfg = {"kl_coef": 0.0} if name == "grpo" else None
        loss, _ = compute_loss(name, inp, cfg)
        assert loss.item() == 0.0 and not torch.isnan(loss)


@pytest.mark.parametrize("name", ["ppo_clip", "grpo", "dr_grpo", "gspo", "mis"])
def test_parts_sum_across_microbatches_to_the_global_aggregate(name):
    """numerator/denominator pairs of two micro-batches add up to the loss of their union."""
    lp, mu, old, adv, mask = _data(b=4, t=5, seed=8)
    cfg = {"kl_coef": 0.0} if name == "grpo" else None
    spec = LOSSES[name]
    whole = LossInputs(lp, mu, adv, mask, old_logprobs=old)
    halves = [LossInputs(lp[i:i + 2], mu[i:i + 2], adv[i:i + 2], mask[i:i + 2],
                         old_logprobs=old[i:i + 2]) for i in (0, 2)]
    num = sum(spec.parts(h, cfg)[0] for h in halves)
    den = sum(spec.parts(h, cfg)[1] for h in halves)
    loss, m = spec.fn(whole, cfg)
    assert (num / den).item() == pytest.approx(loss.item(), rel=1e-10)
    assert m["normalizer"].item() == pytest.approx(den.item())
