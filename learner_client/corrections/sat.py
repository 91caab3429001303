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
from .gspo import sequence_stats
from .inputs import LossInputError, LossInputs
from .fused import fused_token_loss, ppo_metrics, ppo_surrogate
from .ops import (LOG_RATIO_CLAMP, broadcast, clipped_surrogate, dual_clip_cap, masked_mean,
                  masked_quantile,
                  quantile_and_tail, weighted_run_quantile)
from .ppo import k3_kl, ppo_token_loss_ex


class SATConfig(LossConfig):
    """SAT defaults: eps_low = eps_high = 0.2, quantile 0.9, kernel exponent 2."""

    eps_low: float = Field(0.2, ge=0.0, lt=1.0, description="Base PPO lower clip.")
    eps_high: float = Field(0.2, ge=0.0, description="Base PPO upper clip.")
    quantile: float = Field(0.9, gt=0.0, lt=1.0,
                            description="Tail threshold q = this quantile of |d| (active tokens).")
    kernel_power: float = Field(2.0, gt=0.0, description="p in psi(u; q) = 1/(1 + (u/q)^p).")
    kl_coef: float = Field(
        0.0, ge=0.0,
        description="beta of the low-variance k3 KL estimator to the reference policy, "
                    "exp(ref - log pi) - (ref - log pi) - 1 per active token (needs "
                    "ref_logprobs), aggregated like the base loss. 0 = off (the paper's "
                    "coefficient is not in corrections.md).")
    dual_clip: float | None = Field(
        None, gt=1.0,
        description="Dual clip c (Ye et al. 2020): for A < 0 the token loss is capped at "
                    "c*|A|, so one corrupt token (ratio up to e^20) cannot dominate the "
                    "loss. None (the paper's form) disables it.")


class SATGSPOConfig(SATConfig):
    """SAT on the GSPO base: same factors on the length-normalized sequence ratio,
    eps 0.2 both sides (the paper's setting), mean over sequences."""

    aggregation: Aggregation = Field("seq_mean_token_mean", description=LossConfig.model_fields[
        "aggregation"].description)


def sat_factors(d_sg: Tensor, mask: Tensor, cfg: SATConfig) -> tuple[Tensor, Tensor, Tensor]:
    """(c_minus, c_plus, q) as full [N] tensors for detached log-ratios d_sg [N] (reference
    form, used by tests and diagnostics; the loss uses the gated-subset form below)."""
    a = d_sg.abs()
    q = masked_quantile(a, mask, cfg.quantile)
    one = torch.ones_like(d_sg)
    if float(q) <= 0.0:
        return one, one, q
    c_minus, c_plus = _factors(d_sg, q, cfg)
    return c_minus, c_plus, q


def _factors(d_sg: Tensor, q: Tensor, cfg: SATConfig) -> tuple[Tensor, Tensor]:
    """(c_minus, c_plus): psi(u-; q), psi(u+; q) where |d| > q > 0, else 1."""
    one = torch.ones_like(d_sg)
    if float(q) <= 0.0:
        return one, one
    gate = d_sg.abs() > q
    psi_plus = 1.0 / (1.0 + (d_sg.clamp_min(0.0) / q) ** cfg.kernel_power)
    psi_minus = 1.0 / (1.0 + ((-d_sg).clamp_min(0.0) / q) ** cfg.kernel_power)
    return torch.where(gate, psi_minus, one), torch.where(gate, psi_plus, one)


