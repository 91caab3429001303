"""GSPO (+token), TIS, MIS, IcePop vs independent loop computations."""

from __future__ import annotations

import math

import pytest
import torch

from learner_client.corrections import LossInputs, compute_loss


def _seqs(seed=0, spread=3e-4):
    g = torch.Generator().manual_seed(seed)
    lens = [4, 2, 3]
    n = sum(lens)
    mu = -torch.rand(n, generator=g, dtype=torch.float64) - 0.2
    old = mu + torch.randn(n, generator=g, dtype=torch.float64) * 0.3
    lp = old + torch.randn(n, generator=g, dtype=torch.float64) * spread
    seq_adv = [1.5, -0.7, 0.4]
    adv = torch.tensor([a for a, L in zip(seq_adv, lens) for _ in range(L)], dtype=torch.float64)
    cu = torch.tensor([0, 4, 6, 9])
    mask = torch.ones(n, dtype=torch.float64)
    mask[3] = 0  # last token of seq 0 inactive
    return lens, lp, mu, old, adv, cu, mask, seq_adv


def _clip_s(r, a, lo, hi):
    return min(r * a, min(max(r, 1 - lo), 1 + hi) * a)


def test_gspo_uses_length_normalized_sequence_ratio():
    lens, lp, mu, old, adv, cu, mask, seq_adv = _seqs(spread=5e-4)
    inp = LossInputs(lp, mu, adv, mask, old_logprobs=old, cu_seqlens=cu)
    loss, m = compute_loss("gspo", inp)
    total, start = 0.0, 0
    for L, a in zip(lens, seq_adv):
        ds = [lp[i].item() - old[i].item() for i in range(start, start + L) if mask[i] > 0]
        s_i = math.exp(sum(ds) / len(ds))  # geometric mean of the token ratios
        total += -_clip_s(s_i, a, 3e-4, 4e-4)
        start += L
    assert loss.item() == pytest.approx(total / len(lens), rel=1e-10)
    assert m["normalizer"].item() == 3 and m["num_sequences"].item() == 3


def test_gspo_token_value_equals_gspo_and_gradient_is_tokenwise():
    lens, lp, mu, old, adv, cu, mask, seq_adv = _seqs(spread=1e-5)  # inside the clip band
    x1 = lp.clone().requires_grad_()
    x2 = lp.clone().requires_grad_()
    l1, _ = compute_loss("gspo", LossInputs(x1, mu, adv, mask, old_logprobs=old, cu_seqlens=cu))
    l2, _ = compute_loss("gspo_token", LossInputs(x2, mu, adv, mask, old_logprobs=old,
                                                   cu_seqlens=cu))
    assert l1.item() == pytest.approx(l2.item(), rel=1e-12)
    l1.backward()
    l2.backward()
    # closed form: d loss / d lp_t = -(1/G) * (1/|y_i|) * s_i * A_i on active tokens
    start = 0
    for L, a in zip(lens, seq_adv):
        idx = [i for i in range(start, start + L) if mask[i] > 0]
        s_i = math.exp(sum(lp[i].item() - old[i].item() for i in idx) / len(idx))
        for i in idx:
            g = -(1 / 3) * (1 / len(idx)) * s_i * a
            assert x2.grad[i].item() == pytest.approx(g, rel=1e-9)
            assert x1.grad[i].item() == pytest.approx(g, rel=1e-9)  # constant A within seq
        start += L
    assert x2.grad[3].item() == 0.0


def test_tis_caps_weight_at_c():
    mu = torch.zeros(4, dtype=torch.float64)
    old = torch.log(torch.tensor([0.5, 1.0, 3.0, 10.0], dtype=torch.float64))
    lp = old.clone()  # r_s = 1: surrogate = A
    adv = torch.ones(4, dtype=torch.float64)
    loss, m = compute_loss("tis", LossInputs(lp, mu, adv, torch.ones(4), old_logprobs=old))
    assert loss.item() == pytest.approx(-(0.5 + 1.0 + 2.0 + 2.0) / 4)
    assert m["tis_capped_frac"].item() == pytest.approx(0.5)
    x = lp.clone().requires_grad_()
    compute_loss("tis", LossInputs(x, mu, adv, torch.ones(4), old_logprobs=old))[0].backward()
    assert torch.allclose(x.grad, -torch.tensor([0.5, 1.0, 2.0, 2.0], dtype=torch.float64) / 4)


