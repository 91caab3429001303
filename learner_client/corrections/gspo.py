"""GSPO (Zheng et al. 2025, arXiv 2507.18071): sequence-level, length-normalized ratio.

    s_i = exp( (1/|y_i|) sum_t log(pi_t / pi_old_t) )     over the active tokens of sequence i
    loss_i = -S(s_i, A_i; 1 - eps_low, 1 + eps_high)        averaged over sequences
    GSPO-token:  s_it = sg[s_i] * pi_t / sg[pi_t]   (value s_i, token-wise gradient), A_it

A_i = mean of the sequence's active-token advantages (equal to the broadcast sequence
advantage for GRPO-style data). pi_old = ``old_logprobs`` when given, else the behavior
logprobs. Diagnostics: clipfrac (share of sequences clipped; GSPO-token: of tokens),
seq_ratio_mean, approx_kl (mean -log s).
"""

from __future__ import annotations

from pydantic import Field
from torch import Tensor

from .base import Aggregation, ClipConfig, LossConfig, TokenLoss
from .inputs import LossInputs
from .ops import broadcast, masked_mean, safe_exp
from .ppo import clipped_surrogate, dual_clip_cap


class GSPOConfig(ClipConfig):
    """GSPO defaults from the paper (v2, section 5.1): eps_low 3e-4, eps_high 4e-4, no KL.
    Aggregation: mean over sequences of the sequence loss (seq_mean_token_mean)."""

    aggregation: Aggregation = Field("seq_mean_token_mean", description=LossConfig.model_fields[
        "aggregation"].description)
    eps_low: float = Field(3e-4, ge=0.0, lt=1.0, description="Lower clip of the sequence ratio.")
    eps_high: float = Field(4e-4, ge=0.0, description="Upper clip of the sequence ratio.")


def sequence_mean(x: Tensor, inputs: LossInputs) -> tuple[Tensor, Tensor]:
    """(per-token broadcast of each sequence's active-token mean of x, per-seq mean [S])."""
    idx, _ = inputs.seq_index
    per_seq = inputs.seq_sum(x * inputs.mask) / inputs.seq_active_counts.clamp_min(1.0)
    return broadcast(per_seq, idx), per_seq


def sequence_stats(inputs: LossInputs, d: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(log s_i [S] differentiable, A_i [S], active counts [S], token->seq index [N])."""
    idx, _ = inputs.seq_index
    cnt = inputs.seq_active_counts
    m = inputs.mask
    log_s = inputs.seq_sum(d * m) / cnt.clamp_min(1.0)
    adv_i = inputs.seq_sum(inputs.flat("advantages").detach() * m) / cnt.clamp_min(1.0)
    return log_s, adv_i, cnt, idx


def gspo(inputs: LossInputs, cfg: GSPOConfig, surrogate=clipped_surrogate) -> TokenLoss:
    """loss_i = -S(s_i, A_i), broadcast to the sequence's active tokens."""
    m = inputs.mask
    d = inputs.flat("logprobs") - inputs.behavior_or_old()  # log pi_t - log pi_old_t
    log_s, adv_i, cnt, idx = sequence_stats(inputs, d)  # grad flows to every token of seq i
    s, clipped, s_ratio = surrogate(log_s, adv_i, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    loss_i, _ = dual_clip_cap(-s, adv_i, cfg.dual_clip)
    live = (cnt > 0).to(m.dtype)  # sequences with active tokens
    metrics = {
        "clipfrac": masked_mean(clipped, live),
        "seq_ratio_mean": masked_mean(s_ratio, live),
        "approx_kl": -masked_mean(log_s.detach(), live),
    }
    return TokenLoss(broadcast(loss_i, idx) * m, m, metrics)


def gspo_token(inputs: LossInputs, cfg: GSPOConfig, surrogate=clipped_surrogate) -> TokenLoss:
    """loss_t = -S(s_it, A_t), s_it = sg[s_i] * pi_t / sg[pi_t]."""
    m = inputs.mask
    log_pi = inputs.flat("logprobs")
    adv = inputs.flat("advantages")
    log_s, _ = sequence_mean((log_pi - inputs.behavior_or_old()).detach(), inputs)  # sg[log s_i]
    log_s_it = log_s + log_pi - log_pi.detach()  # s_it = sg[s_i] * pi_t / sg[pi_t]
    s, clipped, _ = surrogate(log_s_it, adv, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    loss, _ = dual_clip_cap(-s, adv, cfg.dual_clip)
    metrics = {
        "clipfrac": masked_mean(clipped, m),
        "seq_ratio_mean": masked_mean(safe_exp(log_s), m),
        "approx_kl": masked_mean(-log_s, m),
    }
    return TokenLoss(loss * m, m, metrics)
