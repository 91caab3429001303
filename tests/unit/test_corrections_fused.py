"""Fused kernels (one autograd node per loss, ``backend="fused"``) against the readable
reference losses, autograd gradchecks of the custom Function, and the numpy selection /
segment helpers."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from learner_client.corrections import LOSSES, LossInputs, compute_loss
from learner_client.corrections.estr import version_spread
from learner_client.corrections.fused.kernel import (
    clip_free_bound,
    fused_ppo,
    fused_token_loss,
    ppo_surrogate,
)
from learner_client.corrections.ops import (
    above_mask,
    compress,
    flatnonzero,
    mask_indices,
    nonzero_indices,
    quantile_and_tail,
)


def _batch(n=600, seed=0, scale=0.3, dtype=torch.float64, p_mask=0.1):
    g = torch.Generator().manual_seed(seed)
    mu = -torch.rand(n, generator=g, dtype=dtype) * 3
    old = mu + torch.randn(n, generator=g, dtype=dtype) * scale
    lp = old + torch.randn(n, generator=g, dtype=dtype) * scale
    adv = torch.randn(n, generator=g, dtype=dtype)
    mask = (torch.rand(n, generator=g) > p_mask).to(dtype)
    ent = torch.rand(n, generator=g, dtype=dtype) * 3
    return lp, mu, old, adv, mask, ent


def _run(fn, inp_kw, cfg):
    x = inp_kw["logprobs"].clone().requires_grad_()
    inp = LossInputs(**{**inp_kw, "logprobs": x})
    spec_cfg = fn[1].config(cfg)
    tok = fn[0](inp, spec_cfg)
    from learner_client.corrections.base import aggregate
    loss, metrics = aggregate(tok, inp, spec_cfg)
    loss.backward()
    return loss.detach(), x.grad, metrics


def _assert_same(a, b, rel=1e-10):
    (la, ga, ma), (lb, gb, mb) = a, b
    assert la.item() == pytest.approx(lb.item(), rel=rel, abs=1e-14)
    assert torch.allclose(ga, gb, rtol=rel, atol=1e-14)
    assert set(ma) == set(mb)
    for k in ma:
        assert ma[k].item() == pytest.approx(mb[k].item(), rel=1e-8, abs=1e-12), k


@pytest.mark.parametrize("seed,scale", [(0, 0.3), (1, 0.05), (2, 1.5)])
def test_sat_fused_equals_eager(seed, scale):
    lp, mu, _, adv, mask, _ = _batch(seed=seed, scale=scale)
    kw = dict(logprobs=lp, rollout_logprobs=mu, advantages=adv, loss_mask=mask)
    spec = LOSSES["sat"]
    _assert_same(_run((spec.fused, spec), kw, None), _run((spec.reference, spec), kw, None))


def test_sat_fused_zero_quantile_is_ppo():
    lp, mu, _, adv, mask, _ = _batch(seed=3)
    mu = lp.clone()
    mu[:5] -= 0.5  # 5 tokens off-policy, q of |d| is 0: no gate
    kw = dict(logprobs=lp, rollout_logprobs=mu, advantages=adv, loss_mask=mask)
    a = compute_loss("sat", LossInputs(**kw))
    b = compute_loss("ppo_clip", LossInputs(**kw))
    assert a[0].item() == pytest.approx(b[0].item(), rel=1e-12)
    assert a[1]["gate_rate"].item() == 0.0 and a[1]["sat_q"].item() == 0.0


SAT_TAIL_CASES = [{}, {"dual_clip": 1.1}, {"dual_clip": 3.0}, {"kernel_power": 1.0},
                  {"eps_low": 0.1, "eps_high": 0.28}, {"quantile": 0.5},
                  {"kl_coef": 0.1, "aggregation": "seq_mean_token_mean"}]


def _sat_tail_batch(n, dtype, seed=0, scale=0.03, wild=False, zero_q=False):
    """Log-ratios small enough for SAT's tail-only clipping (q below clip_free_bound)."""
    lp, mu, _, adv, mask, _ = _batch(n=n, seed=seed, scale=scale, dtype=dtype, p_mask=0.1)
    lp = lp.clone()
    if zero_q:  # q = 0: the tail is every active token with d != 0, no contraction
        lp = mu.clone()
        lp[::23] += 0.3
    if wild:  # active and inactive tokens past the e^20 ratio clamp
        lp[::37] += 25.0
        lp[5::41] -= 30.0
    seq = torch.arange(n) // 100
    return {"logprobs": lp, "rollout_logprobs": mu, "advantages": adv, "loss_mask": mask,
            "seq_ids": seq, "ref_logprobs": mu - 0.01}


