"""Tokens with loss_mask 0 never change any registered loss, its gradient or its metrics,
whatever they hold (NaN, +-inf, huge values): a property test over every registered loss
and its main variants, flat (cu_seqlens) and padded [B, T] layouts."""

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
          "entropy")
_POISON = [math.nan, math.inf, -math.inf, 1e30, -1e30]


def _inputs(rng: np.random.Generator, lens: list[int], padded: bool, active_p: float
            ) -> dict[str, torch.Tensor]:
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
    }
    out = {k: torch.tensor(v, dtype=torch.float64).reshape(shape) for k, v in cols.items()}
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
    return bool(torch.allclose(a, b, rtol=1e-12, atol=1e-12, equal_nan=True))


@pytest.mark.parametrize(("name", "cfg"), CASES, ids=_IDS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1),
       lens=st.lists(st.integers(1, 9), min_size=1, max_size=5),
       padded=st.booleans(),
       active_p=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
       poison=st.lists(st.sampled_from(_POISON), min_size=1, max_size=3))
def test_masked_positions_never_change_loss_gradient_or_metrics(name, cfg, seed, lens, padded,
                                                                 active_p, poison):
    rng = np.random.default_rng(seed)
    clean = _inputs(rng, lens, padded, active_p)
    inactive = clean["loss_mask"] == 0
    dirty = dict(clean)
    for i, field in enumerate(_FLOAT):  # every float input poisoned at every masked slot
        vals = torch.tensor([poison[(i + j) % len(poison)] for j in range(inactive.numel())],
                            dtype=torch.float64).reshape(inactive.shape)
        dirty[field] = torch.where(inactive, vals, clean[field])
    dirty["versions"] = torch.where(inactive, torch.full_like(clean["versions"], -1),
                                    clean["versions"])
    l0, g0, m0 = _run(name, cfg, clean)
    l1, g1, m1 = _run(name, cfg, dirty)
    assert torch.isfinite(l1), (name, l1)
    assert _same(l0, l1), (name, float(l0), float(l1))
    assert bool(torch.isfinite(g1).all())
    assert _same(g0, g1)
    assert bool((g1[inactive] == 0).all())
    assert m0.keys() == m1.keys()
    for k in m0:
        assert _same(m0[k].to(torch.float64), m1[k].to(torch.float64)), (name, k, m0[k], m1[k])
