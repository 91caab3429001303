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
from .ops import masked_mean, masked_quantile
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
    version_diagnostics: bool = Field(
        True, description="Report intra/inter version spread (needs versions and sequence "
                          "boundaries; costs two segment reductions over N).")

    @model_validator(mode="after")
    def _one_mode(self) -> ESTRConfig:
        if (self.tau is None) == (self.target_mask_rate is None):
            raise ValueError("set exactly one of tau and target_mask_rate "
                             "(pass target_mask_rate=None with tau)")
        return self


def estr_scores(delta: Tensor, entropy: Tensor, eps_h: float) -> Tensor:
    """delta^2 / (H + eps_h), detached (NaN where H is NaN)."""
    return delta.detach().square() / (entropy.detach() + eps_h)


def version_spread(inputs: LossInputs) -> dict[str, Tensor]:
    """Mean intra (v_last - v_first) and inter (v_target - v_last) over sequences that have
    active tokens; v_first / v_last = min / max policy_version over the active tokens."""
    if inputs.versions is None or not inputs.has_sequences:
        return {}
    inactive = ~inputs.active
    v = inputs.flat("versions")
    if torch.is_floating_point(v):
        v = v.to(torch.int64)
    big = torch.iinfo(v.dtype).max
    small = torch.iinfo(v.dtype).min
    if inputs.logprobs.dim() == 2:  # one row per sequence: plain row reductions
        b, t = inputs.logprobs.shape
        v_first = v.masked_fill(inactive, big).view(b, t).amin(1)
        v_last = v.masked_fill(inactive, small).view(b, t).amax(1)
    else:
        idx, s = inputs.seq_index
        v_first = torch.full((s,), big, dtype=v.dtype, device=v.device).scatter_reduce(
            0, idx, v.masked_fill(inactive, big), "amin")
        v_last = torch.full((s,), small, dtype=v.dtype, device=v.device).scatter_reduce(
            0, idx, v.masked_fill(inactive, small), "amax")
    has = v_first != big
    n = int(has.sum())
    if n == 0:
        return {}
    first = v_first[has].to(torch.float64)
    last = v_last[has].to(torch.float64)
    out = {"intra_mean": ((last - first).sum() / n).float()}
    if inputs.learner_version is not None:
        out["inter_mean"] = (float(inputs.learner_version) - last.sum() / n).float()
    return out


def estr(inputs: LossInputs, cfg: ESTRConfig) -> TokenLoss:
    inputs.require("entropy")
    m = inputs.mask
    n_act = inputs.mask_count
    d = inputs.flat("logprobs") - inputs.flat("rollout_logprobs").detach()
    h = inputs.flat("entropy")
    score = estr_scores(d, h, cfg.eps_h)  # NaN where the entropy is missing
    missing_b = torch.isnan(h)
    any_missing = bool(missing_b.any())
    if cfg.tau is not None:
        tau = torch.tensor(cfg.tau, dtype=score.dtype, device=score.device)
    elif any_missing:
        valid = inputs.active & ~missing_b
        tau = masked_quantile(score, None, 1.0 - cfg.target_mask_rate, valid)
    else:
        tau = masked_quantile(score, None, 1.0 - cfg.target_mask_rate, inputs.active,
                              int(n_act))
    drop = score > tau  # NaN > tau is False: missing entropy is never masked
    pg, _, metrics = ppo_token_loss_ex(d, inputs.flat("advantages"), m, cfg.eps_low,
                                       cfg.eps_high, count=n_act)
    metrics["mask_rate"] = masked_mean(drop.to(m.dtype), m, n_act)
    metrics["tau"] = tau.detach().to(torch.float32)
    metrics["entropy_missing_rate"] = (masked_mean(missing_b.to(m.dtype), m, n_act)
                                       if any_missing else torch.zeros_like(n_act))
    if cfg.version_diagnostics:
        metrics.update(version_spread(inputs))
    return TokenLoss(pg.masked_fill(drop, 0.0), m, metrics)
