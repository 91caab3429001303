"""SAT / SAT-GSPO / ESTR: values vs loops and the properties stated in corrections.md."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from learner_client.corrections import LOSSES, LossInputs, compute_loss
from learner_client.corrections.sat import SATConfig, sat_factors


def _batch(n=400, seed=0, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    mu = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    d = torch.randn(n, generator=g, dtype=torch.float64) * scale
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, generator=g) > 0.1).to(torch.float64)
    return mu + d, mu, adv, mask


def _ref_eps(d, mask, el=0.2, eh=0.2, qq=0.9):
    act = np.abs(np.array([x for x, k in zip(d, mask) if k > 0]))
    q = float(np.quantile(act, qq))  # numpy's default is linear interpolation
    lo, hi = [], []
    for x in d:
        if q > 0 and abs(x) > q:
            cp = 1 / (1 + (max(x, 0) / q) ** 2)
            cm = 1 / (1 + (max(-x, 0) / q) ** 2)
        else:
            cp = cm = 1.0
        lo.append(el * cm)
        hi.append(eh * cp)
    return q, lo, hi


def test_sat_matches_loop():
    lp, mu, adv, mask = _batch()
    loss, m = compute_loss("sat", LossInputs(lp, mu, adv, mask))
    d = (lp - mu).tolist()
    q, lo, hi = _ref_eps(d, mask.tolist())
    tot = 0.0
    for x, a, k, el, eh in zip(d, adv.tolist(), mask.tolist(), lo, hi):
        r = math.exp(x)
        tot += -k * min(r * a, min(max(r, 1 - el), 1 + eh) * a)
    assert loss.item() == pytest.approx(tot / mask.sum().item(), rel=1e-10)
    assert m["sat_q"].item() == pytest.approx(q, rel=1e-12)
    gated = sum(k for x, k in zip(d, mask.tolist()) if abs(x) > q)
    assert m["gate_rate"].item() == pytest.approx(gated / mask.sum().item())


def test_sat_interval_inside_ppo_and_surrogate_not_above():
    lp, mu, adv, mask = _batch(seed=1, scale=0.08)
    inp = LossInputs(lp, mu, adv, mask)
    s_sat = -LOSSES["sat"].per_token(inp).loss
    s_ppo = -LOSSES["ppo_clip"].per_token(inp).loss
    assert torch.all(s_sat <= s_ppo + 1e-12)
    assert torch.any(s_sat < s_ppo - 1e-6)  # the contraction bites somewhere
    _, lo, hi = _ref_eps((lp - mu).tolist(), mask.tolist())
    assert all(0 < e <= 0.2 for e in lo + hi)


def test_sat_gradient_differs_only_on_outward_bands():
    lp, mu, adv, mask = _batch(seed=2, scale=0.08)
    grads = {}
    for name in ("sat", "ppo_clip"):
        x = lp.clone().requires_grad_()
        compute_loss(name, LossInputs(x, mu, adv, mask))[0].backward()
        grads[name] = x.grad
    d = (lp - mu).tolist()
    _, lo, hi = _ref_eps(d, mask.tolist())
    diff = ~torch.isclose(grads["sat"], grads["ppo_clip"], rtol=1e-12, atol=1e-15)
    n_band = 0
    for i, (x, a, k) in enumerate(zip(d, adv.tolist(), mask.tolist())):
        r = math.exp(x)
        band = k > 0 and ((a > 0 and 1 + hi[i] < r < 1 + 0.2) or
                          (a < 0 and 1 - 0.2 < r < 1 - lo[i]))
        n_band += band
        assert bool(diff[i]) == band, (i, x, a, lo[i], hi[i])
        if band:
            assert grads["sat"][i].item() == 0.0
    assert n_band > 0


def test_sat_c_jumps_from_one_to_half_at_q():
    # |d| on active tokens: 0.1 .. 1.0; 0.9-quantile of 10 values = 0.91 (linear interp)
    d = torch.tensor([0.1 * i for i in range(1, 11)] + [0.91, 0.91 + 1e-9, -(0.91 + 1e-9)],
                     dtype=torch.float64)
    mask = torch.tensor([1.0] * 10 + [0.0] * 3, dtype=torch.float64)
    c_minus, c_plus, q = sat_factors(d, mask, SATConfig())
    assert q.item() == pytest.approx(0.91)
    assert c_plus[10].item() == 1.0 and c_minus[10].item() == 1.0  # at q: no gate
    assert c_plus[11].item() == pytest.approx(0.5, abs=1e-8)  # just above: 0.5
    assert c_minus[11].item() == 1.0  # the other endpoint untouched
    assert c_minus[12].item() == pytest.approx(0.5, abs=1e-8) and c_plus[12].item() == 1.0


def test_sat_gspo_uses_broadcast_sequence_ratio():
    g = torch.Generator().manual_seed(3)
    lens = [3, 5, 2, 4, 6, 1, 3, 2, 4, 5]
    n = sum(lens)
    mu = -torch.rand(n, generator=g, dtype=torch.float64)
    lp = mu + torch.randn(n, generator=g, dtype=torch.float64) * 0.3
    seq_adv = torch.randn(len(lens), generator=g, dtype=torch.float64).tolist()
    adv = torch.tensor([a for a, L in zip(seq_adv, lens) for _ in range(L)], dtype=torch.float64)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]))
    mask = torch.ones(n, dtype=torch.float64)
    loss, _ = compute_loss("sat_gspo", LossInputs(lp, mu, adv, mask, cu_seqlens=cu))
    d = (lp - mu).tolist()
    seq_d, start = [], 0
    for L in lens:
        seq_d.append(sum(d[start:start + L]) / L)
        start += L
    tok_d = [sd for sd, L in zip(seq_d, lens) for _ in range(L)]  # broadcast before quantile
    _, lo, hi = _ref_eps(tok_d, [1.0] * n)
    tot, start = 0.0, 0
    for sd, a, L in zip(seq_d, seq_adv, lens):
        r = math.exp(sd)
        el, eh = lo[start], hi[start]
        tot += -min(r * a, min(max(r, 1 - el), 1 + eh) * a)
        start += L
    assert loss.item() == pytest.approx(tot / len(lens), rel=1e-10)


def test_estr_constant_entropy_equals_fixed_threshold_mask():
    lp, mu, adv, mask = _batch(seed=4, scale=0.4)
    h, tau, eps_h = 1.7, 0.05, 0.01
    ent = torch.full_like(lp, h)
    loss, m = compute_loss("estr", LossInputs(lp, mu, adv, mask, entropy=ent),
                           {"tau": tau, "target_mask_rate": None})
    thr = math.sqrt(tau * (h + eps_h))  # delta^2/(h+eps_h) <= tau  <=>  |delta| <= thr
    tot, masked = 0.0, 0
    for x, a, k in zip((lp - mu).tolist(), adv.tolist(), mask.tolist()):
        r = math.exp(x)
        keep = abs(x) <= thr
        masked += k * (not keep)
        tot += -k * keep * min(r * a, min(max(r, 0.8), 1.2) * a)
    assert loss.item() == pytest.approx(tot / mask.sum().item(), rel=1e-10)  # masked stay in denom
    assert m["mask_rate"].item() == pytest.approx(masked / mask.sum().item())
    assert 0 < masked < mask.sum().item()


def test_estr_entropy_scales_the_threshold():
    lp = torch.tensor([0.3, 0.3], dtype=torch.float64)
    mu = torch.zeros(2, dtype=torch.float64)
    ent = torch.tensor([0.05, 5.0], dtype=torch.float64)  # same delta, low vs high entropy
    _, m = compute_loss("estr", LossInputs(lp, mu, torch.ones(2, dtype=torch.float64),
                                           torch.ones(2), entropy=ent),
                        {"tau": 0.1, "target_mask_rate": None})
    assert m["mask_rate"].item() == pytest.approx(0.5)  # only the low-entropy token masked


def test_estr_target_mask_rate_and_missing_entropy():
    lp, mu, adv, mask = _batch(n=2000, seed=5)
    ent = torch.rand_like(lp) * 3
    ent[:50] = float("nan")
    _, m = compute_loss("estr", LossInputs(lp, mu, adv, mask, entropy=ent),
                        {"target_mask_rate": 0.1})
    assert m["mask_rate"].item() == pytest.approx(0.1 * (1 - m["entropy_missing_rate"].item()),
                                                  abs=0.01)
    assert m["entropy_missing_rate"].item() > 0
    x = lp.clone().requires_grad_()
    l2, _ = compute_loss("estr", LossInputs(x, mu, adv, mask, entropy=ent),
                         {"tau": 0.0, "target_mask_rate": None})
    l2.backward()
    # tau = 0 masks every token with nonzero delta, except the NaN-entropy ones
    assert torch.all(x.grad[50:][mask[50:] > 0] == 0)
    assert torch.any(x.grad[:50] != 0)


def test_estr_version_diagnostics():
    lp = torch.zeros(2, 3, dtype=torch.float64)
    ver = torch.tensor([[3, 4, 6], [5, 5, 5]])
    _, m = compute_loss("estr", LossInputs(lp, lp, lp, torch.ones(2, 3), entropy=lp + 1,
                                           versions=ver, learner_version=8))
    assert m["intra_mean"].item() == pytest.approx((3 + 0) / 2)
    assert m["inter_mean"].item() == pytest.approx((2 + 3) / 2)


def test_estr_config_needs_exactly_one_mode():
    cfg = LOSSES["estr"].config()
    assert cfg.tau == 1.0 and cfg.target_mask_rate is None  # the paper's fixed threshold
    assert LOSSES["estr"].config({"target_mask_rate": 0.02}).tau is None  # quantile mode
    with pytest.raises(ValueError):
        LOSSES["estr"].config({"tau": 0.1, "target_mask_rate": 0.02})
    with pytest.raises(ValueError):
        LOSSES["estr"].config({"tau": None})


@pytest.mark.parametrize("n,q", [(1000, 0.9), (200_000, 0.9), (200_000, 0.98), (70_001, 0.5)])
def test_masked_quantile_is_exact_vs_numpy(n, q):
    from learner_client.corrections.ops import masked_quantile

    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g).abs()
    x[::7] = 0.25  # ties
    mask = (torch.rand(n, generator=g) > 0.3).float()
    expect = np.quantile(x.numpy()[mask.numpy() > 0].astype(np.float64), q)
    assert masked_quantile(x, mask, q).item() == pytest.approx(expect, rel=1e-6)


def test_weighted_run_quantile_equals_token_quantile():
    from learner_client.corrections.ops import weighted_run_quantile

    vals = torch.tensor([0.5, 0.1, 0.9, 0.3, 0.7])
    counts = torch.tensor([3.0, 0.0, 2.0, 5.0, 1.0])
    tokens = np.repeat(vals.numpy(), counts.numpy().astype(int)).astype(np.float64)
    for q in (0.1, 0.5, 0.9, 0.95):
        assert weighted_run_quantile(vals, counts, q).item() == pytest.approx(
            np.quantile(tokens, q), rel=1e-6)
