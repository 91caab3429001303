"""ESTR's default, the revised PPO-EWMA, SAT's KL term and the staleness monitor's
estimated bound, each against a straightforward implementation of the formula
(corrections.md; plain loops/eager torch, no shared code with the library)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from learner_client.corrections import LossInputError, LossInputs, compute_loss
from learner_client.old_logits import RevisedPPOEWMA
from learner_client.staleness_monitor import StalenessMonitor, StalenessMonitorConfig


def _data(n=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    mu = -torch.rand(n, generator=g, dtype=torch.float64) * 2 - 0.05
    lp = mu + 0.4 * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, generator=g) > 0.2).to(torch.float64)
    ent = torch.rand(n, generator=g, dtype=torch.float64) * 2
    ent[:20] = 0.0  # confident positions: the entropy scaling matters there
    return lp, mu, adv, mask, ent


def _surrogate(r, a, lo, hi):
    return min(r * a, min(max(r, lo), hi) * a)


def _grad_of(fn, lp):
    x = lp.clone().requires_grad_(True)
    fn(x).backward()
    return x.grad


def test_estr_default_is_the_papers_fixed_threshold():
    lp, mu, adv, mask, ent = _data()

    def naive(x):
        tot = 0.0
        for t in range(x.numel()):
            if mask[t] == 0:
                continue
            delta = float(x[t] - mu[t])
            score = delta * delta / (float(ent[t]) + 0.01)
            if score <= 1.0:  # tau default 1.0
                r = torch.exp(x[t] - mu[t])
                a = float(adv[t])
                tot = tot - torch.minimum(r * a, torch.clamp(r, 0.8, 1.2) * a)
        return tot / mask.sum()

    x = lp.clone().requires_grad_(True)
    loss, m = compute_loss("estr", LossInputs(x, mu, adv, mask, entropy=ent))
    loss.backward()
    assert float(loss) == pytest.approx(float(naive(lp)), rel=1e-10)
    assert torch.allclose(x.grad, _grad_of(naive, lp), atol=1e-12)
    n_drop = sum(1 for t in range(lp.numel()) if mask[t] > 0 and
                 float(lp[t] - mu[t]) ** 2 / (float(ent[t]) + 0.01) > 1.0)
    assert 0 < n_drop and float(m["mask_rate"]) == pytest.approx(n_drop / float(mask.sum()))


def test_estr_refuses_or_warns_on_loose_topk_entropy():
    lp, mu, adv, mask, ent = _data(n=50)
    bound = torch.zeros_like(ent)
    inp = LossInputs(lp, mu, adv, mask, entropy=ent, entropy_error_bound=bound)
    _, m = compute_loss("estr", inp, {"on_inexact_entropy": "raise"})  # exact: fine
    assert float(m["entropy_inexact_rate"]) == 0.0
    bound = torch.full_like(ent, 0.05)  # 0.05 > 0.1 * (H + 0.01) where H < 0.49
    inp = LossInputs(lp, mu, adv, mask, entropy=ent, entropy_error_bound=bound)
    with pytest.raises(LossInputError, match="top-k estimate"):
        compute_loss("estr", inp, {"on_inexact_entropy": "raise"})
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _, m = compute_loss("estr", inp)  # default: warn
    assert any("top-k estimate" in str(x.message) for x in w)
    want = float(((bound > 0.1 * (ent + 0.01)) & (mask > 0)).sum() / mask.sum())
    assert float(m["entropy_inexact_rate"]) == pytest.approx(want) and want > 0


def test_ppo_ewma_revised_matches_the_formula():
    lp, mu, adv, mask, _ = _data(seed=3)
    g = torch.Generator().manual_seed(9)
    prox = mu + 0.5 * torch.randn(mu.shape, generator=g, dtype=torch.float64)
    c = 2.0

    def naive(x):
        tot = 0.0
        for t in range(x.numel()):
            if mask[t] == 0:
                continue
            r_d = math.exp(float(prox[t] - mu[t]))
            w = r_d if 1.0 / c <= r_d <= c else 0.0
            r_s = torch.exp(x[t] - prox[t])
            a = float(adv[t])
            tot = tot - w * torch.minimum(r_s * a, torch.clamp(r_s, 0.8, 1.2) * a)
        return tot / mask.sum()

    x = lp.clone().requires_grad_(True)
    versions = torch.randint(3, 7, lp.shape, generator=g)
    loss, m = compute_loss("ppo_ewma_revised",
                           LossInputs(x, mu, adv, mask, old_logprobs=prox, versions=versions,
                                      learner_version=8))
    loss.backward()
    assert float(loss) == pytest.approx(float(naive(lp)), rel=1e-10)
    assert torch.allclose(x.grad, _grad_of(naive, lp), atol=1e-12)
    # active fraction = kept by the r_d mask and not clipped, over active tokens
    kept = 0
    for t in range(lp.numel()):
        if mask[t] == 0:
            continue
        r_d = math.exp(float(prox[t] - mu[t]))
        r_s = math.exp(float(lp[t] - prox[t]))
        a = float(adv[t])
        is_clipped = min(max(r_s, 0.8), 1.2) * a < r_s * a
        if 1 / c <= r_d <= c and not is_clipped:
            kept += 1
    frac = kept / float(mask.sum())
    assert float(m["active_token_fraction"]) == pytest.approx(frac)
    assert float(m["ewma_reset"]) == float(frac < 0.9)
    act_v = versions[mask > 0]
    assert float(m["ewma_window"]) == 8 - int(act_v.min()) + 1
    assert float(m["ewma_beta"]) == pytest.approx(m["ewma_window"] / (m["ewma_window"] + 2))


class _Tiny(torch.nn.Module):
    """logits = W[x]: a per-token softmax policy over a small vocabulary."""

    def __init__(self, vocab=7):
        super().__init__()
        self.W = torch.nn.Parameter(torch.zeros(vocab, vocab, dtype=torch.float64))


def _logprobs(weights, ctx, tgt):
    return torch.log_softmax(weights["W"][ctx], -1).gather(-1, tgt[:, None])[:, 0]


def test_revised_ppo_ewma_driver_wires_ewma_window_and_reset():
    g = torch.Generator().manual_seed(4)
    n, vocab = 64, 7
    ctx = torch.randint(0, vocab, (n,), generator=g)
    tgt = torch.randint(0, vocab, (n,), generator=g)
    model = _Tiny(vocab)
    thetas = [{"W": 0.3 * torch.randn(vocab, vocab, generator=g, dtype=torch.float64)}
              for _ in range(4)]

    def run(weights, idx):
        return _logprobs(weights, ctx[idx], tgt[idx]).detach()

    ew = RevisedPPOEWMA(run, thetas[0], config={"reset_threshold": 0.0}, dtype=None)
    history = [thetas[0]]
    versions = torch.full((n,), 5)
    versions[:8] = 3  # S = 2 at learner version 5: W_stale = 3, beta = 3/5
    for th in thetas[1:]:
        with torch.no_grad():
            model.W.copy_(th["W"])
        lp = _logprobs({"W": model.W}, ctx, tgt)
        mu = lp.detach() - 0.05
        inp = LossInputs(lp, mu, torch.randn(n, generator=g, dtype=torch.float64),
                         torch.ones(n, dtype=torch.float64), versions=versions,
                         learner_version=5)
        loss, m = ew.loss(inp)
        assert ew.window == 3 and ew.tracker.beta == pytest.approx(0.6)
        # pi_prox = the policy under the debiased EWMA of the weights seen so far
        beta = 0.6
        wts = [beta ** (len(history) - 1 - k) for k in range(len(history))]
        w_ewma = sum(w * h["W"] for w, h in zip(wts, history)) / sum(wts)
        prox = _logprobs({"W": w_ewma}, ctx, tgt)
        r_d = torch.exp(prox - mu)
        keep = (r_d >= 0.5) & (r_d <= 2.0)
        r_s = torch.exp(lp.detach() - prox)
        a = inp.advantages
        naive = -(torch.where(keep, r_d, 0.0) *
                  torch.minimum(r_s * a, torch.clamp(r_s, 0.8, 1.2) * a)).mean()
        assert float(loss) == pytest.approx(float(naive), rel=1e-9)
        assert not ew.after_step(th, m)  # threshold 0: never resets
        history.append(th)
    # the reset rule: a fraction below the threshold sets theta_prox <- theta
    ew.tracker.reset_threshold = 0.9
    assert ew.after_step(thetas[1], {"active_token_fraction": torch.tensor(0.5)})
    assert torch.equal(ew.tracker.weights["W"], thetas[1]["W"])


def _naive_sat(x, mu, adv, mask, q_level=0.9, el=0.2, eh=0.2):
    d = (x - mu)
    d_sg = d.detach()
    act = mask > 0
    q = float(torch.quantile(d_sg[act].abs(), q_level))  # linear interpolation
    tot = 0.0
    for t in range(x.numel()):
        if not act[t]:
            continue
        u = float(d_sg[t])
        cp = cm = 1.0
        if q > 0 and abs(u) > q:
            cp = 1.0 / (1.0 + (max(u, 0.0) / q) ** 2)
            cm = 1.0 / (1.0 + (max(-u, 0.0) / q) ** 2)
        r = torch.exp(d[t])
        a = float(adv[t])
        tot = tot - torch.minimum(r * a, torch.clamp(r, 1 - el * cm, 1 + eh * cp) * a)
    return tot


def test_sat_kl_term_matches_the_formula():
    lp, mu, adv, mask, _ = _data(seed=6)
    g = torch.Generator().manual_seed(2)
    ref = mu + 0.3 * torch.randn(mu.shape, generator=g, dtype=torch.float64)
    beta = 0.04

    def naive(x):
        k3 = torch.exp(ref - x) - (ref - x) - 1.0
        return (_naive_sat(x, mu, adv, mask) + beta * (k3 * mask).sum()) / mask.sum()

    x = lp.clone().requires_grad_(True)
    loss, m = compute_loss("sat", LossInputs(x, mu, adv, mask, ref_logprobs=ref),
                           {"kl_coef": beta})
    loss.backward()
    assert float(loss) == pytest.approx(float(naive(lp)), rel=1e-10)
    assert torch.allclose(x.grad, _grad_of(naive, lp), atol=1e-12)
    with pytest.raises(LossInputError, match="ref_logprobs"):
        compute_loss("sat", LossInputs(lp, mu, adv, mask), {"kl_coef": beta})


def test_sat_gspo_kl_term_is_aggregated_like_gspo():
    lp, mu, adv, mask, _ = _data(n=40, seed=7)
    ref = mu + 0.1
    cu = torch.tensor([0, 10, 25, 40])
    base, _ = compute_loss("sat_gspo", LossInputs(lp, mu, adv, mask, cu_seqlens=cu,
                                                  ref_logprobs=ref))
    with_kl, _ = compute_loss("sat_gspo", LossInputs(lp, mu, adv, mask, cu_seqlens=cu,
                                                     ref_logprobs=ref), {"kl_coef": 0.1})
    k3 = torch.exp(ref - lp) - (ref - lp) - 1.0
    per_seq = [float((k3 * mask)[a:b].sum() / mask[a:b].sum()) for a, b in
               zip(cu[:-1].tolist(), cu[1:].tolist())]
    assert float(with_kl - base) == pytest.approx(0.1 * np.mean(per_seq), rel=1e-9)


def test_monitor_estimates_the_bound_constants_from_the_run():
    """A run where the batch's mean |log-ratio| is exactly kappa x the parameter drift
    behind its tokens and the mean |log pi - log pi_ref| is kappa_ref x the cumulative
    drift: the monitor recovers kappa, kappa_ref, R_batch, R_crit, G_upd and the bound."""
    kappa, kappa_ref = 0.7, 0.3
    mon = StalenessMonitor(StalenessMonitorConfig(clip_eps=0.2, crit_log_ratio=1.0))
    rng = np.random.default_rng(0)
    drift = [0.0]  # cumulative drift D_t, kept independently
    lr = 1e-2
    norms = []
    rep = None
    for t in range(1, 30):
        v_learn = t + 5  # versions stay >= 0 (-1 is the no-version sentinel)
        lags = rng.integers(0, 4, 50)
        versions = torch.tensor(v_learn - lags)
        # the drift behind each token: D_now - D_{now - lag}
        x = float(np.mean([drift[-1] - drift[max(len(drift) - 1 - int(lg), 0)]
                           for lg in lags]))
        sign = torch.tensor(rng.choice([-1.0, 1.0], 50))
        log_ratio = torch.full((50,), kappa * x, dtype=torch.float64) * sign
        ref_log_ratio = torch.full((50,), kappa_ref * drift[-1], dtype=torch.float64) * sign
        norm = float(rng.uniform(1.0, 3.0))
        norms.append(norm)
        rep = mon.step(lr, versions, v_learn, update_norm=norm, log_ratio=log_ratio,
                       ref_log_ratio=ref_log_ratio)
        drift.append(drift[-1] + lr * norm)
        assert rep.batch_drift == pytest.approx(x)
    assert rep.kappa == pytest.approx(kappa, rel=1e-9)
    assert rep.kappa_ref == pytest.approx(kappa_ref, rel=1e-9)
    g = max(norms)
    r_batch = math.log(1.2) / kappa
    r_crit = 1.0 / kappa_ref
    assert rep.g_upd == pytest.approx(g)
    assert rep.r_batch == pytest.approx(r_batch) and rep.r_crit == pytest.approx(r_crit)
    s = rep.max_lag
    assert rep.eta_bound == pytest.approx(min(r_batch / (s * g), r_crit / (29 * g)))
    assert rep.lr_over_bound == pytest.approx(lr / rep.eta_bound)
    # configured constants win over the estimates
    mon2 = StalenessMonitor(StalenessMonitorConfig(g_upd=2.0, r_batch=0.5))
    r2 = mon2.step(lr, torch.tensor([3, 4]), 5, update_norm=9.0)
    assert r2.g_upd == 2.0 and r2.eta_bound == pytest.approx(0.5 / (2 * 2.0))
