"""Decoupled PPO (AReaL form, r_d x r_s modes, proximal policies) and PPO-EWMA."""

from __future__ import annotations

import math

import pytest
import torch

from learner_client.corrections import LossInputError, LossInputs, compute_loss
from learner_client.corrections.decoupled import version_alpha


def _data(n=60, seed=0, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    mu = -torch.rand(n, generator=g, dtype=torch.float64) * 2
    old = mu + torch.randn(n, generator=g, dtype=torch.float64) * spread * 3
    lp = old + torch.randn(n, generator=g, dtype=torch.float64) * spread
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, generator=g) > 0.2).to(torch.float64)
    return lp, mu, old, adv, mask


def _grad(name, inp_kwargs, cfg=None):
    x = inp_kwargs.pop("logprobs").clone().requires_grad_()
    loss, m = compute_loss(name, LossInputs(logprobs=x, **inp_kwargs), cfg)
    loss.backward()
    return loss.detach(), x.grad, m


def test_decoupled_with_old_equal_behavior_reduces_to_ppo():
    lp, mu, _, adv, mask = _data()
    a, ga, _ = _grad("decoupled_ppo", dict(logprobs=lp, rollout_logprobs=mu, advantages=adv,
                                           loss_mask=mask, old_logprobs=mu.clone()))
    b, gb, _ = _grad("ppo_clip", dict(logprobs=lp, rollout_logprobs=mu, advantages=adv,
                                      loss_mask=mask))
    assert a.item() == pytest.approx(b.item(), rel=1e-12)
    assert torch.allclose(ga, gb, rtol=1e-12, atol=0)


def test_decoupled_areal_form_matches_loop():
    lp, mu, old, adv, mask = _data(seed=1)
    loss, m = compute_loss("decoupled_ppo", LossInputs(lp, mu, adv, mask, old_logprobs=old),
                           {"dual_clip": 3.0})
    tot, capped = 0.0, 0
    for x, o, b, a, k in zip(lp.tolist(), old.tolist(), mu.tolist(), adv.tolist(),
                             mask.tolist()):
        u = math.exp(x - o)
        pg = max(-a * u, -a * min(max(u, 0.8), 1.2))
        if a < 0:
            pg = min(pg, 3.0 * abs(a))
        w = math.exp(o - b)
        if w > 5.0:
            w = 0.0
            capped += k
        tot += k * w * pg
    assert loss.item() == pytest.approx(tot / mask.sum().item(), rel=1e-10)
    assert m["behav_mask_rate"].item() == pytest.approx(capped / mask.sum().item())
    assert capped > 0  # the cap was exercised


def test_ratio_decomposition_product_is_total_ratio():
    lp, mu, old, adv, mask = _data(seed=2, spread=0.1)
    cfg = {"eps_low": 0.999, "eps_high": 1e6, "discrepancy": "truncate", "discrepancy_c": 1e6}
    loss, _ = compute_loss("decoupled_ppo", LossInputs(lp, mu, adv, mask, old_logprobs=old), cfg)
    expect = -sum(k * a * math.exp(x - b) for x, b, a, k in
                  zip(lp.tolist(), mu.tolist(), adv.tolist(), mask.tolist()))
    assert loss.item() == pytest.approx(expect / mask.sum().item(), rel=1e-10)


def test_ratio_modes_ppo_and_bypass():
    lp, mu, old, adv, mask = _data(seed=3)
    kw = dict(logprobs=lp, rollout_logprobs=mu, advantages=adv, loss_mask=mask,
              old_logprobs=old)
    ppo_mode, g1, _ = _grad("decoupled_ppo", dict(kw), {"ratio_mode": "ppo"})
    ppo, g2, _ = _grad("ppo_clip", dict(kw))
    assert ppo_mode.item() == pytest.approx(ppo.item(), rel=1e-12) and torch.allclose(g1, g2)
    byp, g3, _ = _grad("decoupled_ppo", dict(kw), {"ratio_mode": "bypass"})
    kw.pop("old_logprobs")
    ref, g4, _ = _grad("ppo_clip", kw)  # r = pi / mu
    assert byp.item() == pytest.approx(ref.item(), rel=1e-12) and torch.allclose(g3, g4)


def test_version_alpha_matches_areal_rule():
    v = torch.tensor([4, 3, 1, 5, 6, -1])
    alpha = version_alpha(v, 5).tolist()
    assert alpha == pytest.approx([0.0, 0.5, 0.75, 0.0, 0.0, 0.0])


