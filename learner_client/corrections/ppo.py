"""PPO-family losses (ppo_clip, grpo, dr_grpo, dapo) and PPO's clipped surrogate, which
every other loss builds on.

    r_t = pi_t / pi_old_t        pi_old = old_logprobs where given, else mu (on-policy)
    S(r, A; lo, hi) = min(r A, clip(r, lo, hi) A),    lo = 1 - eps_low, hi = 1 + eps_high
    loss_t = -S(r_t, A_t) * loss_mask_t               dual clip c: at most c |A_t| if A_t < 0
    grpo:  + beta * k3_t,  k3 = pi_ref/pi - log(pi_ref/pi) - 1  (>= 0, needs ref_logprobs)

Diagnostics over the active tokens: clipfrac (share on the clipped branch, where the
gradient is 0), approx_kl (mean log pi_old - log pi, verl's ppo_kl), ratio_mean,
dual_clipfrac (with a dual clip), kl (grpo's k3 mean). Ratios are computed in log space and
exp'd through a clamp at e^+-20 (``ops.safe_exp``).
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from .base import Aggregation, ClipConfig, LossConfig, TokenLoss
from .inputs import LossInputError, LossInputs
from .ops import masked_mean, safe_exp

Bound = float | Tensor  # a clip endpoint: one number, or one per token (SAT)


class PPOClipConfig(ClipConfig):
    """PPO clipped surrogate (Schulman et al. 2017), r = pi/pi_old, eps 0.2 both sides.
    Aggregation: token mean over the batch."""


def clipped_surrogate(log_ratio: Tensor, adv: Tensor, lo: Bound, hi: Bound
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """(S, clipped, r): S = min(r A, clip(r, lo, hi) A) for r = exp(log_ratio); ``clipped``
    (bool) where the clipped branch is strictly smaller (S's gradient is 0 there); r detached."""
    r = safe_exp(log_ratio)
    adv = adv.detach().to(r.dtype)
    unclipped = r * adv
    clipped = torch.clamp(r, lo, hi) * adv
    return torch.minimum(unclipped, clipped), clipped < unclipped, r.detach()


def dual_clip_cap(loss: Tensor, adv: Tensor, c: float | None) -> tuple[Tensor, Tensor | None]:
    """Dual clip (Ye et al. 2020) of a loss -S: where A < 0, min(-S, c |A|) (capped tokens get
    zero gradient). Returns (loss, capped bool), or (loss, None) when c is None."""
    if c is None:
        return loss, None
    adv = adv.detach().to(loss.dtype)
    cap = adv * (-c)
    capped = (adv < 0) & (loss > cap)
    return torch.where(capped, cap, loss), capped


def ppo_token_loss(log_pi: Tensor, log_pi_old: Tensor, adv: Tensor, mask: Tensor, lo: Bound,
                   hi: Bound, dual_clip: float | None = None, weight: Tensor | None = None
                   ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Per-token -S(pi/pi_old, A; lo, hi), dual-clipped, times mask (and times ``weight``, a
    detached per-token factor such as an importance weight), with PPO's diagnostics.

    Returns (loss [N], clipped bool [N] (meaningful on active tokens), metrics). The fused
    backend swaps in ``fused.kernel.fused_ppo_token_loss``: same signature, same results."""
    log_ratio = log_pi - log_pi_old  # log r
    s, clipped, r = clipped_surrogate(log_ratio, adv, lo, hi)
    loss, capped = dual_clip_cap(-s, adv, dual_clip)
    metrics = {
        "clipfrac": masked_mean(clipped, mask),
        "approx_kl": masked_mean(-log_ratio.detach(), mask),  # mean log pi_old - log pi
        "ratio_mean": masked_mean(r, mask),
    }
    if capped is not None:
        metrics["dual_clipfrac"] = masked_mean(capped, mask)
    loss = loss * mask
    return (loss if weight is None else loss * weight), clipped, metrics


def ppo_clip(inputs: LossInputs, cfg: PPOClipConfig, token_loss=ppo_token_loss) -> TokenLoss:
    """-S(pi/pi_old, A; 1 - eps_low, 1 + eps_high) per active token (also dr_grpo and dapo,
    which differ in their defaults and aggregation only)."""
    m = inputs.mask
    loss, _, metrics = token_loss(inputs.flat("logprobs"), inputs.behavior_or_old(),
                                  inputs.flat("advantages"), m, 1.0 - cfg.eps_low,
                                  1.0 + cfg.eps_high, cfg.dual_clip)
    return TokenLoss(loss, m, metrics)


class GRPOConfig(PPOClipConfig):
    """GRPO (Shao et al. 2024, DeepSeekMath): clip 0.2, token mean per sequence then mean over
    sequences, k3 KL to the reference policy with coefficient beta = 0.04 (needs
    ``ref_logprobs``; set kl_coef = 0 to run without a reference model). Advantages:
    ``advantages.grpo_advantages`` ((R - mean)/std per group)."""

    aggregation: Aggregation = Field("seq_mean_token_mean", description=LossConfig.model_fields[
        "aggregation"].description)
    kl_coef: float = Field(0.04, ge=0.0, description="beta of the k3 KL estimator term.")


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 estimator of KL(pi || pi_ref) per token: exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    d = ref_logprobs - logprobs
    return safe_exp(d) - d - 1.0


def add_k3_kl(tok: TokenLoss, inputs: LossInputs, kl_coef: float, who: str) -> TokenLoss:
    """tok plus kl_coef * k3(pi, pi_ref) on the active tokens (aggregated like tok) and the
    diagnostic ``kl`` (mean k3 over the active tokens). kl_coef = 0: tok unchanged."""
    if kl_coef <= 0.0:
        return tok
    if inputs.ref_logprobs is None:
        raise LossInputError(f"{who} with kl_coef > 0 needs ref_logprobs (or set kl_coef=0)")
    m = inputs.mask
    kl = k3_kl(inputs.flat("logprobs"), inputs.flat("ref_logprobs").detach())
    tok.metrics["kl"] = masked_mean(kl.detach(), m)
    return TokenLoss(tok.loss + kl_coef * kl * m, tok.denom_mask, tok.metrics)


def grpo(inputs: LossInputs, cfg: GRPOConfig) -> TokenLoss:
    """PPO's clipped surrogate plus beta * k3(pi, pi_ref)."""
    return add_k3_kl(ppo_clip(inputs, cfg), inputs, cfg.kl_coef, "grpo")


class DrGRPOConfig(PPOClipConfig):
    """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): clip 0.2, no KL,
    advantages R - mean (no std division, ``advantages.dr_grpo_advantages``), token sum
    divided by a constant (default: N token slots = G * L_max for padded [G, L_max])."""

    aggregation: Aggregation = Field("constant", description=LossConfig.model_fields[
        "aggregation"].description)


class DAPOConfig(PPOClipConfig):
    """DAPO (Yu et al. 2025): clip-higher eps_low 0.2 / eps_high 0.28, token-level mean over
    the whole batch. Dynamic sampling and overlong shaping act on data/rewards, see
    ``advantages.dapo_dynamic_sampling_keep`` and ``advantages.overlong_penalty``."""

    eps_high: float = Field(0.28, ge=0.0,
                            description="Upper clip (clip-higher): r <= 1 + eps_high.")