@pytest.mark.parametrize("cfg", SAT_TAIL_CASES)
@pytest.mark.parametrize("n,dtype", [(600, torch.float64), (600, torch.float32),
                                     (150_000, torch.float32)])
@pytest.mark.parametrize("kind", ["plain", "wild", "zero_q"])
def test_sat_tail_only_clipping_equals_dense_kernel(monkeypatch, cfg, n, dtype, kind):
    """The tail-only form (q <= clip_free_bound: clipping computed on the tail only, the
    gradient given as the loss with zeros) gives the dense kernel's loss, gradient and
    metrics bit for bit, and equals the reference."""
    fused_sat = importlib.import_module("learner_client.corrections.fused.sat")
    monkeypatch.setattr(fused_sat, "TAIL_ONLY_MIN_TOKENS", 0)  # small batches too
    calls = []
    real = fused_sat.ppo_on_subset
    monkeypatch.setattr(fused_sat, "ppo_on_subset",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    kw = _sat_tail_batch(n, dtype, wild=kind == "wild", zero_q=kind == "zero_q")
    spec = LOSSES["sat"]
    tail = _run((spec.fused, spec), kw, cfg)
    assert calls  # the tail-only form ran
    q = tail[2]["sat_q"].item()
    c = spec.config(cfg)
    assert q <= clip_free_bound(c.eps_low, c.eps_high, c.dual_clip)  # the tail-only form ran
    assert (q == 0.0) == (kind == "zero_q")
    assert tail[2]["clipfrac"].item() > 0  # some tail tokens on the clipped branch
    if "dual_clip" in cfg and kind == "wild":
        assert tail[2]["dual_clipfrac"].item() > 0
    monkeypatch.setattr(fused_sat, "TAIL_ONLY_CLIP", False)
    dense = _run((spec.fused, spec), kw, cfg)
    assert len(calls) == 1
    assert torch.equal(tail[0], dense[0]) and torch.equal(tail[1], dense[1])
    assert set(tail[2]) == set(dense[2])
    for k in tail[2]:
        assert torch.equal(tail[2][k], dense[2][k]), k
    if dtype == torch.float64:
        _assert_same(tail, _run((spec.reference, spec), kw, cfg))


ESTR_SPARSE_CASES = [{}, {"dual_clip": 1.1}, {"eps_low": 0.1, "eps_high": 0.28},
                     {"tau": 0.5}, {"tau": math.inf},
                     {"dual_clip": 3.0, "aggregation": "seq_mean_token_mean"}]


@pytest.mark.parametrize("cfg", ESTR_SPARSE_CASES)
@pytest.mark.parametrize("n,dtype", [(3000, torch.float64), (3000, torch.float32),
                                     (150_000, torch.float32)])
@pytest.mark.parametrize("kind", ["plain", "wild", "missing"])
def test_estr_sparse_form_equals_dense_kernel(monkeypatch, cfg, n, dtype, kind):
    """ESTR's sparse form (fixed tau, H >= 0: score, mask and clip on S = {|d| > bound}
    only) gives the dense kernel's loss, gradient and metrics bit for bit (approx_kl up
    to summation order), and equals the reference."""
    fused_estr = importlib.import_module("learner_client.corrections.fused.estr")
    monkeypatch.setattr(fused_estr, "SPARSE_MIN_TOKENS", 0)  # small batches too
    kw = _sat_tail_batch(n, dtype, wild=kind == "wild")
    g = torch.Generator().manual_seed(3)
    kw["entropy"] = torch.rand(n, generator=g, dtype=dtype) * 0.05  # low H: some masked
    act = torch.nonzero(kw["loss_mask"] > 0).reshape(-1)
    sign = torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0).to(dtype)
    lp, mu, h = kw["logprobs"], kw["rollout_logprobs"], kw["entropy"]
    lp[act[::29]] = mu[act[::29]] + 0.3 * sign[act[::29]]  # clipped, not masked (high H)
    h[act[::29]] = 0.5
    lp[act[7::31]] = mu[act[7::31]] + 0.15 * sign[act[7::31]]  # masked (low H)
    h[act[7::31]] = 0.001
    if kind == "missing":  # NaN entropy on active tokens (never masked)
        kw["entropy"][act[::17]] = math.nan
    if kind == "wild":  # a -inf behavior logprob on an active token: always masked
        kw["rollout_logprobs"][act[3]] = -math.inf
    inact = torch.nonzero(kw["loss_mask"] == 0).reshape(-1)
    h[inact[::2]] = -1.0  # garbage under the mask: negative, and -eps_h (score 0/0)
    h[inact[1::2]] = -0.01
    h[act[11::97]] = -0.01  # an active H of -eps_h: score +inf, masked
    spec = LOSSES["estr"]
    calls = []
    real = fused_estr.ppo_on_subset
    monkeypatch.setattr(fused_estr, "ppo_on_subset",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    sparse = _run((spec.fused, spec), kw, cfg)
    assert calls  # the sparse form ran
    assert sparse[2]["clipfrac"].item() > 0
    assert sparse[2]["mask_rate"].item() > 0  # (with tau = inf: the +inf scores)
    monkeypatch.setattr(fused_estr, "SPARSE_CLIP", False)
    dense = _run((spec.fused, spec), kw, cfg)
    assert len(calls) == 1
    assert torch.equal(sparse[0], dense[0]) and torch.equal(sparse[1], dense[1])
    assert set(sparse[2]) == set(dense[2])
    for k in sparse[2]:
        assert torch.equal(sparse[2][k], dense[2][k]), k
    if dtype == torch.float64:
        _assert_same(sparse, _run((spec.reference, spec), kw, cfg))


def test_estr_sparse_form_not_taken_when_it_does_not_apply(monkeypatch):
    """A per-batch tau, most tokens beyond the clip bound, or fewer tokens than
    SPARSE_MIN_TOKENS: the dense kernel (same results either way); negative entropy does
    not matter (the score is the dense one)."""
    fused_estr = importlib.import_module("learner_client.corrections.fused.estr")
    monkeypatch.setattr(fused_estr, "SPARSE_MIN_TOKENS", 0)
    kw = _sat_tail_batch(3000, torch.float64)
    kw["entropy"] = torch.rand(3000, dtype=torch.float64) * 0.05
    calls = []
    real = fused_estr.ppo_on_subset
    monkeypatch.setattr(fused_estr, "ppo_on_subset",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    spec = LOSSES["estr"]
    neg = dict(kw, entropy=kw["entropy"] - 0.001)
    wide = dict(kw, logprobs=kw["logprobs"] + 0.5 * torch.randn(3000, dtype=torch.float64))
    for inp, cfg in ((kw, {"target_mask_rate": 0.05}), (wide, {})):
        _assert_same(_run((spec.fused, spec), inp, cfg), _run((spec.reference, spec), inp, cfg))
    assert not calls
    _assert_same(_run((spec.fused, spec), neg, {}), _run((spec.reference, spec), neg, {}))
    assert len(calls) == 1
    monkeypatch.setattr(fused_estr, "SPARSE_MIN_TOKENS", 3001)
    _run((spec.fused, spec), neg, {})
    assert len(calls) == 1


@pytest.mark.parametrize("cfg", [{"tau": 0.05, "target_mask_rate": None},
                                 {"tau": 0.0, "target_mask_rate": None},
                                 {"target_mask_rate": 0.02}, {"target_mask_rate": 0.3}])
@pytest.mark.parametrize("missing", [False, True])
def test_estr_fused_equals_eager(cfg, missing):
    lp, mu, _, adv, mask, ent = _batch(seed=4, scale=0.3)
    if missing:
        ent[::17] = float("nan")
    seq = torch.arange(lp.numel()) // 50
    kw = dict(logprobs=lp, rollout_logprobs=mu, advantages=adv, loss_mask=mask, entropy=ent,
              versions=seq % 5, seq_ids=seq, learner_version=7)
    spec = LOSSES["estr"]
    _assert_same(_run((spec.fused, spec), kw, cfg), _run((spec.reference, spec), kw, cfg))


@pytest.mark.parametrize("cfg", [{}, {"discrepancy": "mask"}, {"discrepancy": "truncate"},
                                 {"discrepancy": "none"}, {"ratio_mode": "loglinear"},
                                 {"ratio_mode": "bypass"}, {"ratio_mode": "linear_prox"},
                                 {"behav_imp_weight_cap": 1.5}])
def test_decoupled_fused_equals_eager(cfg):
    lp, mu, old, adv, mask, _ = _batch(seed=5, scale=0.5)  # some r_d beyond the caps
    ver = torch.randint(0, 6, lp.shape, generator=torch.Generator().manual_seed(1))
    kw = dict(logprobs=lp, rollout_logprobs=mu, old_logprobs=old, advantages=adv,
              loss_mask=mask, versions=ver, learner_version=6)
    spec = LOSSES["decoupled_ppo"]
    got = _run((spec.fused, spec), kw, cfg)
    _assert_same(got, _run((spec.reference, spec), kw, cfg))
    if cfg.get("behav_imp_weight_cap") == 1.5:
        assert 0 < got[2]["behav_mask_rate"].item() < 1


def _fused_ppo_fn(adv, mask, weight=None, dual=None):
    def f(x):
        base = torch.zeros_like(x)
        pg, _ = fused_ppo(x, base, adv, mask, mask.sum(), 0.8, 1.2, weight=weight,
                          dual_clip=dual)
        return (pg * torch.linspace(0.5, 1.5, x.numel(), dtype=x.dtype)).sum()
    return f


@pytest.mark.parametrize("variant", ["plain", "weight", "dual"])
def test_gradcheck_fused_ppo_function(variant):
    g = torch.Generator().manual_seed(6)
    n = 40
    # log-ratios spread over inside / outside the clip interval, away from the kinks
    x = torch.linspace(-0.6, 0.6, n, dtype=torch.float64) + 0.0123
    x = x[torch.randperm(n, generator=g)]
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, generator=g) > 0.2).to(torch.float64)
    weight = mask * torch.rand(n, generator=g, dtype=torch.float64) if variant == "weight" else None
    f = _fused_ppo_fn(adv, mask, weight, 1.5 if variant == "dual" else None)
    assert torch.autograd.gradcheck(f, (x.clone().requires_grad_(),), eps=1e-6, atol=1e-6)


