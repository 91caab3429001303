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
Diagnostics beside PPO's: sat_q, eps_low_mean / eps_high_mean (mean eps_low', eps_high'),
gate_rate (share of active tokens with c < 1) and c_min; ``kl`` with kl_coef > 0.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from .base import Aggregation, ClipConfig, LossConfig, TokenLoss
from .gspo import sequence_stats
from .inputs import LossInputs
from .ops import (LOG_RATIO_CLAMP, broadcast, masked_mean, masked_quantile,
                  weighted_run_quantile)
from .ppo import add_k3_kl, clipped_surrogate, dual_clip_cap, ppo_token_loss


class SATConfig(ClipConfig):
    """SAT defaults: eps_low = eps_high = 0.2 (the base clips, contracted per token by c-
    and c+; r = pi/mu), quantile 0.9, kernel exponent 2."""

    quantile: float = Field(0.9, gt=0.0, lt=1.0,
                            description="Tail threshold q = this quantile of |d| (active tokens).")
    kernel_power: float = Field(2.0, gt=0.0, description="p in psi(u; q) = 1/(1 + (u/q)^p).")
    kl_coef: float = Field(
        0.0, ge=0.0,
        description="beta of the low-variance k3 KL estimator to the reference policy, "
                    "exp(ref - log pi) - (ref - log pi) - 1 per active token (needs "
                    "ref_logprobs), aggregated like the base loss. 0 = off (the paper's "
                    "coefficient is not in corrections.md).")


class SATGSPOConfig(SATConfig):
    """SAT on the GSPO base: same factors on the length-normalized sequence ratio,
    eps 0.2 both sides (the paper's setting), mean over sequences."""

    aggregation: Aggregation = Field("seq_mean_token_mean", description=LossConfig.model_fields[
        "aggregation"].description)


def sat_factors(d_sg: Tensor, mask: Tensor, cfg: SATConfig) -> tuple[Tensor, Tensor, Tensor]:
    """(c_minus, c_plus, q) for detached log-ratios d_sg [N]: q = the cfg.quantile of |d_sg|
    over the active tokens, c+- = psi(u+-; q) where |d_sg| > q > 0, else 1."""
    q = masked_quantile(d_sg.abs(), mask, cfg.quantile)
    c_minus, c_plus = contraction_factors(d_sg, q, cfg)
    return c_minus, c_plus, q


def contraction_factors(d_sg: Tensor, q: Tensor, cfg: SATConfig) -> tuple[Tensor, Tensor]:
    """(c_minus, c_plus): psi(u-; q), psi(u+; q) where |d| > q > 0, else 1."""
    one = torch.ones_like(d_sg)
    if float(q) <= 0.0:
        return one, one
    gate = d_sg.abs() > q
    psi_plus = 1.0 / (1.0 + (d_sg.clamp_min(0.0) / q) ** cfg.kernel_power)  # u+ = max(d, 0)
    psi_minus = 1.0 / (1.0 + ((-d_sg).clamp_min(0.0) / q) ** cfg.kernel_power)  # u- = max(-d, 0)
    return torch.where(gate, psi_minus, one), torch.where(gate, psi_plus, one)


def sat_metrics(q: Tensor, eps_low: Tensor, eps_high: Tensor, c_minus: Tensor, c_plus: Tensor,
                weight: Tensor) -> dict[str, Tensor]:
    """SAT's diagnostics: q, mean eps_low' and eps_high', gate rate (share with c < 1) and
    min c, weighted by ``weight`` (the active tokens; per sequence: their active counts)."""
    c = torch.minimum(c_minus, c_plus)
    gated = (c < 1.0) & (weight > 0)
    return {
        "sat_q": q.detach(),
        "eps_low_mean": masked_mean(eps_low, weight),
        "eps_high_mean": masked_mean(eps_high, weight),
        "gate_rate": masked_mean(gated, weight),
        "c_min": c[gated].min() if bool(gated.any()) else torch.ones((), dtype=c.dtype),
    }


def sat(inputs: LossInputs, cfg: SATConfig) -> TokenLoss:
    """loss_t = -S(r_t, A_t; eps_low * c-_t, eps_high * c+_t), r = pi/mu."""
    m = inputs.mask
    log_pi = inputs.flat("logprobs")
    mu = inputs.flat("rollout_logprobs").detach()
    # d_sg = sg[log pi - log mu], capped at the ratio clamp (r = exp(clamp(d)) anyway): an
    # infinite log-ratio on an active token cannot make q infinite
    d_sg = (log_pi.detach() - mu).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    c_minus, c_plus, q = sat_factors(d_sg, m, cfg)
    eps_low, eps_high = cfg.eps_low * c_minus, cfg.eps_high * c_plus  # eps_low', eps_high'
    loss, _, metrics = ppo_token_loss(log_pi, mu, inputs.flat("advantages"), m, 1.0 - eps_low,
                                      1.0 + eps_high, cfg.dual_clip)
    metrics.update(sat_metrics(q, eps_low, eps_high, c_minus, c_plus, m))
    return add_k3_kl(TokenLoss(loss, m, metrics), inputs, cfg.kl_coef, "SAT")


def sat_gspo(inputs: LossInputs, cfg: SATGSPOConfig, surrogate=clipped_surrogate) -> TokenLoss:
    """SAT on the GSPO base: d is the sequence's length-normalized log-ratio log s_i. The
    token-level quantile of the broadcast log s equals the count-weighted quantile over
    sequences, so everything runs on [S]."""
    m = inputs.mask
    d = inputs.flat("logprobs") - inputs.flat("rollout_logprobs").detach()
    log_s, adv_i, cnt, idx = sequence_stats(inputs, d)
    d_sg = log_s.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    q = weighted_run_quantile(d_sg.abs(), cnt, cfg.quantile)
    c_minus, c_plus = contraction_factors(d_sg, q, cfg)
    eps_low, eps_high = cfg.eps_low * c_minus, cfg.eps_high * c_plus
    s, clipped, s_ratio = surrogate(log_s, adv_i, 1.0 - eps_low, 1.0 + eps_high)
    loss_i, _ = dual_clip_cap(-s, adv_i, cfg.dual_clip)
    live = (cnt > 0).to(m.dtype)
    metrics = {
        "clipfrac": masked_mean(clipped, live),  # share of sequences clipped
        "seq_ratio_mean": masked_mean(s_ratio, live),
        "approx_kl": -masked_mean(d_sg, live),
        **sat_metrics(q, eps_low, eps_high, c_minus, c_plus, cnt),  # token-weighted
    }
    tok = TokenLoss(broadcast(loss_i, idx) * m, m, metrics)
    return add_k3_kl(tok, inputs, cfg.kl_coef, "SAT")
