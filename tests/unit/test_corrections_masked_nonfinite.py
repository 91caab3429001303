"""Tokens with loss_mask 0 never change any registered loss, its gradient or its metrics,
whatever they hold (NaN, +-inf, huge values): a property test over every registered loss
and its main variants, both backends, flat (cu_seqlens) and padded [B, T] layouts, float32
and float64."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from learner_client.corrections import LOSSES, LossInputs, compute_loss

# every registered loss with its defaults, plus the variants that take other code paths
CASES: list[tuple[str, dict]] = [(name, {}) for name in sorted(LOSSES)] + [
    ("ppo_clip", {"dual_clip": 3.0}),
    ("grpo", {"kl_coef": 0.0}),
    ("sat", {"dual_clip": 3.0}),
    ("estr", {"tau": 0.5, "target_mask_rate": None}),
    ("estr", {"tau": None, "target_mask_rate": 0.1}),
    ("mis", {"level": "sequence", "lower": 0.5}),
    ("mis", {"level": "geometric"}),
    ("icepop", {"rejected_leave_denominator": True}),
    ("tis", {"dual_clip": 3.0}),
    ("decoupled_ppo", {"ratio_mode": "loglinear"}),
    ("decoupled_ppo", {"ratio_mode": "linear_prox"}),
    ("decoupled_ppo", {"ratio_mode": "bypass"}),
    ("decoupled_ppo", {"discrepancy": "mask"}),
    ("decoupled_ppo", {"discrepancy": "truncate", "dual_clip": 2.0}),
    ("ppo_ewma", {"dual_clip": 3.0}),
    ("gspo", {"dual_clip": 3.0}),
    ("gspo_token", {}),
    ("sat_gspo", {"dual_clip": 3.0}),
]
CASES = [c for c in CASES if c[0] in LOSSES]
_IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in c.items()) or 'default'}" for n, c in CASES]

_FLOAT = ("logprobs", "rollout_logprobs", "advantages", "old_logprobs", "ref_logprobs",
          "entropy", "entropy_error_bound")
_POISON = [math.nan, math.inf, -math.inf, 1e30, -1e30]


def _inputs(rng: np.random.Generator, lens: list[int], padded: bool, active_p: float,
            dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    b = len(lens)
    width = max(lens)
    shape = (b, width) if padded else (sum(lens),)
    n = int(np.prod(shape))
    mu = -np.abs(rng.normal(1.0, 0.7, n))
    cols = {
        "rollout_logprobs": mu,
        "logprobs": mu + rng.normal(0.0, 0.3, n),
        "old_logprobs": mu + rng.normal(0.0, 0.2, n),
        "ref_logprobs": mu + rng.normal(0.0, 0.2, n),
        "advantages": rng.normal(0.0, 1.0, n),
        "entropy": np.abs(rng.normal(1.0, 0.8, n)),
        "entropy_error_bound": np.zeros(n),  # exact entropy on active tokens
    }
    out = {k: torch.tensor(v, dtype=dtype).reshape(shape) for k, v in cols.items()}
    mask = rng.random(n) < active_p
    if padded:  # padding beyond each row's length is inactive
        pad = (np.arange(width)[None, :] >= np.array(lens)[:, None]).reshape(-1)
        mask &= ~pad
    out["loss_mask"] = torch.tensor(mask.astype(np.float32)).reshape(shape)
    out["versions"] = torch.tensor(rng.integers(0, 6, n), dtype=torch.int64).reshape(shape)
    if not padded:
        out["cu_seqlens"] = torch.tensor(np.concatenate([[0], np.cumsum(lens)]),
                                         dtype=torch.int64)
    return out


def _run(name: str, cfg: dict, cols: dict[str, torch.Tensor]):
    lp = cols["logprobs"].clone().requires_grad_(True)
    kw = {k: v for k, v in cols.items() if k != "logprobs"}
    inp = LossInputs(logprobs=lp, learner_version=6, **kw)
    loss, metrics = compute_loss(name, inp, cfg)
    loss.backward()
    return loss.detach(), lp.grad.detach(), metrics


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    tol = 1e-12 if a.dtype == torch.float64 else 1e-6
    return bool(torch.allclose(a, b, rtol=tol, atol=tol, equal_nan=True))


@pytest.mark.parametrize("backend", ["reference", "fused"])
@pytest.mark.parametrize(("name", "cfg"), CASES, ids=_IDS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1),
       lens=st.lists(st.integers(1, 9), min_size=1, max_size=5),
       padded=st.booleans(),
       active_p=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
       poison=st.lists(st.sampled_from(_POISON), min_size=1, max_size=3),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_masked_positions_never_change_loss_gradient_or_metrics(backend, name, cfg, seed, lens,
                                                                 padded, active_p, poison,
                                                                 dtype):
    rng = np.random.default_rng(seed)
    clean = _inputs(rng, lens, padded, active_p, dtype)
    inactive = clean["loss_mask"] == 0
    dirty = dict(clean)
    for i, field in enumerate(_FLOAT):  # every float input poisoned at every masked slot
        vals = torch.tensor([poison[(i + j) % len(poison)] for j in range(inactive.numel())],
                            dtype=dtype).reshape(inactive.shape)
        dirty[field] = torch.where(inactive, vals, clean[field])
    dirty["versions"] = torch.where(inactive, torch.full_like(clean["versions"], -1),
                                    clean["versions"])
    cfg = {**cfg, "backend": backend}
    l0, g0, m0 = _run(name, cfg, clean)
    l1, g1, m1 = _run(name, cfg, dirty)
    assert torch.isfinite(l1), (name, l1)
    assert _same(l0, l1), (name, float(l0), float(l1))
    assert bool(torch.isfinite(g1).all())
    assert _same(g0, g1)
    assert bool((g1[inactive] == 0).all())
    assert m0.keys() == m1.keys()
    for k in m0:
        assert _same(m0[k].to(dtype), m1[k].to(dtype)), (name, k, m0[k], m1[k])


def test_one_loss_inputs_feeds_several_losses_and_backward_passes():
    """The masking never turns logprobs into a shared graph node: a LossInputs built once
    (NaN at masked positions) serves several losses, each with its own backward."""
    n = 32
    mu = -torch.rand(n, dtype=torch.float64) - 0.1
    mask = torch.ones(n)
    mask[:4] = 0
    old = torch.where(mask > 0, mu, torch.tensor(math.nan, dtype=torch.float64))
    lp = torch.where(mask > 0, mu + 0.1, torch.tensor(-math.inf, dtype=torch.float64))
    lp.requires_grad_(True)  # a leaf with -inf at masked positions
    inp = LossInputs(lp, mu, torch.randn(n, dtype=torch.float64), mask, old_logprobs=old,
                     entropy=torch.rand(n, dtype=torch.float64))
    for name in ("ppo_clip", "sat", "decoupled_ppo"):
        loss, _ = compute_loss(name, inp)
        loss.backward()
        assert torch.isfinite(loss) and bool(torch.isfinite(lp.grad).all())
        assert bool((lp.grad[:4] == 0).all())


@pytest.mark.parametrize("backend", ["reference", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_estr_quantile_ignores_masked_entropy_of_minus_eps_h(backend, dtype):
    """An inactive token whose entropy is -eps_h has the score 0/0 = NaN in ESTR's
    target-rate mode (its d is masked to 0, and H + eps_h = 0): it must not move tau."""
    rng = np.random.default_rng(3)
    clean = _inputs(rng, [7, 9, 5], False, 0.6, dtype)
    inactive = clean["loss_mask"] == 0
    assert bool(inactive.any()) and not bool(inactive.all())
    dirty = dict(clean)
    dirty["entropy"] = torch.where(inactive, torch.tensor(-0.01, dtype=dtype), clean["entropy"])
    cfg = {"target_mask_rate": 0.25, "eps_h": 0.01, "backend": backend}
    l0, g0, m0 = _run("estr", cfg, clean)
    l1, g1, m1 = _run("estr", cfg, dirty)
    assert _same(l0, l1) and _same(g0, g1)
    for k in ("tau", "mask_rate"):
        assert _same(m0[k].to(dtype), m1[k].to(dtype)), (k, m0[k], m1[k])
