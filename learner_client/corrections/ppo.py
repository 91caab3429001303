"""PPO-family losses: ppo_clip, grpo (+k3 KL), dr_grpo, dapo.

All use the ratio r = pi / pi_old with pi_old = ``old_logprobs`` when given, else the
behavior logprobs (on-policy assumption). Loss per token = -S(r, A; eps_low, eps_high)
(optionally dual-clipped), times loss_mask; aggregation per config.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from .base import Aggregation, LossConfig, TokenLoss
from .inputs import LossInputError, LossInputs
from .fused import Surrogate, fused_token_loss, ppo_metrics, ppo_surrogate
from .ops import clipped_surrogate_bounds, masked_mean, safe_exp


class PPOClipConfig(LossConfig):
    """PPO clipped surrogate (Schulman et al. 2017). Aggregation: token mean over the batch."""

    eps_low: float = Field(0.2, ge=0.0, lt=1.0, description="Lower clip: r >= 1 - eps_low.")
    eps_high: float = Field(0.2, ge=0.0, description="Upper clip: r <= 1 + eps_high.")
    dual_clip: float | None = Field(
        None, gt=1.0,
        description="Dual-clip constant c (Ye et al. 2020): for A < 0 the loss is capped at "
                    "-c*A. None disables it.")


def ppo_token_loss(log_ratio: Tensor, adv: Tensor, mask: Tensor, eps_low: float | Tensor,
                   eps_high: float | Tensor, dual_clip: float | None = None,
                   count: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token -S(exp(log_ratio), A), dual-clipped if asked, times mask; plus metrics."""
    pg, _, metrics = ppo_token_loss_ex(log_ratio, adv, mask, eps_low, eps_high, dual_clip, count)
    return pg, metrics


