"""The fused backend of every registered loss (``spec.fused``, ``backend="fused"``) against
its readable reference (``spec.reference``, the default) over every option, aggregation,
layout and mask pattern (all active, none active, fully masked sequences, NaN/inf at masked
positions, missing entropy, a log-ratio past the e^20 clamp on an active token): same loss,
same metrics (every key), same gradient w.r.t. logprobs. Plus float64 gradchecks of the
fused nodes, the capped quantile selection and the per-batch version bounds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from learner_client.corrections import LOSSES, LossInputs, compute_loss
from learner_client.corrections.base import aggregate
from learner_client.corrections.estr import version_spread
from learner_client.corrections.ops import quantile_and_tail

CASES: list[tuple[str, dict]] = [
    ("ppo_clip", {}),
    ("ppo_clip", {"dual_clip": 3.0}),
    ("grpo", {}),
    ("grpo", {"kl_coef": 0.0}),
    ("grpo", {"dual_clip": 2.0}),
    ("dr_grpo", {}),
    ("dapo", {}),
    ("gspo", {}),
    ("gspo", {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": 3.0}),
    ("gspo_token", {}),
    ("gspo_token", {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": 3.0}),
    ("tis", {}),
    ("tis", {"dual_clip": 3.0}),
    ("mis", {}),
    ("mis", {"level": "sequence", "lower": 0.5}),
    ("mis", {"level": "geometric", "dual_clip": 3.0}),
    ("mis", {"veto_threshold": None}),
    ("icepop", {}),
    ("icepop", {"rejected_leave_denominator": True, "dual_clip": 3.0}),
    ("ppo_ewma", {}),
    ("ppo_ewma", {"dual_clip": 3.0}),
    ("ppo_ewma", {"imp_samp_max": None}),
    ("ppo_ewma_revised", {}),
    ("ppo_ewma_revised", {"dual_clip": 2.0, "discrepancy_c": 1.2}),
    ("sat_gspo", {}),
    ("sat_gspo", {"kl_coef": 0.1, "dual_clip": 3.0, "quantile": 0.5}),
    ("sat", {}),
    ("sat", {"dual_clip": 3.0}),
    ("sat", {"kl_coef": 0.1}),
    ("sat", {"quantile": 0.5, "kernel_power": 1.0, "eps_high": 0.28}),
    ("estr", {}),
    ("estr", {"tau": 0.05, "target_mask_rate": None}),
    ("estr", {"tau": 0.05, "target_mask_rate": None, "dual_clip": 2.0}),
    ("estr", {"target_mask_rate": 0.1}),
    ("estr", {"tau": math.inf, "target_mask_rate": None}),
    ("estr", {"version_diagnostics": False}),
    ("decoupled_ppo", {}),
    ("decoupled_ppo", {"behav_imp_weight_cap": 1.5}),
    ("decoupled_ppo", {"discrepancy": "mask"}),
    ("decoupled_ppo", {"discrepancy": "truncate"}),
    ("decoupled_ppo", {"discrepancy": "none"}),
    ("decoupled_ppo", {"ratio_mode": "ppo"}),
    ("decoupled_ppo", {"ratio_mode": "bypass"}),
    ("decoupled_ppo", {"ratio_mode": "loglinear"}),
    ("decoupled_ppo", {"ratio_mode": "linear_prox"}),
    ("decoupled_ppo", {"ratio_mode": "linear_prox", "prox_mix": 0.3}),
    ("decoupled_ppo", {"dual_clip": 2.0}),
]
_IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in c.items()) or 'default'}" for n, c in CASES]
AGGREGATIONS = ["token_mean", "seq_mean_token_mean", "constant"]
MASKS = ["random", "all", "empty", "poisoned", "missing_entropy", "masked_rows", "wild_ratio"]


def test_every_registered_loss_is_compared():
    assert {name for name, _ in CASES} == set(LOSSES)


def _columns(mask_kind: str, padded: bool, seed: int = 0, dtype=torch.float64
             ) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    lens = [37, 1, 64, 20, 0, 50] if not padded else [37, 1, 64, 20, 50]
    width = max(lens)
    shape = (len(lens), width) if padded else (sum(lens),)
    n = int(np.prod(shape))
    mu = -np.abs(rng.normal(1.0, 0.7, n))
    old = mu + rng.normal(0.0, 0.3, n)
    cols = {
        "rollout_logprobs": mu,
        "old_logprobs": old,
        "logprobs": old + rng.normal(0.0, 0.3, n),
        "ref_logprobs": mu + rng.normal(0.0, 0.2, n),
        "advantages": rng.normal(0.0, 1.0, n),
        "entropy": np.abs(rng.normal(0.3, 0.5, n)),
    }
    out: dict[str, object] = {k: torch.tensor(v, dtype=dtype).reshape(shape)
                              for k, v in cols.items()}
    active = rng.random(n) > 0.3
    if mask_kind == "all":
        active[:] = True
    elif mask_kind == "empty":
        active[:] = False
    if padded:
        active &= (np.arange(width)[None, :] < np.array(lens)[:, None]).reshape(-1)
    if mask_kind == "poisoned":  # NaN / inf at inactive positions must change nothing
        for k, bad in (("logprobs", math.nan), ("rollout_logprobs", -math.inf),
                       ("old_logprobs", math.nan), ("advantages", math.inf),
                       ("entropy", math.nan), ("ref_logprobs", math.nan)):
            t = out[k].reshape(-1)
            t[np.flatnonzero(~active)[::3]] = bad
    if mask_kind == "missing_entropy":  # NaN entropy on active tokens: never masked
        out["entropy"].reshape(-1)[np.flatnonzero(active)[::11]] = math.nan
    if mask_kind == "masked_rows":  # whole sequences without an active token
        starts = np.concatenate([[0], np.cumsum(lens)])
        for i in (0, 2):
            lo, hi = (i * width, i * width + lens[i]) if padded else (starts[i], starts[i + 1])
            active[lo:hi] = False
    if mask_kind == "wild_ratio":  # active tokens whose |log-ratios| pass the e^20 clamp
        idx = np.flatnonzero(active)[::13]
        for k, shift in (("rollout_logprobs", -30.0), ("old_logprobs", -25.0)):
            out[k].reshape(-1)[idx] = out["logprobs"].reshape(-1)[idx] + shift
        out["ref_logprobs"].reshape(-1)[idx[::2]] += 25.0
    out["loss_mask"] = torch.tensor(active, dtype=torch.bool).reshape(shape)
    out["versions"] = torch.tensor(rng.integers(-1, 9, n)).reshape(shape)
    if not padded:
        out["cu_seqlens"] = torch.tensor(np.concatenate([[0], np.cumsum(lens)]))
    out["learner_version"] = 9
    return out


def _run(fn, spec, cols, cfg):
    x = cols["logprobs"].clone().requires_grad_()
    inp = LossInputs(**{**cols, "logprobs": x})
    c = spec.config(cfg)
    loss, metrics = aggregate(fn(inp, c), inp, c)
    loss.backward()
    return loss.detach(), x.grad, metrics


@pytest.mark.parametrize(("name", "cfg"), CASES, ids=_IDS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_fused_equals_reference_every_option(name, cfg, aggregation):
    spec = LOSSES[name]
    for padded in (False, True):
        for mask_kind in MASKS:
            cols = _columns(mask_kind, padded)
            c = {**cfg, "aggregation": aggregation}
            (la, ga, ma) = _run(spec.fused, spec, cols, c)
            (lb, gb, mb) = _run(spec.reference, spec, cols, c)
            where = f"{name} {c} padded={padded} mask={mask_kind}"
            assert torch.isfinite(la), where
            assert la.item() == pytest.approx(lb.item(), rel=1e-10, abs=1e-13), where
            assert torch.allclose(ga, gb, rtol=1e-10, atol=1e-13), where
            assert set(ma) == set(mb), where
            for k in ma:
                assert ma[k].item() == pytest.approx(mb[k].item(), rel=1e-9, abs=1e-12), (
                    where, k)
            if mask_kind == "empty":
                assert la.item() == 0.0 and not ga.any(), where


@pytest.mark.parametrize(("name", "cfg"), [
    ("sat", {}), ("sat", {"dual_clip": 3.0}), ("estr", {}),
    ("estr", {"tau": 0.02, "target_mask_rate": None}), ("estr", {"target_mask_rate": 0.05}),
    ("decoupled_ppo", {"behav_imp_weight_cap": 1.5}), ("decoupled_ppo", {"discrepancy": "mask"}),
])
def test_fused_equals_reference_large_batch(name, cfg):
    """Above 65536 tokens the CPU selections bracket the rank from a sample first."""
    rng = np.random.default_rng(17)
    n, seq = 150_000, 1000
    mu = torch.tensor(-np.abs(rng.normal(1.0, 0.7, n)))
    old = mu + torch.tensor(rng.normal(0.0, 0.2, n))
    cols = {"logprobs": old + torch.tensor(rng.normal(0.0, 0.1, n)), "rollout_logprobs": mu,
            "old_logprobs": old, "advantages": torch.tensor(rng.normal(0.0, 1.0, n)),
            "loss_mask": torch.tensor(rng.random(n) > 0.05),
            "entropy": torch.tensor(np.abs(rng.normal(0.5, 0.5, n))),
            "versions": torch.tensor(rng.integers(5, 9, n), dtype=torch.int32),
            "cu_seqlens": torch.arange(0, n + 1, seq), "learner_version": 9}
    spec = LOSSES[name]
    (la, ga, ma), (lb, gb, mb) = (_run(spec.fused, spec, cols, cfg),
                                  _run(spec.reference, spec, cols, cfg))
    assert la.item() == pytest.approx(lb.item(), rel=1e-10)
    assert torch.allclose(ga, gb, rtol=1e-10, atol=1e-15)
    assert set(ma) == set(mb)
    for k in ma:
        assert ma[k].item() == pytest.approx(mb[k].item(), rel=1e-9, abs=1e-12), k


@pytest.mark.parametrize(("name", "cfg"), [
    ("sat", {"dual_clip": 3.0}),
    ("sat", {"kl_coef": 0.1, "aggregation": "seq_mean_token_mean"}),
    ("estr", {"target_mask_rate": 0.2}),
    ("estr", {"tau": 0.05, "target_mask_rate": None, "aggregation": "constant"}),
    ("decoupled_ppo", {"discrepancy": "mask", "discrepancy_c": 1.2}),
    ("decoupled_ppo", {"discrepancy": "truncate", "discrepancy_c": 1.2}),
    ("decoupled_ppo", {"ratio_mode": "ppo", "aggregation": "seq_mean_token_mean"}),
])
def test_gradcheck_fused_losses(name, cfg):
    """(loglinear / linear_prox build pi_prox from sg[log pi]: finite differences would
    move the anchor, so they are covered by the reference comparison instead.)"""
    g = torch.Generator().manual_seed(21)
    n = 48
    mu = -torch.rand(n, generator=g, dtype=torch.float64) * 2
    old = mu + 0.15 * torch.randn(n, generator=g, dtype=torch.float64)
    lp = old + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    if name == "sat":  # q moves with x (stop-gradient): keep tail tokens off the clip
        adv = -adv.abs() * torch.sign(lp - mu)
    mask = torch.rand(n, generator=g) > 0.2
    ent = torch.rand(n, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, 10, 30, 48])

    def f(x):
        inp = LossInputs(x, mu, adv, mask, old_logprobs=old, ref_logprobs=mu - 0.1,
                         entropy=ent, versions=torch.arange(n) % 4, cu_seqlens=cu,
                         learner_version=4)
        return compute_loss(name, inp, {**cfg, "backend": "fused"})[0]

    assert torch.autograd.gradcheck(f, (lp.clone().requires_grad_(),), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("q", [0.5, 0.9, 0.99])
@pytest.mark.parametrize("n", [5000, 200_000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_quantile_and_tail_cap_equals_clamped(q, n, dtype):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g, dtype=dtype) * 15).abs()
    x[::5] = 20.0
    x[::97] = math.inf
    mask = (torch.rand(n, generator=g) > 0.1).to(dtype)
    xm = torch.where(mask > 0, x, 0.0)  # inactive entries 0 (x * mask: inf * 0 = NaN)
    cnt = int(mask.sum())
    qv, tail = quantile_and_tail(xm, cnt, q, cap=20.0)
    qr, tr = quantile_and_tail(xm.clamp(max=20.0), cnt, q)
    assert qv.item() == qr.item()
    assert torch.equal(tail, tr)
    qv, tail = quantile_and_tail(xm.to(torch.bfloat16), cnt, q, cap=20.0)  # torch path
    qr, tr = quantile_and_tail(xm.to(torch.bfloat16).clamp(max=20.0), cnt, q)
    assert qv.item() == qr.item() and torch.equal(tail, tr)


def test_quantile_and_tail_cap_above_quantile_gives_empty_tail():
    x = torch.full((100_000,), 30.0)
    x[:10] = 1.0
    qv, tail = quantile_and_tail(x, 100_000, 0.9, cap=20.0)
    assert qv.item() == 20.0 and tail.numel() == 0


def _loop_bounds(ver, act, spans):
    firsts, lasts = [], []
    for s, e in spans:
        vs = [int(ver[i]) for i in range(s, e) if act[i]]
        if vs:
            firsts.append(min(vs))
            lasts.append(max(vs))
    return firsts, lasts


@pytest.mark.parametrize("layout", ["cu_seqlens", "seq_ids", "padded"])
@pytest.mark.parametrize("mask_kind", ["random", "all", "empty"])
@pytest.mark.parametrize(("vdtype", "vrange"), [
    (torch.int32, (-1, 30)), (torch.int64, (-1, 30)), (torch.float32, (-1, 30)),
    (torch.int32, (250, 255 + 250)),  # a window of exactly 255 versions: the uint8 lags
    (torch.int64, (-1, 1000)),  # wider: the float path
    (torch.int64, (2**30, 2**30 + 1000))])  # beyond float32's integers: the float64 redo
def test_seq_version_bounds_match_a_loop(layout, mask_kind, vdtype, vrange):
    rng = np.random.default_rng(3)
    lens = [4, 0, 3, 5, 2, 0, 6] if layout != "padded" else [4, 3, 5, 2, 6]
    if layout == "padded":
        b, t = len(lens), max(lens)
        spans = [(i * t, i * t + n) for i, n in enumerate(lens)]
        n = b * t
    else:
        cu = np.concatenate([[0], np.cumsum(lens)])
        spans = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
        n = int(cu[-1])
    ver = rng.integers(*vrange, n)
    ver[0], ver[-1] = vrange[0], vrange[1] - 1  # the whole window occurs
    act = rng.random(n) > 0.3
    if mask_kind == "all":
        act[:] = True
    elif mask_kind == "empty":
        act[:] = False
    if layout == "padded":
        pad = np.ones(n, dtype=bool)
        for s, e in spans:
            pad[s:e] = False
        act &= ~pad
    shape = (len(lens), max(lens)) if layout == "padded" else (n,)
    x = torch.zeros(shape)
    kw: dict[str, object] = {}
    if layout == "cu_seqlens":
        kw["cu_seqlens"] = torch.tensor(cu)
    elif layout == "seq_ids":
        kw["seq_ids"] = torch.tensor(np.repeat(np.arange(len(lens)), lens))
    lv = vrange[1] + 3
    inp = LossInputs(x, x, x, torch.tensor(act).reshape(shape).float(),
                     versions=torch.tensor(ver).to(vdtype).reshape(shape), learner_version=lv,
                     **kw)
    firsts, lasts = _loop_bounds(ver, act, spans)
    first, last = inp.seq_version_bounds
    assert first.tolist() == firsts and last.tolist() == lasts
    assert inp.seq_version_bounds is inp.seq_version_bounds  # computed once per batch
    got = version_spread(inp)
    if not firsts:
        assert got == {}
        return
    assert got["intra_mean"].item() == pytest.approx(
        sum(b - a for a, b in zip(firsts, lasts)) / len(firsts))
    assert got["inter_mean"].item() == pytest.approx(lv - sum(lasts) / len(lasts))


@pytest.mark.parametrize("mdtype", [torch.bool, torch.int64, torch.float32, torch.float64])
def test_active_is_mask_above_zero(mdtype):
    m = torch.tensor([1, 0, 1, 1, 0], dtype=mdtype)
    x = torch.zeros(5)
    act = LossInputs(x, x, x, m).active
    assert act.dtype == torch.bool and act.tolist() == [True, False, True, True, False]
    w = torch.tensor([0.5, -1.0, math.nan, 0.0, 2.0])  # weights, a NaN entry: inactive
    assert LossInputs(x, x, x, w).active.tolist() == [True, False, False, False, True]