def test_gradcheck_fused_function_with_sat_and_estr_kernels():
    lp, mu, _, adv, mask, ent = _batch(n=30, seed=7, scale=0.2)
    # SAT's q moves with x under finite differences (it is stop-gradient by definition):
    # advantages of the opposite sign to d keep the tail tokens off the clipped branch, so
    # the loss does not depend on q and the numerical Jacobian is the true one.
    adv_sat = -adv.abs() * torch.sign(lp - mu)
    for name, cfg in (("sat", None), ("estr", {"tau": 0.02, "target_mask_rate": None}),
                      ("decoupled_ppo", {"behav_imp_weight_cap": 1.3})):
        old = mu + 0.1 * torch.randn(30, generator=torch.Generator().manual_seed(8),
                                     dtype=torch.float64)

        def f(x, name=name, cfg=cfg, old=old):
            a = adv_sat if name == "sat" else adv
            return compute_loss(name, LossInputs(x, mu, a, mask, entropy=ent,
                                                 old_logprobs=old),
                                {**(cfg or {}), "backend": "fused"})[0]

        assert torch.autograd.gradcheck(f, (lp.clone().requires_grad_(),), eps=1e-6,
                                        atol=1e-6), name


def test_fused_backward_handles_non_scalar_upstream():
    x = torch.tensor([0.1, -0.3, 0.5], dtype=torch.float64, requires_grad=True)

    def kernel(v):
        return v * v, 2 * v

    y = fused_token_loss(x, kernel)
    y.backward(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    assert torch.allclose(x.grad, torch.tensor([0.2, -1.2, 3.0], dtype=torch.float64))
    x.grad = None
    fused_token_loss(x, kernel).sum().backward()  # expanded-scalar upstream
    assert torch.allclose(x.grad, 2 * x.detach())


def test_ppo_surrogate_does_not_touch_its_input():
    d = torch.tensor([0.5, -0.5, 0.0])
    keep = d.clone()
    ppo_surrogate(d, torch.ones(3), torch.ones(3), 0.8, 1.2)
    assert torch.equal(d, keep)


@pytest.mark.parametrize("n,q,p_mask", [(1000, 0.9, 0.3), (200_000, 0.9, 0.05),
                                        (200_000, 0.98, 0.3), (150_001, 0.5, 0.0),
                                        (100_000, 0.9999, 0.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_quantile_and_tail_exact(n, q, p_mask, dtype):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g, dtype=dtype).abs()
    x[::7] = 0.25  # ties
    mask = (torch.rand(n, generator=g) >= p_mask).to(dtype)
    xm = x * mask
    qv, tail = quantile_and_tail(xm, int(mask.sum()), q)
    act = x.numpy()[mask.numpy() > 0].astype(np.float64)
    assert qv.item() == pytest.approx(np.quantile(act, q), rel=1e-6)
    want = np.flatnonzero(xm.numpy() > qv.item())
    assert np.array_equal(tail.numpy(), want)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 30_000), seed=st.integers(0, 2**31),
       share=st.one_of(st.floats(0.02, 0.12), st.floats(0.0, 1.0)),
       runs=st.booleans())
def test_flatnonzero_equals_numpy(n, share, seed, runs):
    """ops.flatnonzero (padded past numpy's sparse branch between 2.5% and 10% True)
    gives np.flatnonzero's indices at every density, scattered or in runs."""
    rng = np.random.default_rng(seed)
    b = rng.random(n) < share
    if runs:
        b = np.repeat(b[: n // 8 + 1], 8)[:n]
    got = flatnonzero(b)
    assert got.dtype == np.intp and np.array_equal(got, np.flatnonzero(b))
    keep = torch.from_numpy(b)
    assert torch.equal(nonzero_indices(keep), torch.nonzero(keep).reshape(-1))
    x = torch.from_numpy(rng.random(n))
    assert torch.equal(compress(x, keep), x[keep])
    assert torch.equal(compress(x.to(torch.bfloat16), keep), x.to(torch.bfloat16)[keep])
    y = torch.from_numpy(rng.random(n))
    y[::7] = float("nan")
    for a, b in ((x, y), (x.to(torch.bfloat16), y.to(torch.bfloat16))):  # numpy, torch
        want = torch.nonzero((a > 0.5) | (b > 1.0 - share)).reshape(-1)
        hit = above_mask(a, 0.5)
        hit |= above_mask(b, 1.0 - share)
        assert torch.equal(mask_indices(hit), want)


def test_quantile_and_tail_degenerate():
    z = torch.zeros(100_000)
    qv, tail = quantile_and_tail(z, 100_000, 0.9)
    assert qv.item() == 0.0 and tail.numel() == 0
    qv, tail = quantile_and_tail(z, 0, 0.9)
    assert qv.item() == 0.0 and tail.numel() == 0


def test_version_spread_cu_seqlens_matches_rows():
    g = torch.Generator().manual_seed(9)
    lens = [4, 0, 3, 5, 2, 0, 6]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]))
    n = int(cu[-1])
    ver = torch.randint(-1, 30, (n,), generator=g, dtype=torch.int32)
    mask = (torch.rand(n, generator=g) > 0.3).float()
    mask[7:12] = 0  # one sequence with no active token
    x = torch.zeros(n)
    got = version_spread(LossInputs(x, x, x, mask, versions=ver, cu_seqlens=cu,
                                    learner_version=40))
    firsts, lasts = [], []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        vs = [int(ver[i]) for i in range(s, e) if mask[i] > 0]
        if vs:
            firsts.append(min(vs))
            lasts.append(max(vs))
    assert got["intra_mean"].item() == pytest.approx(
        sum(b - a for a, b in zip(firsts, lasts)) / len(firsts))
    assert got["inter_mean"].item() == pytest.approx(40 - sum(lasts) / len(lasts))
    big = torch.full((n,), 2**30, dtype=torch.int64)
    big[0] = 2**30 + 1  # beyond float32's exact integers: the float64 redo
    got = version_spread(LossInputs(x, x, x, torch.ones(n), versions=big, cu_seqlens=cu))
    assert got["intra_mean"].item() == pytest.approx(1 / 5)


