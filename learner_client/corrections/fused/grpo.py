"""GRPO's fused backend: PPO's surrogate and beta * k3(pi, pi_ref) in one kernel."""

from __future__ import annotations

import torch

from ..base import TokenLoss
from ..inputs import LossInputError, LossInputs
from ..ops import safe_exp
from ..ppo import GRPOConfig
from .kernel import Surrogate, clamped_entries, fused_token_loss, ppo_metrics, ppo_surrogate


def grpo(inputs: LossInputs, cfg: GRPOConfig) -> TokenLoss:
    """PPO clip plus beta * k3(pi, pi_ref) on the active tokens, one fused node: the k3
    term's gradient d/dlog pi [e^(ref - log pi) - (ref - log pi) - 1] = 1 - e^(ref - log pi)
    (the exponential's part 0 where the clamp at e^+-20 binds) is added to the surrogate's
    closed-form gradient."""
    if cfg.kl_coef > 0.0 and inputs.ref_logprobs is None:
        raise LossInputError("grpo with kl_coef > 0 needs ref_logprobs (or set kl_coef=0)")
    m = inputs.mask
    base = inputs.behavior_or_old()
    ref = inputs.flat("ref_logprobs").detach() if cfg.kl_coef > 0.0 else None
    adv = inputs.flat("advantages").detach()
    beta = cfg.kl_coef
    box: dict[str, object] = {}

    def kernel(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = ppo_surrogate(x - base, adv.to(x.dtype), m, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high,
                          dual_clip=cfg.dual_clip, own_d=True)
        box["s"] = s
        if ref is None:
            return s.pg, s.grad
        e = ref - x
        ex = safe_exp(e)
        kl = (ex - e).sub_(1.0)  # k3 >= 0
        box["kl_sum"] = torch.dot(kl, m)
        s.pg.add_(kl.mul_(m), alpha=beta)
        outside = clamped_entries(e)
        if outside is not None:
            ex.masked_fill_(outside, 0.0)
        s.grad.add_(ex.neg_().add_(1.0).mul_(m), alpha=beta)
        return s.pg, s.grad

    pg = fused_token_loss(inputs.flat("logprobs"), kernel)
    s: Surrogate = box["s"]  # type: ignore[assignment]
    metrics = ppo_metrics(s, inputs.mask_count)
    if ref is not None:
        metrics["kl"] = box["kl_sum"] / inputs.mask_count.clamp_min(1.0)  # type: ignore[operator]
    return TokenLoss(pg, m, metrics)