def test_mis_token_rejects_and_rejected_leave_denominator():
    mu = torch.zeros(4, dtype=torch.float64)
    old = torch.log(torch.tensor([0.5, 1.5, 3.0, 1.0], dtype=torch.float64))
    lp = old.clone()
    adv = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    loss, m = compute_loss("mis", LossInputs(lp, mu, adv, torch.ones(4), old_logprobs=old))
    # rho = 3 > C=2 rejected; the rest weighted by rho; denominator 3 accepted tokens
    assert loss.item() == pytest.approx(-(0.5 * 1 + 1.5 * 2 + 1.0 * 4) / 3)
    assert m["mis_reject_rate"].item() == pytest.approx(0.25)
    assert m["num_denominator_tokens"].item() == 3
    two, _ = compute_loss("mis", LossInputs(lp, mu, adv, torch.ones(4), old_logprobs=old),
                          {"lower": 0.6})
    assert two.item() == pytest.approx(-(1.5 * 2 + 1.0 * 4) / 2)


def test_mis_veto_drops_whole_sequence():
    mu = torch.zeros(5, dtype=torch.float64)
    old = torch.log(torch.tensor([1.0, 1e-5, 1.0, 1.2, 0.8], dtype=torch.float64))
    lp = old.clone()
    adv = torch.ones(5, dtype=torch.float64)
    seq = torch.tensor([0, 0, 0, 1, 1])
    loss, m = compute_loss("mis", LossInputs(lp, mu, adv, torch.ones(5), old_logprobs=old,
                                             seq_ids=seq))
    assert loss.item() == pytest.approx(-(1.2 + 0.8) / 2)  # seq 0 vetoed by 1e-5 < 1e-4
    assert m["mis_veto_rate"].item() == pytest.approx(3 / 5)
    off, _ = compute_loss("mis", LossInputs(lp, mu, adv, torch.ones(5), old_logprobs=old,
                                            seq_ids=seq), {"veto_threshold": None})
    assert off.item() == pytest.approx(-(1.0 + 1e-5 + 1.0 + 1.2 + 0.8) / 5)


@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_mis_sequence_levels(level):
    mu = torch.zeros(5, dtype=torch.float64)
    rho = [1.5, 1.6, 0.9, 1.1, 1.3]
    old = torch.log(torch.tensor(rho, dtype=torch.float64))
    lp = old.clone()
    adv = torch.ones(5, dtype=torch.float64)
    seq = torch.tensor([0, 0, 1, 1, 1])
    loss, _ = compute_loss("mis", LossInputs(lp, mu, adv, torch.ones(5), old_logprobs=old,
                                             seq_ids=seq), {"level": level})
    if level == "sequence":
        w0, w1 = 1.5 * 1.6, 0.9 * 1.1 * 1.3  # 2.4 > 2 rejected; 1.287 kept
        expect = -(w1 * 3) / 3
    else:
        w0, w1 = math.sqrt(1.5 * 1.6), (0.9 * 1.1 * 1.3) ** (1 / 3)
        expect = -(w0 * 2 + w1 * 3) / 5
    assert loss.item() == pytest.approx(expect, rel=1e-10)


def test_icepop_band_mask():
    mu = torch.zeros(4, dtype=torch.float64)
    k = [0.4, 0.5, 5.0, 6.0]
    old = torch.log(torch.tensor(k, dtype=torch.float64))
    lp = old.clone()
    adv = torch.ones(4, dtype=torch.float64)
    loss, m = compute_loss("icepop", LossInputs(lp, mu, adv, torch.ones(4), old_logprobs=old))
    assert loss.item() == pytest.approx(-(0.5 + 5.0) / 4, rel=1e-9)
    assert m["mask_rate"].item() == pytest.approx(0.5)
    out, _ = compute_loss("icepop", LossInputs(lp, mu, adv, torch.ones(4), old_logprobs=old),
                          {"rejected_leave_denominator": True})
    assert out.item() == pytest.approx(-(0.5 + 5.0) / 2, rel=1e-9)
