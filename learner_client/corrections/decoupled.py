"""Decoupled corrections: the ratio decomposition pi/mu = r_d * r_s, proximal policies,
AReaL's decoupled PPO and PPO-EWMA.

r_d = pi_prox / mu  (training-inference discrepancy; detached weight M_d(r_d))
r_s = pi / pi_prox  (staleness; PPO's asymmetric clip)
loss_t = -M_d(r_d) * S(r_s, A; eps_low, eps_high)   (optionally dual-clipped)

``ratio_mode`` picks pi_prox and r_d (arXiv 2605.12070 variants):
* ``decoupled``: pi_prox = pi_old (``old_logprobs``: snapshot recompute, a dedicated
  old-logit model, interruption-time logits, or EWMA weights), r_d weighted by M_d.
* ``ppo``: pi_prox = pi_old, r_d = 1.
* ``bypass``: pi_prox = mu, r_d = 1 (r_s = pi/mu).
* ``loglinear``: AReaL's log-linear proximal from per-token versions:
  log pi_prox = log mu + alpha (log pi - log mu), alpha = (v_prox - v_behave)/(v_theta -
  v_behave), v_theta = learner_version, v_prox = v_theta - 1, alpha clamped to [0, 1] and 0
  where v_theta <= v_behave or v_behave < 0; r_d = pi_prox/mu weighted by M_d.
* ``linear_prox``: pi_prox = a mu + (1-a) pi (probability space), a = ``prox_mix`` or
  1 - alpha from versions when prox_mix is None; r_d = 1.
pi_prox is always detached (it is a fixed anchor, the gradient flows only through pi).

M_d(r_d) (``discrepancy``): ``cap_mask`` (AReaL: r_d, or 0 where r_d > cap, cap 5),
``mask`` (r_d inside [1/c, c], else 0), ``truncate`` (clamp(r_d, 1/c, c)), ``none`` (1).
Zeroed tokens stay in the denominator (AReaL's token mean over the loss mask).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from .base import ClipConfig, TokenLoss
from .inputs import LossInputError, LossInputs
from .ops import masked_mean, safe_exp
from .ppo import ppo_token_loss


def version_alpha(versions: Tensor, learner_version: int,
                  dtype: torch.dtype = torch.float32) -> Tensor:
    """alpha = (v_prox - v_behave)/(v_theta - v_behave), v_prox = v_theta - 1, in [0, 1].

    Since v_prox = v_theta - 1, alpha = 1 - 1/(v_theta - v_behave) for a lag >= 1.
    0 where v_theta - v_behave <= 0 (fresh or future tokens) or v_behave < 0 (no version).
    """
    lag = (int(learner_version) - versions).to(dtype)
    alpha = 1.0 - 1.0 / lag.clamp_min(1.0)  # lag 1 -> 0, lag 2 -> 1/2, lag 4 -> 3/4
    return alpha.masked_fill_(versions < 0, 0.0)


def loglinear_proximal(logprobs: Tensor, rollout_logprobs: Tensor, versions: Tensor,
                       learner_version: int) -> tuple[Tensor, Tensor]:
    """(log pi_prox detached, alpha) with log pi_prox = log mu + alpha (log pi - log mu)."""
    alpha = version_alpha(versions, learner_version, logprobs.dtype)
    mu = rollout_logprobs.detach()
    return (mu + alpha * (logprobs.detach() - mu)), alpha


def linear_proximal(logprobs: Tensor, rollout_logprobs: Tensor, a: Tensor | float
                    ) -> Tensor:
    """log pi_prox (detached) with pi_prox = a * mu + (1 - a) * pi, computed in log space."""
    mu = rollout_logprobs.detach()
    lp = logprobs.detach()
    a_t = torch.as_tensor(a, dtype=lp.dtype, device=lp.device).clamp(0.0, 1.0)
    # log(a e^mu + (1-a) e^lp) = logaddexp(log a + mu, log(1-a) + lp), safe at a in {0, 1}
    return torch.logaddexp(mu + torch.log(a_t), lp + torch.log1p(-a_t))


class DecoupledPPOConfig(ClipConfig):
    """AReaL decoupled PPO (Fu et al. 2025) with the r_d x r_s decomposition of arXiv
    2605.12070. Defaults: eps 0.2 both sides (PPO's clip on r = r_s), behavior weight cap 5
    (cap_mask), no dual clip. Aggregation: token mean over active tokens (masked/capped
    tokens stay in it)."""

    ratio_mode: Literal["decoupled", "ppo", "bypass", "loglinear", "linear_prox"] = Field(
        "decoupled", description="How pi_prox and r_d are formed (see module docstring).")
    discrepancy: Literal["cap_mask", "mask", "truncate", "none"] = Field(
        "cap_mask", description="M_d applied to r_d = pi_prox/mu.")
    behav_imp_weight_cap: float = Field(
        5.0, gt=0.0, description="cap_mask: r_d above this gets weight 0 (AReaL default 5).")
    discrepancy_c: float = Field(
        2.0, gt=1.0, description="mask/truncate: keep r_d within [1/c, c].")
    prox_mix: float | None = Field(
        None, ge=0.0, le=1.0,
        description="linear_prox: a in pi_prox = a*mu + (1-a)*pi; None = 1 - alpha(versions).")


def proximal_logprobs(inputs: LossInputs, cfg: DecoupledPPOConfig
                      ) -> tuple[Tensor, bool, dict[str, Tensor]]:
    """(log pi_prox [N] detached, whether r_d is applied, extra metrics) for cfg.ratio_mode."""
    mode = cfg.ratio_mode
    logp = inputs.flat("logprobs")
    mu = inputs.flat("rollout_logprobs").detach()
    extra: dict[str, Tensor] = {}
    if mode in ("decoupled", "ppo"):
        return inputs.require_old(), mode == "decoupled", extra
    if mode == "bypass":
        return mu, False, extra
    need_versions = mode == "loglinear" or cfg.prox_mix is None
    if need_versions and (inputs.versions is None or inputs.learner_version is None):
        raise LossInputError(f"ratio_mode={mode!r} needs versions and learner_version")
    if mode == "loglinear":
        prox, alpha = loglinear_proximal(logp, mu, inputs.flat("versions"), inputs.learner_version)
        extra["alpha_mean"] = masked_mean(alpha, inputs.mask)
        return prox, True, extra
    if cfg.prox_mix is not None:
        a: Tensor | float = cfg.prox_mix
    else:
        a = 1.0 - version_alpha(inputs.flat("versions"), inputs.learner_version, logp.dtype)
    return linear_proximal(logp, mu, a), False, extra


def discrepancy_weight(log_rd: Tensor, cfg: DecoupledPPOConfig) -> tuple[Tensor, Tensor | None]:
    """(M_d(r_d) detached, dropped bool or None) for the configured rule."""
    if cfg.discrepancy == "none":
        return torch.ones_like(log_rd), None
    r_d = safe_exp(log_rd)
    if cfg.discrepancy == "cap_mask":  # AReaL: r_d, 0 above the cap
        drop = log_rd > math.log(cfg.behav_imp_weight_cap)
        return r_d.masked_fill_(drop, 0.0), drop
    lc = math.log(cfg.discrepancy_c)
    if cfg.discrepancy == "mask":  # r_d inside [1/c, c], else 0
        drop = log_rd.abs() > lc
        return r_d.masked_fill_(drop, 0.0), drop
    return torch.clamp(r_d, 1.0 / cfg.discrepancy_c, cfg.discrepancy_c), None  # truncate


def decoupled_ppo(inputs: LossInputs, cfg: DecoupledPPOConfig) -> TokenLoss:
    """loss_t = -M_d(r_d,t) * S(r_s,t, A_t; eps_low, eps_high), r_s = pi/pi_prox, r_d =
    pi_prox/mu (M_d = 1 where the mode applies no r_d). Diagnostics: PPO's on r_s,
    behav_weight_mean (mean M_d), behav_mask_rate (share M_d zeroes) and
    active_token_fraction (share neither zeroed by M_d nor clipped)."""
    m = inputs.mask
    log_prox, use_rd, metrics = proximal_logprobs(inputs, cfg)  # log pi_prox, detached
    w = dropped = None
    if use_rd:
        w, dropped = discrepancy_weight(log_prox - inputs.flat("rollout_logprobs").detach(), cfg)
        metrics["behav_weight_mean"] = masked_mean(w, m)
    loss, clipped, ppo_metrics = ppo_token_loss(
        inputs.flat("logprobs"), log_prox, inputs.flat("advantages"), m, 1.0 - cfg.eps_low,
        1.0 + cfg.eps_high, cfg.dual_clip, weight=w)
    metrics.update(ppo_metrics)
    if dropped is None:
        metrics["behav_mask_rate"] = torch.zeros((), dtype=m.dtype, device=m.device)
        metrics["active_token_fraction"] = 1.0 - masked_mean(clipped, m)
    else:
        metrics["behav_mask_rate"] = masked_mean(dropped, m)
        metrics["active_token_fraction"] = 1.0 - masked_mean(dropped | clipped, m)
    return TokenLoss(loss, m, metrics)


class PPOEWMAConfig(ClipConfig):
    """PPO-EWMA (Hilton, Cobbe, Schulman 2021, "Batch size-invariance for policy
    optimization"): -E[(pi_prox/mu) * S(pi/pi_prox, A)], pi_prox from the EWMA weights
    (pass its logprobs as ``old_logprobs``, see old_logits.EwmaWeightTracker), total ratio
    pi/mu capped at imp_samp_max = 100 by raising log mu to sg[log pi] - log(imp_samp_max).
    PPO's clip on r = pi/pi_prox. Aggregation: token mean over active tokens."""

    imp_samp_max: float | None = Field(
        100.0, gt=1.0, description="Cap of the total ratio pi/mu; None disables it.")


def ppo_ewma(inputs: LossInputs, cfg: PPOEWMAConfig, token_loss=ppo_token_loss) -> TokenLoss:
    """loss_t = -(pi_prox/mu) * S(pi/pi_prox, A), the total ratio pi/mu capped."""
    m = inputs.mask
    log_pi = inputs.flat("logprobs")
    log_prox = inputs.require_old()
    mu = inputs.flat("rollout_logprobs").detach()
    mu_capped = mu  # pi/mu <= imp_samp_max: raise log mu to sg[log pi] - log(imp_samp_max)
    if cfg.imp_samp_max is not None:
        mu_capped = torch.maximum(mu, log_pi.detach() - math.log(cfg.imp_samp_max))
    w = safe_exp(log_prox - mu_capped)  # pi_prox / mu, detached, > 0
    loss, _, metrics = token_loss(log_pi, log_prox, inputs.flat("advantages"), m,
                                  1.0 - cfg.eps_low, 1.0 + cfg.eps_high, cfg.dual_clip,
                                  weight=w)
    metrics["behav_weight_mean"] = masked_mean(w, m)
    if cfg.imp_samp_max is not None:
        metrics["imp_samp_clipfrac"] = masked_mean(
            log_pi.detach() - mu > math.log(cfg.imp_samp_max), m)
    metrics["active_token_fraction"] = 1.0 - metrics["clipfrac"]
    return TokenLoss(loss, m, metrics)


class RevisedPPOEWMAConfig(ClipConfig):
    """Revised PPO-EWMA (arXiv 2605.12070, after Hilton et al. 2021) as one loss: the
    decoupled ratio with the EWMA proximal policy. ``old_logprobs`` = log pi_prox under the
    debiased EWMA weights (``learner_client.old_logits.RevisedPPOEWMA`` fills it and keeps
    the weights), r_d = pi_prox/mu with the discrepancy mask M_d(r_d) = r_d inside
    [1/c, c], 0 outside; r_s = pi/pi_prox with PPO's clip:
        loss = -(1/#active) sum_t M_d(r_d,t) S(r_s,t, A_t; eps_low, eps_high).
    Metrics for the wiring: ``active_token_fraction`` (kept by M_d and not clipped),
    ``ewma_reset`` (1 when that fraction < reset_threshold: theta_prox <- theta),
    ``ewma_window`` (W_stale = max observed lag + 1 over the active tokens, when versions
    and learner_version are given) and ``ewma_beta`` = W_stale / (W_stale + 2)."""

    discrepancy_c: float = Field(2.0, gt=1.0, description="Keep r_d within [1/c, c].")
    reset_threshold: float = Field(
        0.9, ge=0.0, le=1.0, description="Reset theta_prox <- theta when the active-token "
                                         "fraction after masking and clipping drops below.")


def ppo_ewma_revised(inputs: LossInputs, cfg: RevisedPPOEWMAConfig,
                     decoupled=decoupled_ppo) -> TokenLoss:
    """decoupled_ppo (decoupled ratio, r_d mask [1/c, c]) plus the EWMA wiring's metrics."""
    base = DecoupledPPOConfig(eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                              dual_clip=cfg.dual_clip, ratio_mode="decoupled",
                              discrepancy="mask", discrepancy_c=cfg.discrepancy_c,
                              aggregation=cfg.aggregation,
                              constant_normalizer=cfg.constant_normalizer, backend=cfg.backend)
    tok = decoupled(inputs, base)
    frac = tok.metrics["active_token_fraction"]
    tok.metrics["ewma_reset"] = (frac < cfg.reset_threshold).to(frac.dtype) * (
        inputs.mask_count > 0)
    if inputs.versions is not None and inputs.learner_version is not None:
        w = observed_window(inputs.flat("versions"), inputs.learner_version, inputs.active)
        tok.metrics["ewma_window"] = torch.tensor(float(w))
        tok.metrics["ewma_beta"] = torch.tensor(w / (w + 2.0))
    return tok


def observed_window(versions: Tensor, learner_version: int, active: Tensor) -> int:
    """W_stale = S + 1, S = max lag learner_version - version over the active tokens with a
    version (>= 0): the width of the live version window [v_theta - S, v_theta]."""
    v = versions.reshape(-1)
    keep = active.reshape(-1) & (v >= 0)
    if not bool(keep.any()):
        return 1
    s = int(learner_version) - int(v[keep].min())
    return max(s, 0) + 1