def _sat_core(d: Tensor, inputs: LossInputs, adv: Tensor, cfg: SATConfig) -> TokenLoss:
    """Reference (eager) SAT surrogate with full per-token bounds lo = 1 - eps_low*c-,
    hi = 1 + eps_high*c+ ([N] ops; the registered loss uses the fused ``sat`` below)."""
    m = inputs.mask
    n_act = inputs.mask_count
    den = n_act.clamp_min(1.0)
    d_sg = d.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    a = d_sg.abs()
    q = masked_quantile(a, None, cfg.quantile, inputs.active, int(n_act))
    qf = float(q)
    if qf > 0.0:
        psi = (a / qf).pow_(cfg.kernel_power).add_(1.0).reciprocal_()  # psi(|d|; q)
        # c+ = psi where d > q (then u+ = |d|), else 1; c- = psi where d < -q, else 1
        hi = psi.masked_fill(d_sg <= qf, 1.0).mul_(cfg.eps_high).add_(1.0)
        lo = psi.masked_fill_(d_sg >= -qf, 1.0).mul_(-cfg.eps_low).add_(1.0)
        gate = (a > qf) & inputs.active
        gate_act = gate.sum().to(m.dtype)
        eps_hi_mean = (torch.dot(hi, m) / den - 1.0)
        eps_lo_mean = (1.0 - torch.dot(lo, m) / den)
        a_max = (a * m).max()  # largest active |d|: where psi is smallest
        c_min = (1.0 / (1.0 + (a_max / qf) ** cfg.kernel_power) if bool(gate_act > 0)
                 else torch.ones((), dtype=d.dtype, device=d.device))
        bounds = (lo, hi)
    else:
        gate_act = torch.zeros((), dtype=d.dtype, device=d.device)
        eps_hi_mean = torch.tensor(cfg.eps_high, dtype=d.dtype, device=d.device)
        eps_lo_mean = torch.tensor(cfg.eps_low, dtype=d.dtype, device=d.device)
        c_min = torch.ones((), dtype=d.dtype, device=d.device)
        bounds = None
    pg, _, metrics = ppo_token_loss_ex(d, adv, m, cfg.eps_low, cfg.eps_high, cfg.dual_clip,
                                       count=n_act, bounds=bounds)
    metrics.update({
        "sat_q": q.detach(),
        "eps_low_mean": eps_lo_mean,
        "eps_high_mean": eps_hi_mean,
        "gate_rate": gate_act / den,
        "c_min": c_min,
    })
    return TokenLoss(pg, m, metrics)


def sat_reference(inputs: LossInputs, cfg: SATConfig) -> TokenLoss:
    """SAT through the eager per-token-bounds path (for tests against ``sat``)."""
    d = inputs.flat("logprobs") - inputs.flat("rollout_logprobs").detach()
    return _sat_core(d, inputs, inputs.flat("advantages"), cfg)


def _sat_fused(inputs: LossInputs, cfg: SATConfig) -> TokenLoss:
    """SAT as one fused autograd node.

    The factors differ from 1 only on the gated tail G = {active, |d| > q} (~10% of the
    tokens), and there only the endpoint on d's side of 1 moves: for d > q, r = e^d >= 1
    so clip(r, lo, hi) ignores lo; for d < -q, r <= 1 ignores hi. Hence clip(r, lo', hi')
    = clip(r, 1 - eps_low*c, 1 + eps_high*c) with c = psi(|d|; q) on G, 1 elsewhere: the
    kernel clamps with PPO's scalar bounds and re-clamps only G (gather/scatter of |G|).
    q: exact quantile of |d|*mask (inactive entries are 0 and shift the rank, no masked
    copy), capped at the ratio clamp inside the selection (no clamp pass); that buffer
    then holds PPO's -A*m (no [N] buffer beyond ppo_clip's). Returns exactly the eager
    result (same float ops per token).
    """
    m = inputs.mask
    n_act = inputs.mask_count
    n_int = int(n_act)
    den = n_act.clamp_min(1.0)
    mu = inputs.flat("rollout_logprobs").detach()
    adv = inputs.flat("advantages").detach()
    el, eh, p = cfg.eps_low, cfg.eps_high, cfg.kernel_power
    box: dict[str, Tensor] = {}

    def kernel(x: Tensor) -> tuple[Tensor, Tensor]:
        d = x - mu
        am = torch.mul(d, m)
        kl_sum = am.sum()
        # |d| capped at the ratio clamp (r = exp(clamp(d)) anyway): an infinite log-ratio
        # on an active token cannot make q infinite (psi = inf/inf)
        q, gate = quantile_and_tail(am.abs_(), n_int, cfg.quantile, cap=LOG_RATIO_CLAMP)
        box["q"] = q
        qf = float(q)
        fix = None
        if qf > 0.0:
            d_g = d.index_select(0, gate).clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            psi = (d_g.abs() / qf).pow_(p).add_(1.0).reciprocal_()
            box["psi"], box["pos"] = psi, d_g > 0

            def fix(rc: Tensor, r: Tensor) -> None:
                lo_g = psi.mul(-el).add_(1.0)
                hi_g = psi.mul(eh).add_(1.0)
                rc.index_copy_(0, gate, torch.clamp(r.index_select(0, gate), lo_g, hi_g))

        # |d|*m's buffer is free now: PPO's -A*m goes there (one [N] buffer less)
        a = adv.to(x.dtype)
        s = ppo_surrogate(d, a, m, 1.0 - el, 1.0 + eh, fix_clamp=fix,
                          nA=torch.mul(a, m, out=am).neg_(), own_d=True, kl_sum=kl_sum,
                          dual_clip=cfg.dual_clip)
        box["s"] = s  # type: ignore[assignment]
        return s.pg, s.grad

    pg = fused_token_loss(inputs.flat("logprobs"), kernel)
    s = box["s"]
    metrics = ppo_metrics(s, n_act)  # type: ignore[arg-type]
    dt = pg.dtype
    if "psi" in box:
        psi, pos = box["psi"], box["pos"]
        short = psi - 1.0  # c - 1 <= 0 on the gated tokens
        hi_short = torch.dot(short, pos.to(dt))
        lo_short = short.sum() - hi_short
        n_g = psi.numel()
        metrics.update({
            "eps_low_mean": el + el * lo_short / den,
            "eps_high_mean": eh + eh * hi_short / den,
            "gate_rate": torch.tensor(float(n_g), dtype=dt) / den,
            "c_min": psi.min() if n_g else torch.ones((), dtype=dt),
        })
    else:
        metrics.update({
            "eps_low_mean": torch.tensor(el, dtype=dt),
            "eps_high_mean": torch.tensor(eh, dtype=dt),
            "gate_rate": torch.zeros((), dtype=dt),
            "c_min": torch.ones((), dtype=dt),
        })
    metrics["sat_q"] = box["q"]
    return TokenLoss(pg, m, metrics)