@pytest.mark.parametrize("name", ["sat", "estr", "decoupled_ppo"])
def test_fused_equals_eager_large_float32(name):
    """Above 65536 tokens the CPU selection brackets the rank with a sample first."""
    lp, mu, old, adv, mask, ent = _batch(n=120_000, seed=10, scale=0.1, dtype=torch.float32,
                                         p_mask=0.05)
    kw = dict(logprobs=lp, rollout_logprobs=mu, old_logprobs=old, advantages=adv,
              loss_mask=mask, entropy=ent)
    spec = LOSSES[name]
    (la, ga, ma), (lb, gb, mb) = (_run((spec.fused, spec), kw, None),
                                  _run((spec.reference, spec), kw, None))
    assert la.item() == pytest.approx(lb.item(), rel=1e-5)
    assert torch.allclose(ga, gb, rtol=1e-5, atol=1e-12)
    for k in ma:  # eager eps_*_mean = float32 dot(1 + eps*c, m)/n - 1: ~1e-5 cancellation
        assert ma[k].item() == pytest.approx(mb[k].item(), rel=1e-4, abs=1e-4), k


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_empty_batch_gives_zero_loss_for_every_loss(backend):
    z = torch.zeros(0, dtype=torch.float64)
    for name in sorted(LOSSES):
        x = z.clone().requires_grad_()
        inp = LossInputs(x, z, z, z, old_logprobs=z, ref_logprobs=z, entropy=z,
                         cu_seqlens=torch.tensor([0]))
        loss, _ = compute_loss(name, inp, {"backend": backend})
        loss.backward()
        assert loss.item() == 0.0, name


