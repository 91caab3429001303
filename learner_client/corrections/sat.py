"""Staleness-Adaptive Trust Region (SAT, arXiv 2607.18722) and SAT-GSPO.

d = log pi - log mu (sampled log-ratio vs the behavior policy; staleness proxy), d_sg = sg[d]
q = sg[quantile_{0.9}(|d_sg|) over the active tokens of the micro-batch]
psi(u; q) = 1 / (1 + (u/q)^p), p = 2
u+ = max(d_sg, 0), u- = max(-d_sg, 0)
c+ = psi(u+; q) if q > 0 and |d_sg| > q else 1; c- likewise with u-
eps_low' = eps_low * c-, eps_high' = eps_high * c+
loss_t = -S(r, A; eps_low', eps_high'), r = exp(d)
Only the endpoint on the side of d's sign contracts (for d > q: c- = psi(0) = 1), and it
jumps from 1 to 0.5 at |d| = q. SAT-GSPO: d is replaced by the sequence mean of d
(length-normalized sequence log-ratio) broadcast to the sequence's tokens before the quantile.
Aggregation: token mean over active tokens (SAT), mean over sequences (SAT-GSPO).
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from .base import Aggregation, LossConfig, TokenLoss
from .gspo import sequence_mean
from .inputs import LossInputs
from .ops import masked_mean, masked_quantile, safe_exp
from .ppo import ppo_token_loss_ex


class SATConfig(LossConfig):
    """SAT defaults: eps_low = eps_high = 0.2, quantile 0.9, kernel exponent 2."""

    eps_low: float = Field(0.2, ge=0.0, lt=1.0, description="Base PPO lower clip.")
    eps_high: float = Field(0.2, ge=0.0, description="Base PPO upper clip.")
    quantile: float = Field(0.9, gt=0.0, lt=1.0,
                            description="Tail threshold q = this quantile of |d| (active tokens).")
    kernel_power: float = Field(2.0, gt=0.0, description="p in psi(u; q) = 1/(1 + (u/q)^p).")


class SATGSPOConfig(SATConfig):
    """SAT on the GSPO base: same factors on the length-normalized sequence ratio,
    eps 0.2 both sides (the paper's setting), mean over sequences."""

    aggregation: Aggregation = Field("seq_mean_token_mean", description=LossConfig.model_fields[
        "aggregation"].description)


def sat_factors(d_sg: Tensor, mask: Tensor, cfg: SATConfig) -> tuple[Tensor, Tensor, Tensor]:
    """(c_minus, c_plus, q) for detached log-ratios d_sg [N]."""
    a = d_sg.abs()
    q = masked_quantile(a, mask, cfg.quantile)
    one = torch.ones_like(d_sg)
    if float(q) <= 0.0:
        return one, one, q
    gate = a > q
    u_plus = d_sg.clamp_min(0.0)
    u_minus = (-d_sg).clamp_min(0.0)
    p = cfg.kernel_power
    c_plus = torch.where(gate, 1.0 / (1.0 + (u_plus / q) ** p), one)
    c_minus = torch.where(gate, 1.0 / (1.0 + (u_minus / q) ** p), one)
    return c_minus, c_plus, q


def _sat_core(d: Tensor, inputs: LossInputs, adv: Tensor, cfg: SATConfig) -> TokenLoss:
    m = inputs.mask
    c_minus, c_plus, q = sat_factors(d.detach(), m, cfg)
    eps_lo = cfg.eps_low * c_minus
    eps_hi = cfg.eps_high * c_plus
    pg, _, metrics = ppo_token_loss_ex(d, adv, m, eps_lo, eps_hi)
    c_min = torch.minimum(c_minus, c_plus)
    metrics.update({
        "sat_q": q.detach(),
        "eps_low_mean": masked_mean(eps_lo, m),
        "eps_high_mean": masked_mean(eps_hi, m),
        "gate_rate": masked_mean((c_min < 1.0).to(m.dtype), m),
        "c_min": torch.where(m > 0, c_min, torch.ones_like(c_min)).min() if m.numel() else
        torch.ones(()),
    })
    return TokenLoss(pg, m, metrics)


def sat(inputs: LossInputs, cfg: SATConfig) -> TokenLoss:
    d = inputs.flat("logprobs") - inputs.flat("rollout_logprobs").detach()
    return _sat_core(d, inputs, inputs.flat("advantages"), cfg)


def sat_gspo(inputs: LossInputs, cfg: SATGSPOConfig) -> TokenLoss:
    d = inputs.flat("logprobs") - inputs.flat("rollout_logprobs").detach()
    d_seq, _ = sequence_mean(d, inputs)
    adv_i, _ = sequence_mean(inputs.flat("advantages").detach(), inputs)
    tl = _sat_core(d_seq, inputs, adv_i, cfg)
    tl.metrics["seq_ratio_mean"] = masked_mean(safe_exp(d_seq.detach()), inputs.mask)
    return tl
