"""Entropy-Scaled Trust Region (ESTR, arXiv 2607.22186).

delta = log pi - log mu; H = behavior-side full-vocabulary entropy at the position
score = delta^2 / (H + eps_h), eps_h = 0.01; M = 1[score <= tau] (no gradient through M)
loss = -(1 / #active) * sum_t M_t * S(r_t, A_t; eps_low, eps_high), r = pi / mu
Masked tokens stay in the denominator (the paper's 1/sum active). tau is not published:
fixed ``tau``, or ``target_mask_rate`` sets tau per batch to the (1 - rate) quantile of the
active tokens' scores. Tokens whose entropy is NaN (engine gave none) are never masked and
counted in ``entropy_missing_rate``. Diagnostics: mask rate; intra = v_last - v_first
within a trajectory and inter = v_target - v_last (means over sequences) when versions,
boundaries and learner_version are given.
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator
from torch import Tensor

from .base import LossConfig, TokenLoss
from .inputs import LossInputs
from .ops import masked_mean, masked_quantile, seg_sum
from .ppo import ppo_token_loss_ex


class ESTRConfig(LossConfig):
    """ESTR: eps 0.2 both sides, eps_h 0.01. Exactly one of tau / target_mask_rate is set;
    the default (our choice, tau is unpublished) targets a 2% mask rate per batch."""

    eps_low: float = Field(0.2, ge=0.0, lt=1.0, description="PPO lower clip.")
    eps_high: float = Field(0.2, ge=0.0, description="PPO upper clip.")
    eps_h: float = Field(0.01, gt=0.0, description="Added to H in the score's denominator.")
    tau: float | None = Field(None, ge=0.0, description="Fixed threshold on delta^2/(H+eps_h).")
    target_mask_rate: float | None = Field(
        0.02, ge=0.0, lt=1.0, description="Set tau per batch to mask about this fraction.")

    @model_validator(mode="after")
    def _one_mode(self) -> ESTRConfig:
        if (self.tau is None) == (self.target_mask_rate is None):
            raise ValueError("set exactly one of tau and target_mask_rate "
                             "(pass target_mask_rate=None with tau)")
        return self


def estr_scores(delta: Tensor, entropy: Tensor, eps_h: float) -> Tensor:
    return delta.detach() ** 2 / (entropy.detach() + eps_h)


def version_spread(inputs: LossInputs) -> dict[str, Tensor]:
    """Mean intra (v_last - v_first) and inter (v_target - v_last) over sequences."""
    if inputs.versions is None or not inputs.has_sequences:
        return {}
    idx, s = inputs.seq_index
    m = inputs.mask
    v = inputs.flat("versions").to(torch.float64)
    live = m > 0
    big = torch.finfo(torch.float64).max
    v_first = torch.full((s,), big, dtype=torch.float64).scatter_reduce(
        0, idx[live], v[live], reduce="amin")
    v_last = torch.full((s,), -big, dtype=torch.float64).scatter_reduce(
        0, idx[live], v[live], reduce="amax")
    has = seg_sum(m.to(torch.float64), idx, s) > 0
    if not bool(has.any()):
        return {}
    out = {"intra_mean": (v_last - v_first)[has].mean().float()}
    if inputs.learner_version is not None:
        out["inter_mean"] = (float(inputs.learner_version) - v_last[has]).mean().float()
    return out


def estr(inputs: LossInputs, cfg: ESTRConfig) -> TokenLoss:
    inputs.require("entropy")
    m = inputs.mask
    d = inputs.flat("logprobs") - inputs.flat("rollout_logprobs").detach()
    h = inputs.flat("entropy")
    missing = torch.isnan(h)
    score = estr_scores(d, torch.nan_to_num(h, nan=0.0), cfg.eps_h)
    if cfg.tau is not None:
        tau = torch.tensor(cfg.tau, dtype=score.dtype)
    else:
        valid = m * (~missing).to(m.dtype)
        tau = masked_quantile(score, valid, 1.0 - cfg.target_mask_rate)
    keep = ((score <= tau) | missing).to(m.dtype)
    pg, _, metrics = ppo_token_loss_ex(d, inputs.flat("advantages"), m, cfg.eps_low,
                                       cfg.eps_high)
    metrics["mask_rate"] = masked_mean(1.0 - keep, m)
    metrics["tau"] = tau.detach().to(torch.float32)
    metrics["entropy_missing_rate"] = masked_mean(missing.to(m.dtype), m)
    metrics.update(version_spread(inputs))
    return TokenLoss(pg * keep, m, metrics)
