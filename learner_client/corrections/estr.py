"""Entropy-Scaled Trust Region (ESTR, arXiv 2607.22186).

delta = log pi - log mu; H = behavior-side full-vocabulary entropy at the position
score = delta^2 / (H + eps_h), eps_h = 0.01; M = 1[score <= tau] (no gradient through M)
loss = -(1 / #active) * sum_t M_t * S(r_t, A_t; eps_low, eps_high), r = pi / mu
Masked tokens stay in the denominator (the paper's 1/sum active). The paper's rule is a
fixed threshold: ``tau`` (default 1.0; the paper does not publish its value, this default
is ours: |delta| <= 0.1 at H = 0, <= 1 at H = 1). Option: ``target_mask_rate`` sets tau per
batch to the (1 - rate) quantile of the active tokens' scores (then tau is None). An
infinite score (a -inf behavior logprob) is always masked.
The score needs the full-vocabulary entropy. When ``entropy_error_bound`` (per token, from
the rollout's entropy_kind: 0 exact, the top-k estimate's bound otherwise) exceeds
``entropy_error_tolerance`` * (H + eps_h) on an active token, ``on_inexact_entropy``
raises (LossInputError), warns, or ignores it; metric ``entropy_inexact_rate``.
Tokens whose entropy is NaN (engine gave none) are never masked and
counted in ``entropy_missing_rate``. Diagnostics: mask rate; intra = v_last - v_first
within a trajectory and inter = v_target - v_last (means over sequences) when versions,
boundaries and learner_version are given.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor

from .base import LossConfig, TokenLoss
from .inputs import LossInputError, LossInputs
from .fused import fused_token_loss, ppo_metrics, ppo_surrogate
from .ops import indices_above, masked_mean, masked_quantile, quantile_and_tail
from .ppo import ppo_token_loss_ex


class ESTRConfig(LossConfig):
    """ESTR: eps 0.2 both sides, eps_h 0.01, the paper's fixed threshold tau (default 1.0,
    our choice: the paper does not publish it). Exactly one of tau / target_mask_rate is
    set; giving target_mask_rate alone selects the batch-quantile mode (tau -> None)."""

    eps_low: float = Field(0.2, ge=0.0, lt=1.0, description="PPO lower clip.")
    eps_high: float = Field(0.2, ge=0.0, description="PPO upper clip.")
    dual_clip: float | None = Field(
        None, gt=1.0,
        description="Dual clip c (Ye et al. 2020): for A < 0 the token loss is capped at "
                    "c*|A|, so one corrupt token (ratio up to e^20) cannot dominate the "
                    "loss. None (the paper's form) disables it.")
    eps_h: float = Field(0.01, gt=0.0, description="Added to H in the score's denominator.")
    tau: float | None = Field(1.0, ge=0.0, description="Fixed threshold on delta^2/(H+eps_h) "
                                                       "(the paper's rule; value ours).")
    target_mask_rate: float | None = Field(
        None, ge=0.0, lt=1.0,
        description="Batch-quantile mode: set tau per batch to mask about this fraction.")
    entropy_error_tolerance: float = Field(
        0.1, ge=0.0, description="Largest entropy_error_bound / (H + eps_h) accepted on an "
                                 "active token (top-k entropy estimates).")
    on_inexact_entropy: Literal["raise", "warn", "ignore"] = Field(
        "warn", description="What to do when the entropy's error bound exceeds the tolerance.")
    version_diagnostics: bool = Field(
        True, description="Report intra/inter version spread (needs versions and sequence "
                          "boundaries; per-sequence min/max over N, computed once per "
                          "LossInputs and shared by every loss on it).")

    @model_validator(mode="before")
    @classmethod
    def _target_alone_selects_quantile(cls, data: object) -> object:
        if (isinstance(data, dict) and data.get("target_mask_rate") is not None
                and "tau" not in data):
            data = {**data, "tau": None}
        return data

    @model_validator(mode="after")
    def _one_mode(self) -> ESTRConfig:
        if (self.tau is None) == (self.target_mask_rate is None):
            raise ValueError("set exactly one of tau and target_mask_rate "
                             "(pass target_mask_rate=None with tau)")
        return self


def check_entropy_exactness(inputs: LossInputs, cfg: ESTRConfig) -> Tensor:
    """Share of active tokens whose entropy error bound exceeds the tolerance relative to
    H + eps_h (0 when no bound is given); raises or warns per ``cfg.on_inexact_entropy``."""
    n_act = inputs.mask_count
    if inputs.entropy_error_bound is None:
        return torch.zeros_like(n_act)
    b = inputs.flat("entropy_error_bound").detach()
    h = inputs.flat("entropy").detach()
    bad = (b > cfg.entropy_error_tolerance * (h + cfg.eps_h)) & inputs.active & ~torch.isnan(h)
    n_bad = int(bad.sum())
    if n_bad and cfg.on_inexact_entropy != "ignore":
        msg = (f"ESTR: the entropy of {n_bad} active token(s) is a top-k estimate whose error "
               f"bound exceeds {cfg.entropy_error_tolerance} x (H + eps_h): the score "
               "delta^2/(H+eps_h) is unreliable there (serve exact entropy: the engine's "
               "full-vocabulary entropy, or raise the top-k)")
        if cfg.on_inexact_entropy == "raise":
            raise LossInputError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)
    return torch.tensor(float(n_bad), dtype=n_act.dtype) / n_act.clamp_min(1.0)


def estr_scores(delta: Tensor, entropy: Tensor, eps_h: float) -> Tensor:
    """delta^2 / (H + eps_h), detached (NaN where H is NaN)."""
    return delta.detach().square() / (entropy.detach() + eps_h)


def version_spread(inputs: LossInputs) -> dict[str, Tensor]:
    """Mean intra (v_last - v_first) and inter (v_target - v_last) over sequences that have
    active tokens; v_first / v_last = min / max policy_version over the active tokens
    (``LossInputs.seq_version_bounds``: computed once per batch, shared by every call)."""
    bounds = inputs.seq_version_bounds
    if bounds is None or bounds[0].numel() == 0:
        return {}
    first, last = bounds
    n = first.numel()
    out = {"intra_mean": ((last - first).sum() / n).float()}
    if inputs.learner_version is not None:
        out["inter_mean"] = (float(inputs.learner_version) - last.sum() / n).float()
    return out


def estr_reference(inputs: LossInputs, cfg: ESTRConfig) -> TokenLoss:
    """ESTR through eager [N] ops (for tests against the fused ``estr``)."""
    inputs.require("entropy")
    inexact = check_entropy_exactness(inputs, cfg)
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
    metrics["entropy_inexact_rate"] = inexact
    if cfg.version_diagnostics:
        metrics.update(version_spread(inputs))
    return TokenLoss(pg.masked_fill(drop, 0.0), m, metrics)


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
    Missing entropy (NaN, detected by one sum) takes the masked-copy path for tau.
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
            # quantile); NaN where the entropy is missing
            score = torch.mul(d, m).square_().div_(h + cfg.eps_h)
            if not any_missing:
                tau, drop = quantile_and_tail(score, int(n_act), 1.0 - cfg.target_mask_rate)
            else:
                valid = inputs.active & ~missing_b
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