def test_loglinear_proximal_loss_and_gradient():
    lp = torch.tensor([-1.0, -0.5, -2.0, -0.3], dtype=torch.float64)
    mu = torch.tensor([-1.1, -0.6, -1.7, -0.2], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=torch.float64)
    ver = torch.tensor([4, 3, 1, 5])
    alpha = [0.0, 0.5, 0.75, 0.0]
    loss, g, m = _grad("decoupled_ppo", dict(logprobs=lp, rollout_logprobs=mu, advantages=adv,
                                             loss_mask=torch.ones(4), versions=ver,
                                             learner_version=5), {"ratio_mode": "loglinear"})
    tot, grads = 0.0, []
    for x, b, a, al in zip(lp.tolist(), mu.tolist(), adv.tolist(), alpha):
        prox = b + al * (x - b)
        rs, rd = math.exp(x - prox), math.exp(prox - b)
        w = rd if rd <= 5 else 0.0
        un, cl = rs * a, min(max(rs, 0.8), 1.2) * a
        tot += -w * min(un, cl)
        grads.append(-w * rs * a / 4 if un <= cl else 0.0)  # prox detached
    assert loss.item() == pytest.approx(tot / 4, rel=1e-12)
    assert g.tolist() == pytest.approx(grads, rel=1e-10)
    assert m["alpha_mean"].item() == pytest.approx(sum(alpha) / 4)
    with pytest.raises(LossInputError, match="versions"):
        compute_loss("decoupled_ppo", LossInputs(lp, mu, adv, torch.ones(4)),
                     {"ratio_mode": "loglinear"})


def test_linear_prox_fixed_mix():
    lp = torch.tensor([-1.0, -0.2], dtype=torch.float64)
    mu = torch.tensor([-1.3, -0.25], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, _ = compute_loss("decoupled_ppo", LossInputs(lp, mu, adv, torch.ones(2)),
                           {"ratio_mode": "linear_prox", "prox_mix": 0.3})
    tot = 0.0
    for x, b, a in zip(lp.tolist(), mu.tolist(), adv.tolist()):
        prox = 0.3 * math.exp(b) + 0.7 * math.exp(x)
        r = math.exp(x) / prox  # r_d = 1
        tot += -min(r * a, min(max(r, 0.8), 1.2) * a)
    assert loss.item() == pytest.approx(tot / 2, rel=1e-12)


@pytest.mark.parametrize("rule", ["mask", "truncate"])
def test_symmetric_discrepancy_rules(rule):
    mu = torch.zeros(3, dtype=torch.float64)
    rd = [0.4, 1.5, 3.0]
    old = torch.log(torch.tensor(rd, dtype=torch.float64))
    lp = old.clone()  # r_s = 1
    adv = torch.ones(3, dtype=torch.float64)
    loss, _ = compute_loss("decoupled_ppo", LossInputs(lp, mu, adv, torch.ones(3),
                                                       old_logprobs=old),
                           {"discrepancy": rule, "discrepancy_c": 2.0})
    w = [0.0, 1.5, 0.0] if rule == "mask" else [0.5, 1.5, 2.0]
    assert loss.item() == pytest.approx(-sum(w) / 3, rel=1e-12)


def test_ppo_ewma_matches_hilton_formula():
    lp, mu, prox, adv, mask = _data(seed=4, spread=0.2)
    lp = lp.clone()
    lp[0] = mu[0] + 6.0  # pi/mu = e^6 > 100: the total-ratio cap binds
    mask[0] = 1.0
    loss, m = compute_loss("ppo_ewma", LossInputs(lp, mu, adv, mask, old_logprobs=prox))
    tot = 0.0
    for x, b, p, a, k in zip(lp.tolist(), mu.tolist(), prox.tolist(), adv.tolist(),
                             mask.tolist()):
        b_adj = max(b, x - math.log(100.0))
        pg1 = -a * math.exp(x - b_adj)
        lr = min(max(x - p, math.log(0.8)), math.log(1.2))
        pg2 = -a * math.exp(lr + p - b_adj)
        tot += k * max(pg1, pg2)
    assert loss.item() == pytest.approx(tot / mask.sum().item(), rel=1e-10)
    assert m["imp_samp_clipfrac"].item() > 0
    assert 0.0 <= m["active_token_fraction"].item() <= 1.0
