"""ESTR's fused backend: the PPO kernel, the score and a sparse mask in one node."""

from __future__ import annotations

import torch
from torch import Tensor

from ..base import TokenLoss
from ..estr import ESTRConfig, check_entropy_exactness, version_spread
from ..inputs import LossInputs
from ..ops import indices_above, masked_mean, masked_quantile, quantile_and_tail
from .kernel import fused_token_loss, ppo_metrics, ppo_surrogate


def estr(inputs: LossInputs, cfg: ESTRConfig) -> TokenLoss:
    """ESTR as one fused autograd node: the PPO kernel plus the score and a sparse mask.

    The masked set M = {score > tau} is applied by zeroing the loss and gradient at its
    indices (it is a small tail: the target rate, or the few tokens past a fixed tau), so
    the extra work over PPO is the score (3 elementwise passes: d^2, H + eps_h, the
    division) and finding that tail; the score's buffer then holds PPO's -A*m, so ESTR
    allocates no more [N] buffers than ppo_clip beyond H + eps_h. Fixed tau: the score of
    every token (a drop on an inactive token changes nothing: its loss, gradient and mask
    weight are 0). Target rate without missing entropy: the tail comes out of the exact
    selection of tau on score * mask (inactive entries 0, see ops.quantile_and_tail).
    A NaN score (missing entropy, or 0/0 where an inactive token's H is -eps_h; detected
    by one sum) takes the masked-copy path for tau.
    """
    inputs.require("entropy")
    inexact = check_entropy_exactness(inputs, cfg)
    m = inputs.mask
    n_act = inputs.mask_count
    mu = inputs.flat("rollout_logprobs").detach()
    h = inputs.flat("entropy").detach()
    adv = inputs.flat("advantages").detach()
    any_missing = bool(torch.isnan(h.sum()))  # inf - inf also lands here; exact check below
    missing_b = torch.isnan(h) if any_missing else None
    any_missing = bool(missing_b.any()) if missing_b is not None else False
    box: dict[str, Tensor] = {}

    def kernel(x: Tensor) -> tuple[Tensor, Tensor]:
        d = x - mu
        kl_sum = torch.dot(d, m)
        if cfg.tau is not None:
            # score over all tokens; drop may hold inactive ones, where the loss, its
            # gradient and their mask_rate weight (m) are 0 anyway. NaN (missing entropy)
            # is never above tau.
            score = torch.square(d)
            score.div_(h + cfg.eps_h)
            tau = torch.tensor(cfg.tau, dtype=score.dtype, device=score.device)
            drop = indices_above(score, cfg.tau)
        else:
            # score on active tokens, 0 on inactive ones (below every active score for the
            # quantile); NaN where the entropy is missing, and 0/0 = NaN on an inactive
            # token whose H is -eps_h: NaN scores leave the quantile, as in the reference
            score = torch.mul(d, m).square_().div_(h + cfg.eps_h)
            if not any_missing and not bool(torch.isnan(score.sum())):
                tau, drop = quantile_and_tail(score, int(n_act), 1.0 - cfg.target_mask_rate)
            else:
                valid = inputs.active & ~torch.isnan(score)
                tau = masked_quantile(score, None, 1.0 - cfg.target_mask_rate, valid)
                drop = indices_above(score, float(tau))
        if not bool(torch.isfinite(tau)):
            # an infinite score (e.g. a -inf behavior logprob) is always masked: a finite
            # tau already has it in drop (inf > tau); tau itself may be inf with a target
            # rate (or a fixed tau = inf), and score > inf lets it through
            drop = torch.unique(torch.cat([drop, torch.nonzero(torch.isposinf(score))
                                           .reshape(-1).to(drop.device)]))
        # the score's buffer is free now: PPO's -A*m goes there (one [N] buffer less)
        a = adv.to(x.dtype)
        nA = torch.mul(a, m, out=score).neg_()
        s = ppo_surrogate(d, a, m, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high, nA=nA,
                          own_d=True, kl_sum=kl_sum, dual_clip=cfg.dual_clip)
        s.pg.index_fill_(0, drop, 0.0)
        s.grad.index_fill_(0, drop, 0.0)
        box["s"], box["tau"], box["drop"] = s, tau, drop  # type: ignore[assignment]
        return s.pg, s.grad

    pg = fused_token_loss(inputs.flat("logprobs"), kernel)
    metrics = ppo_metrics(box["s"], n_act)  # type: ignore[arg-type]
    den = n_act.clamp_min(1.0)
    metrics["mask_rate"] = m.index_select(0, box["drop"]).sum() / den
    metrics["tau"] = box["tau"].detach().to(torch.float32)
    metrics["entropy_missing_rate"] = (masked_mean(missing_b.to(m.dtype), m, n_act)
                                       if any_missing else torch.zeros_like(n_act))
    metrics["entropy_inexact_rate"] = inexact
    if cfg.version_diagnostics:
        metrics.update(version_spread(inputs))
    return TokenLoss(pg, m, metrics)
