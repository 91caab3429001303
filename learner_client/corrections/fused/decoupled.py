"""Decoupled PPO's fused backend (and the revised PPO-EWMA on it)."""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import Tensor

from .. import decoupled as readable
from ..base import TokenLoss
from ..decoupled import DecoupledPPOConfig, proximal_logprobs
from ..inputs import LossInputs
from ..ops import indices_above
from .kernel import fused_ppo, fused_token_loss, ppo_metrics, ppo_surrogate, safe_exp_

_EMPTY = torch.zeros(0, dtype=torch.long)


def decoupled_ppo(inputs: LossInputs, cfg: DecoupledPPOConfig) -> TokenLoss:
    """M_d(r_d) * mask is folded into the surrogate's weight (one autograd node). Tokens that
    M_d zeroes (a rare tail, found from one aminmax over log r_d) get their PPO clip status
    recomputed on that subset, so clipfrac and active_token_fraction count them as the
    reference does. Dual clip: the reference."""
    if cfg.dual_clip is not None:
        return readable.decoupled_ppo(inputs, cfg)
    m = inputs.mask
    n_act = inputs.mask_count
    den = n_act.clamp_min(1.0)
    prox, use_rd, extra = proximal_logprobs(inputs, cfg)
    mu = inputs.flat("rollout_logprobs").detach()
    adv = inputs.flat("advantages").detach()
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    if not use_rd or cfg.discrepancy == "none":
        pg, s = fused_ppo(inputs.flat("logprobs"), prox, adv, m, n_act, lo, hi)
        metrics = ppo_metrics(s, n_act)
        metrics.update(extra)
        if use_rd:
            metrics["behav_weight_mean"] = torch.ones((), dtype=m.dtype) * (n_act > 0)
        metrics["behav_mask_rate"] = torch.zeros((), dtype=m.dtype)
        metrics["active_token_fraction"] = 1.0 - metrics["clipfrac"]
        return TokenLoss(pg, m, metrics)
    box: dict[str, Tensor] = {}

    def kernel(x: Tensor) -> tuple[Tensor, Tensor]:
        a = adv.to(x.dtype)
        log_rd = prox - mu
        lo_rd, hi_rd = ((float(v) for v in torch.aminmax(log_rd)) if log_rd.numel()
                        else (0.0, 0.0))
        drop = None
        if cfg.discrepancy == "cap_mask":
            lc = math.log(cfg.behav_imp_weight_cap)
            drop = indices_above(log_rd, lc) if hi_rd > lc else _EMPTY
        elif cfg.discrepancy == "mask":
            lc = math.log(cfg.discrepancy_c)
            drop = indices_above(log_rd.abs(), lc) if max(-lo_rd, hi_rd) > lc else _EMPTY
        w, _ = safe_exp_(log_rd, (lo_rd, hi_rd))
        if cfg.discrepancy == "truncate":
            w.clamp_(1.0 / cfg.discrepancy_c, cfg.discrepancy_c)
        if drop is not None and drop.numel():
            w.index_fill_(0, drop, 0.0)
        wm = w.mul_(m)
        box["w_sum"] = wm.sum()
        # -A * w * m in place in the weight's buffer (one [N] buffer less)
        s = ppo_surrogate(x - prox, a, m, lo, hi, nA=torch.mul(a, wm, out=wm).neg_(),
                          own_d=True)
        n_clip_drop = torch.zeros((), dtype=torch.long)
        if drop is not None and drop.numel():  # clip status of zero-weight tokens
            r_d = s.r.index_select(0, drop)
            na = (a.index_select(0, drop) * m.index_select(0, drop)).neg_()
            n_clip_drop = torch.count_nonzero(torch.clamp(r_d, lo, hi).mul_(na) > r_d * na)
            box["drop_active"] = m.index_select(0, drop).sum()
        box["s"], box["n_clip_drop"] = s, n_clip_drop  # type: ignore[assignment]
        box["has_drop"] = torch.tensor(drop is not None)
        return s.pg, s.grad

    pg = fused_token_loss(inputs.flat("logprobs"), kernel)
    dt = pg.dtype
    metrics = ppo_metrics(box["s"], n_act)  # type: ignore[arg-type]
    if bool(box["n_clip_drop"] > 0):  # zero-weight tokens whose clipped branch is the min
        metrics["clipfrac"] = metrics["clipfrac"] + box["n_clip_drop"].to(dt) / den
    metrics.update(extra)
    metrics["behav_weight_mean"] = box["w_sum"] / den
    if bool(box["has_drop"]):
        rate = box.get("drop_active", torch.zeros((), dtype=dt)) / den
        metrics["behav_mask_rate"] = rate
        both = box["n_clip_drop"].to(dt) / den
        metrics["active_token_fraction"] = 1.0 - rate - metrics["clipfrac"] + both
    else:
        metrics["behav_mask_rate"] = torch.zeros((), dtype=dt)
        metrics["active_token_fraction"] = 1.0 - metrics["clipfrac"]
    return TokenLoss(pg, m, metrics)


ppo_ewma_revised = partial(readable.ppo_ewma_revised, decoupled=decoupled_ppo)
