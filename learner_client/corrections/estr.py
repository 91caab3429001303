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

import numpy as np
import torch
from pydantic import Field, model_validator
from torch import Tensor

from .base import LossConfig, TokenLoss
from .inputs import LossInputs
from .fused import fused_token_loss, ppo_metrics, ppo_surrogate
from .ops import indices_above, masked_mean, masked_quantile, quantile_and_tail
from .ppo import ppo_token_loss_ex


class ESTRConfig(LossConfig):
    """ESTR: eps 0.2 both sides, eps_h 0.01. Exactly one of tau / target_mask_rate is set;
    the default (our choice, tau is unpublished) targets a 2% mask rate per batch."""

    eps_low: float = Field(0.2, ge=0.0, lt=1.0, description="PPO lower clip.")
    eps_high: float = Field(0.2, ge=0.0, description="PPO upper clip.")
    dual_clip: float | None = Field(
        None, gt=1.0,
        description="Dual clip c (Ye et al. 2020): for A < 0 the token loss is capped at "
                    "c*|A|, so one corrupt token (ratio up to e^20) cannot dominate the "
                    "loss. None (the paper's form) disables it.")
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
    v = inputs.flat("versions").detach()
    if torch.is_floating_point(v):
        v = v.to(torch.int64)
    if inputs.cu_seqlens is not None and v.device.type == "cpu":
        firsts, lasts = _cpu_segment_min_max(v, inputs)
        if firsts.size == 0:
            return {}
        n = firsts.size
        first = torch.from_numpy(firsts)
        last = torch.from_numpy(lasts)
    else:
        inactive = ~inputs.active
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


def _cpu_segment_min_max(v: Tensor, inputs: LossInputs) -> tuple[np.ndarray, np.ndarray]:
    """(v_first, v_last) as float64 arrays over the cu_seqlens sequences that have active
    tokens: numpy's fmin/fmax.reduceat over the versions with inactive tokens set to NaN
    (ignored by fmin/fmax). One pass each, no per-token index tensor."""
    vn = v.numpy()
    m = inputs.mask
    inactive = None
    if int(inputs.mask_count) != vn.size:
        inactive = (m.numpy() == 0) if m.dtype in (torch.float32, torch.float64) else (
            (m == 0).numpy())
    # float32 holds every |version| < 2**24 exactly; larger ones are redone in float64
    first = last = np.zeros(0)
    for dt in (np.float32, np.float64):
        w = vn.astype(dt)
        if inactive is not None:
            np.putmask(w, inactive, np.nan)
        first, last = _reduce_segments(w, inputs)
        if not (np.abs(first).max(initial=0) >= 2**24 or np.abs(last).max(initial=0) >= 2**24):
            break
    return first.astype(np.float64), last.astype(np.float64)


def _reduce_segments(w: np.ndarray, inputs: LossInputs) -> tuple[np.ndarray, np.ndarray]:
    cu = inputs.cu_seqlens.detach().cpu().numpy().astype(np.int64)
    offs = cu[:-1][cu[1:] > cu[:-1]]  # non-empty sequences (empty ones have no tokens)
    if offs.size == 0:
        return np.zeros(0), np.zeros(0)
    first = np.fmin.reduceat(w, offs)
    last = np.fmax.reduceat(w, offs)
    keep = ~np.isnan(first)  # all-inactive sequences
    return first[keep], last[keep]


def estr_reference(inputs: LossInputs, cfg: ESTRConfig) -> TokenLoss:
    """ESTR through eager [N] ops (for tests against the fused ``estr``)."""
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
    drop = (score > tau) | torch.isposinf(score)  # NaN > tau is False: missing entropy is
    # never masked; an infinite score (a -inf behavior logprob) always is, whatever tau
    pg, _, metrics = ppo_token_loss_ex(d, inputs.flat("advantages"), m, cfg.eps_low,
                                       cfg.eps_high, cfg.dual_clip, count=n_act)
    metrics["mask_rate"] = masked_mean(drop.to(m.dtype), m, n_act)
    metrics["tau"] = tau.detach().to(torch.float32)
    metrics["entropy_missing_rate"] = (masked_mean(missing_b.to(m.dtype), m, n_act)
                                       if any_missing else torch.zeros_like(n_act))
    if cfg.version_diagnostics:
        metrics.update(version_spread(inputs))
    return TokenLoss(pg.masked_fill(drop, 0.0), m, metrics)


def estr(inputs: LossInputs, cfg: ESTRConfig) -> TokenLoss:
    """ESTR as one fused autograd node: the PPO kernel plus the score and a sparse mask.

    The masked set M = {score > tau} is applied by zeroing the loss and gradient at its
    indices (it is a small tail: the target rate, or the few tokens past a fixed tau), so
    the extra work over PPO is the score (3 elementwise passes) and finding that tail.
    Target rate without missing entropy: the tail comes out of the exact selection of tau
    on score * mask (inactive entries 0, see ops.quantile_and_tail). Missing entropy (NaN,
    detected by one sum) takes the masked-copy path for tau.
    """
    inputs.require("entropy")
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
        dm = torch.mul(d, m)  # d on active tokens, 0 elsewhere
        kl_sum = dm.sum()
        # score on active tokens (0 on inactive ones: never above tau >= 0, and below every
        # active score for the quantile); NaN where the entropy is missing
        score = dm.square_().div_(h + cfg.eps_h)
        if cfg.tau is not None:
            tau = torch.tensor(cfg.tau, dtype=score.dtype, device=score.device)
            drop = indices_above(score, cfg.tau)
        elif not any_missing:
            tau, drop = quantile_and_tail(score, int(n_act), 1.0 - cfg.target_mask_rate)
        else:
            valid = inputs.active & ~missing_b
            tau = masked_quantile(score, None, 1.0 - cfg.target_mask_rate, valid)
            drop = indices_above(score, float(tau))
        if not bool(torch.isfinite(tau)) or bool(torch.isposinf(score).any()):
            # an infinite score (e.g. a -inf behavior logprob) is always masked: with a
            # target rate tau itself may be inf, and score > inf lets it through
            drop = torch.unique(torch.cat([drop, torch.nonzero(torch.isposinf(score))
                                           .reshape(-1).to(drop.device)]))
        s = ppo_surrogate(d, adv.to(x.dtype), m, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high,
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
    if cfg.version_diagnostics:
        metrics.update(version_spread(inputs))
    return TokenLoss(pg, m, metrics)