def _with_kl(tok: TokenLoss, inputs: LossInputs, cfg: SATConfig) -> TokenLoss:
    """Adds beta * k3(pi, pi_ref) on the active tokens (the base loss' aggregation)."""
    if cfg.kl_coef <= 0.0:
        return tok
    if inputs.ref_logprobs is None:
        raise LossInputError("SAT with kl_coef > 0 needs ref_logprobs (or set kl_coef=0)")
    m = inputs.mask
    kl = k3_kl(inputs.flat("logprobs"), inputs.flat("ref_logprobs").detach())
    tok.metrics["kl"] = masked_mean(kl.detach(), m, inputs.mask_count)
    return TokenLoss(tok.loss + cfg.kl_coef * kl * m, tok.denom_mask, tok.metrics)


def sat(inputs: LossInputs, cfg: SATConfig) -> TokenLoss:
    return _with_kl(_sat_fused(inputs, cfg), inputs, cfg)


def sat_gspo(inputs: LossInputs, cfg: SATGSPOConfig) -> TokenLoss:
    """SAT on the GSPO base. The token-level 0.9-quantile of the broadcast sequence
    log-ratio equals the count-weighted quantile over sequences, so everything runs on [S]."""
    m = inputs.mask
    n_act = inputs.mask_count
    d = inputs.flat("logprobs") - inputs.flat("rollout_logprobs").detach()
    log_s, adv_i, cnt, idx = sequence_stats(inputs, d)
    d_sg = log_s.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    q = weighted_run_quantile(d_sg.abs(), cnt, cfg.quantile)
    c_minus, c_plus = _factors(d_sg, q, cfg)
    eps_lo = cfg.eps_low * c_minus
    eps_hi = cfg.eps_high * c_plus
    s_i, clipped, r = clipped_surrogate(log_s, adv_i, eps_lo, eps_hi)
    den = n_act.clamp_min(1.0)
    c_min_all = torch.minimum(c_minus, c_plus)
    gated = (c_min_all < 1.0) & (cnt > 0)
    live = (cnt > 0).to(m.dtype)
    n_seq = live.sum()
    metrics = {
        "clipfrac": masked_mean(clipped, live, n_seq),
        "seq_ratio_mean": masked_mean(r, live, n_seq),
        "approx_kl": -masked_mean(d_sg, live, n_seq),
        "sat_q": q.detach(),
        "eps_low_mean": torch.dot(eps_lo, cnt) / den,  # token-weighted, as in SAT
        "eps_high_mean": torch.dot(eps_hi, cnt) / den,
        "gate_rate": torch.dot(gated.to(cnt.dtype), cnt) / den,
        "c_min": (c_min_all[gated].min() if bool(gated.any())
                  else torch.ones((), dtype=d.dtype, device=d.device)),
    }
    pg_i = dual_clip_cap(-s_i, adv_i, cfg.dual_clip)
    return _with_kl(TokenLoss(broadcast(pg_i, idx) * m, m, metrics), inputs, cfg)
