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

from .base import ClipConfig, TokenLoss
from .inputs import LossInputError, LossInputs
from .ops import masked_mean, masked_quantile
from .ppo import ppo_token_loss


class ESTRConfig(ClipConfig):
    """ESTR: eps 0.2 both sides, eps_h 0.01, the paper's fixed threshold tau (default 1.0,
    our choice: the paper does not publish it). Exactly one of tau / target_mask_rate is
    set; giving target_mask_rate alone selects the batch-quantile mode (tau -> None).
    PPO's clip on r = pi/mu."""

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
        warnings.warn(msg, RuntimeWarning, stacklevel=5)  # at compute_loss
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


def estr_threshold(score: Tensor, inputs: LossInputs, cfg: ESTRConfig) -> Tensor:
    """tau: the configured one, or per batch the (1 - target_mask_rate) quantile of the
    scores of the active tokens that have an entropy."""
    if cfg.tau is not None:
        return torch.tensor(cfg.tau, dtype=score.dtype, device=score.device)
    return masked_quantile(score, None, 1.0 - cfg.target_mask_rate,
                           inputs.active & ~torch.isnan(score))


def estr(inputs: LossInputs, cfg: ESTRConfig) -> TokenLoss:
    """loss_t = -M_t * S(r_t, A_t; eps_low, eps_high), r = pi/mu, M = 1[score <= tau]."""
    inputs.require("entropy")
    inexact = check_entropy_exactness(inputs, cfg)
    m = inputs.mask
    mu = inputs.flat("rollout_logprobs").detach()
    h = inputs.flat("entropy").detach()
    log_pi = inputs.flat("logprobs")
    score = estr_scores(log_pi - mu, h, cfg.eps_h)  # delta^2 / (H + eps_h); NaN where no H
    tau = estr_threshold(score, inputs, cfg)
    # M = 1[score <= tau]: NaN > tau is False (missing entropy is never masked); an infinite
    # score (a -inf behavior logprob) is always masked, whatever tau
    drop = (score > tau) | torch.isposinf(score)
    loss, _, metrics = ppo_token_loss(log_pi, mu, inputs.flat("advantages"), m,
                                      1.0 - cfg.eps_low, 1.0 + cfg.eps_high, cfg.dual_clip)
    metrics["mask_rate"] = masked_mean(drop, m)
    metrics["tau"] = tau.detach().to(torch.float32)
    metrics["entropy_missing_rate"] = masked_mean(torch.isnan(h), m)
    metrics["entropy_inexact_rate"] = inexact
    if cfg.version_diagnostics:
        metrics.update(version_spread(inputs))
    return TokenLoss(loss.masked_fill(drop, 0.0), m, metrics)  # masked: still in the denominator
