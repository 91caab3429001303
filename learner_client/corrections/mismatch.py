"""Training-inference mismatch corrections on top of PPO: TIS, MIS, IcePop.

rho = pi_old / mu: the trainer's probability under the rollout weights over the engine's
(behavior) probability; all weights are detached. They need ``old_logprobs``. The base
surrogate is PPO's S(pi/pi_old, A; eps_low, eps_high):

    TIS:     loss_t = -min(rho_t, C) * S_t
    MIS:     loss_t = -rho * 1[lower <= rho <= upper] * S_t   (rho per token, sequence product
             or geometric mean; a sequence with some rho_t < veto is dropped); rejected
             tokens leave the denominator
    IcePop:  loss_t = -M(k_t) * S_t,  k = rho,  M(k) = k if lo <= k <= hi else 0
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor

from .base import ClipConfig, TokenLoss
from .gspo import sequence_mean
from .inputs import LossInputs
from .ops import broadcast, masked_mean, safe_exp
from .ppo import ppo_token_loss


def _rho_log(inputs: LossInputs) -> Tensor:
    return inputs.require_old() - inputs.flat("rollout_logprobs").detach()


class TISConfig(ClipConfig):
    """Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly
    brings you off-policy RL training"): w = min(pi_old/mu, C), detached, C = 2; PPO's clip
    on r = pi/pi_old. Aggregation: token mean over active tokens."""

    cap: float = Field(2.0, gt=0.0, description="C: the importance weight is min(rho, C).")


def tis(inputs: LossInputs, cfg: TISConfig, token_loss=ppo_token_loss) -> TokenLoss:
    """loss_t = -min(rho_t, C) * S(pi/pi_old, A)_t."""
    m = inputs.mask
    rho = safe_exp(_rho_log(inputs))
    w = torch.clamp(rho, max=cfg.cap)  # min(rho, C)
    loss, _, metrics = token_loss(inputs.flat("logprobs"), inputs.require_old(),
                                  inputs.flat("advantages"), m, 1.0 - cfg.eps_low,
                                  1.0 + cfg.eps_high, cfg.dual_clip, weight=w)
    metrics["tis_weight_mean"] = masked_mean(w, m)
    metrics["tis_capped_frac"] = masked_mean((rho > cfg.cap).to(m.dtype), m)
    metrics["rho_mean"] = masked_mean(rho, m)
    return TokenLoss(loss, m, metrics)


class MISConfig(ClipConfig):
    """Masked importance sampling (Liu, Li et al. 2025, "When speed kills stability"):
    w = rho * 1[lower <= rho <= upper] at token level (rho_t), sequence level
    (prod_t rho_t) or geometric level (exp(mean_t log rho_t)); a sequence is vetoed when any
    of its tokens has rho_t < veto_threshold. Rejected tokens leave the denominator.
    PPO's clip on r = pi/pi_old. Aggregation: token mean over the accepted tokens."""

    level: Literal["token", "sequence", "geometric"] = Field(
        "token", description="Where rho is measured: per token, sequence product, geometric mean.")
    upper: float = Field(2.0, gt=0.0, description="C: reject when rho > upper.")
    lower: float | None = Field(
        None, ge=0.0, description="Two-sided mode: also reject when rho < lower (e.g. 1/C).")
    veto_threshold: float | None = Field(
        1e-4, ge=0.0, description="Veto a whole sequence if any token rho_t < this; None = off.")

    @model_validator(mode="after")
    def _bounds(self) -> MISConfig:
        if self.lower is not None and self.lower > self.upper:
            raise ValueError("MIS lower bound must not exceed upper bound")
        return self


def mis(inputs: LossInputs, cfg: MISConfig, token_loss=ppo_token_loss) -> TokenLoss:
    """loss_t = -rho * 1[accepted] * S(pi/pi_old, A)_t over the accepted tokens."""
    m = inputs.mask
    log_rho_t = _rho_log(inputs)
    if cfg.level == "token":
        log_rho = log_rho_t
    elif cfg.level == "geometric":
        log_rho, _ = sequence_mean(log_rho_t, inputs)
    else:  # sequence: log of prod over the active tokens
        idx, _ = inputs.seq_index
        log_rho = broadcast(inputs.seq_sum(log_rho_t * m), idx)
    rho = safe_exp(log_rho)
    keep = log_rho <= math.log(cfg.upper)
    if cfg.lower is not None and cfg.lower > 0:
        keep &= log_rho >= math.log(cfg.lower)
    vetoed = torch.zeros_like(m)
    if cfg.veto_threshold is not None and cfg.veto_threshold > 0:
        bad = ((log_rho_t < math.log(cfg.veto_threshold)).to(m.dtype) * m)
        if inputs.has_sequences:
            idx, _ = inputs.seq_index
            vetoed = broadcast((inputs.seq_sum(bad) > 0).to(m.dtype), idx)
        else:  # no boundaries: the veto applies to the offending token only
            vetoed = bad
    accept = keep.to(m.dtype) * (1.0 - vetoed) * m
    w = rho * accept
    loss, _, metrics = token_loss(inputs.flat("logprobs"), inputs.require_old(),
                                  inputs.flat("advantages"), m, 1.0 - cfg.eps_low,
                                  1.0 + cfg.eps_high, cfg.dual_clip)
    metrics["mis_reject_rate"] = masked_mean(1.0 - accept, m)
    metrics["mis_veto_rate"] = masked_mean(vetoed, m)
    metrics["mis_weight_mean"] = masked_mean(rho, accept)
    metrics["mask_rate"] = metrics["mis_reject_rate"]
    return TokenLoss(loss * w, accept, metrics)


class IcePopConfig(ClipConfig):
    """IcePop (Ling team, Ring-1T 2025): k = pi_old/mu, M(k) = k if lo <= k <= hi else 0,
    lo = 0.5, hi = 5; PPO's clip on r = pi/pi_old. Masked tokens stay in the denominator
    (token mean over active tokens) unless ``rejected_leave_denominator``."""

    lo: float = Field(0.5, ge=0.0, description="Lower edge of the kept band of k.")
    hi: float = Field(5.0, gt=0.0, description="Upper edge of the kept band of k.")
    rejected_leave_denominator: bool = Field(
        False, description="True: tokens with M(k)=0 are also removed from the normalizer.")


def icepop(inputs: LossInputs, cfg: IcePopConfig, token_loss=ppo_token_loss) -> TokenLoss:
    """loss_t = -M(k_t) * S(pi/pi_old, A)_t, k = pi_old/mu."""
    m = inputs.mask
    k = safe_exp(_rho_log(inputs))
    keep = ((k >= cfg.lo) & (k <= cfg.hi)).to(m.dtype)
    w = k * keep  # M(k)
    loss, _, metrics = token_loss(inputs.flat("logprobs"), inputs.require_old(),
                                  inputs.flat("advantages"), m, 1.0 - cfg.eps_low,
                                  1.0 + cfg.eps_high, cfg.dual_clip)
    metrics["mask_rate"] = masked_mean(1.0 - keep, m)
    metrics["k_mean"] = masked_mean(k, m)
    denom = m * keep if cfg.rejected_leave_denominator else m
    return TokenLoss(loss * w * m, denom, metrics)