@pytest.mark.parametrize("backend", ["reference", "fused"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_take_the_torch_paths(dtype, backend):
    """numpy cannot read bfloat16: selections fall back to torch; results match float32."""
    lp, mu, old, adv, mask, ent = _batch(n=3000, seed=11, scale=0.2, dtype=torch.float32)
    cfg = {"backend": backend}
    for name in ("sat", "estr", "decoupled_ppo", "ppo_clip"):
        kw = dict(old_logprobs=old, entropy=ent)
        lo = compute_loss(name, LossInputs(lp.to(dtype), mu.to(dtype), adv.to(dtype),
                                           mask.to(dtype), **{k: v.to(dtype)
                                                              for k, v in kw.items()}), cfg)[0]
        hi = compute_loss(name, LossInputs(lp.to(dtype).float(), mu.to(dtype).float(),
                                           adv.to(dtype).float(), mask,
                                           **{k: v.to(dtype).float() for k, v in kw.items()}),
                          cfg)[0]
        assert lo.float().item() == pytest.approx(hi.item(), rel=0.05, abs=2e-3), name


@pytest.mark.parametrize("q", [0.5, 0.9, 0.98])
def test_torch_selection_path_used_off_cpu_is_exact(monkeypatch, q):
    """The non-numpy path (other devices): Floyd-Rivest bracket + kthvalue, and the
    quantile-then-indices form of quantile_and_tail, forced here on CPU."""
    from learner_client.corrections import ops

    monkeypatch.setattr(ops, "_kth_cpu", lambda x, ranks: None)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(150_000, generator=g).abs()
    x[::5] = 0.5
    mask = (torch.rand(150_000, generator=g) > 0.2).float()
    expect = np.quantile(x.numpy()[mask.numpy() > 0].astype(np.float64), q)
    assert ops.masked_quantile(x, mask, q).item() == pytest.approx(expect, rel=1e-6)
    assert ops.nonneg_quantile(x * mask, int(mask.sum()), q).item() == pytest.approx(
        expect, rel=1e-6)
    xm = (x * mask).to(torch.bfloat16).float()  # not a numpy path either way
    act = xm.numpy()[mask.numpy() > 0].astype(np.float64)
    monkeypatch.setattr(ops, "indices_above",
                        lambda t, thr: torch.nonzero(t > thr).squeeze(1))
    qv, tail = ops.quantile_and_tail(xm.to(torch.bfloat16), int(mask.sum()), q)
    assert qv.float().item() == pytest.approx(np.quantile(act, q), rel=1e-2)
    assert torch.equal(tail, torch.nonzero(xm.to(torch.bfloat16) > qv).squeeze(1))