def ppo_token_loss_ex(log_ratio: Tensor, adv: Tensor, mask: Tensor, eps_low: float | Tensor,
                      eps_high: float | Tensor, dual_clip: float | None = None,
                      count: Tensor | None = None,
                      bounds: tuple[Tensor, Tensor] | None = None
                      ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Like ppo_token_loss, also returning the clipped indicator [N] (detached, 0/1).

    Metrics: clipfrac (share of active tokens whose clipped branch is the min), approx_kl
    (mean of log pi_old - log pi over active tokens, verl's ppo_kl), ratio_mean.
    Scalar eps: one fused autograd node (``fused_ppo``); per-token bounds: eager ops.
    """
    if count is None:
        count = mask.sum()
    if bounds is None and not isinstance(eps_low, Tensor) and not isinstance(eps_high, Tensor):
        pg, s = fused_ppo(log_ratio, None, adv, mask, count, eps_low, eps_high,
                          dual_clip=dual_clip)
        return pg, s.clipped.to(mask.dtype), ppo_metrics(s, count)
    if bounds is not None:  # per-token [lo, hi] given directly
        s, clipped, r = clipped_surrogate_bounds(log_ratio, adv, bounds[0], bounds[1])
    else:
        s, clipped, r = clipped_surrogate_bounds(log_ratio, adv, 1.0 - eps_low, 1.0 + eps_high)
    metrics = {
        "clipfrac": masked_mean(clipped, mask, count),
        "approx_kl": -masked_mean(log_ratio.detach(), mask, count),
        "ratio_mean": masked_mean(r, mask, count),
    }
    pg = -s
    if dual_clip is not None:
        cap = -dual_clip * adv
        neg = adv < 0
        metrics["dual_clipfrac"] = masked_mean((neg & (pg > cap)).to(pg.dtype), mask, count)
        pg = torch.where(neg, torch.minimum(pg, cap), pg)
    return pg * mask, clipped, metrics


def fused_ppo(x: Tensor, base: Tensor | None, adv: Tensor, mask: Tensor, count: Tensor,
              eps_low: float, eps_high: float, *, weight: Tensor | None = None,
              dual_clip: float | None = None) -> tuple[Tensor, Surrogate]:
    """Per-token -S(exp(x - base), A) * w as one autograd node (see fused.py), w = mask or
    ``weight`` (detached, mask already applied). Returns (pg [N], Surrogate for metrics)."""
    adv = adv.detach().to(x.dtype)
    box: list[Surrogate] = []

    def kernel(xv: Tensor) -> tuple[Tensor, Tensor]:
        d = xv - base if base is not None else xv
        s = ppo_surrogate(d, adv, mask, 1.0 - eps_low, 1.0 + eps_high, weight=weight,
                          dual_clip=dual_clip, own_d=base is not None)
        box.append(s)
        return s.pg, s.grad

    pg = fused_token_loss(x, kernel)
    return pg, box[0]


def _ppo(inputs: LossInputs, cfg: PPOClipConfig) -> TokenLoss:
    m = inputs.mask
    pg, s = fused_ppo(inputs.flat("logprobs"), inputs.behavior_or_old(),
                      inputs.flat("advantages"), m, inputs.mask_count, cfg.eps_low,
                      cfg.eps_high, dual_clip=cfg.dual_clip)
    return TokenLoss(pg, m, ppo_metrics(s, inputs.mask_count))


def ppo_clip(inputs: LossInputs, cfg: PPOClipConfig) -> TokenLoss:
    return _ppo(inputs, cfg)


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


def grpo(inputs: LossInputs, cfg: GRPOConfig) -> TokenLoss:
    """PPO clip plus beta * k3(pi, pi_ref) on the active tokens, one fused node: the k3
    term's gradient d/dlog pi [e^(ref - log pi) - (ref - log pi) - 1] = 1 - e^(ref - log pi)
    is added to the surrogate's closed-form gradient."""
    if cfg.kl_coef <= 0.0:
        return _ppo(inputs, cfg)
    if inputs.ref_logprobs is None:
        raise LossInputError("grpo with kl_coef > 0 needs ref_logprobs (or set kl_coef=0)")
    m = inputs.mask
    base = inputs.behavior_or_old()
    ref = inputs.flat("ref_logprobs").detach()
    adv = inputs.flat("advantages").detach()
    beta = cfg.kl_coef
    box: dict[str, object] = {}

    def kernel(x: Tensor) -> tuple[Tensor, Tensor]:
        s = ppo_surrogate(x - base, adv.to(x.dtype), m, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high,
                          dual_clip=cfg.dual_clip, own_d=True)
        e = ref - x
        ex = safe_exp(e)
        kl = (ex - e).sub_(1.0)  # k3 >= 0
        box["kl_sum"] = torch.dot(kl, m)
        s.pg.add_(kl.mul_(m), alpha=beta)
        s.grad.add_(ex.neg_().add_(1.0).mul_(m), alpha=beta)
        box["s"] = s
        return s.pg, s.grad

    pg = fused_token_loss(inputs.flat("logprobs"), kernel)
    metrics = ppo_metrics(box["s"], inputs.mask_count)  # type: ignore[arg-type]
    metrics["kl"] = box["kl_sum"] / inputs.mask_count.clamp_min(1.0)  # type: ignore[operator]
    return TokenLoss(pg, m, metrics)


class DrGRPOConfig(PPOClipConfig):
    """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): clip 0.2, no KL,
    advantages R - mean (no std division, ``advantages.dr_grpo_advantages``), token sum
    divided by a constant (default: N token slots = G * L_max for padded [G, L_max])."""

    aggregation: Aggregation = Field("constant", description=LossConfig.model_fields[
        "aggregation"].description)


def dr_grpo(inputs: LossInputs, cfg: DrGRPOConfig) -> TokenLoss:
    return _ppo(inputs, cfg)


class DAPOConfig(PPOClipConfig):
    """DAPO (Yu et al. 2025): clip-higher eps_low 0.2 / eps_high 0.28, token-level mean over
    the whole batch. Dynamic sampling and overlong shaping act on data/rewards, see
    ``advantages.dapo_dynamic_sampling_keep`` and ``advantages.overlong_penalty``."""

    eps_low: float = Field(0.2, ge=0.0, lt=1.0, description="Lower clip: r >= 1 - eps_low.")
    eps_high: float = Field(0.28, ge=0.0,
                            description="Upper clip (clip-higher): r <= 1 + eps_high.")


def dapo(inputs: LossInputs, cfg: DAPOConfig) -> TokenLoss:
    return _ppo(inputs, cfg)
