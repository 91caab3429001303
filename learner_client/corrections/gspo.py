"""GSPO (Zheng et al. 2025, arXiv 2507.18071): sequence-level, length-normalized ratio.

s_i = exp( (1/|y_i|) * sum_t log(pi_t / pi_old_t) ) over the active tokens of sequence i,
loss_i = -S(s_i, A_i; 3e-4, 4e-4), averaged over sequences. A_i = mean of the sequence's
active-token advantages (equal to the broadcast sequence advantage for GRPO-style data).
GSPO-token: s_it = sg[s_i] * pi_t / sg[pi_t] (same value as s_i, token-wise gradient) with
per-token A_it. pi_old = ``old_logprobs`` when given, else the behavior logprobs.
"""

from __future__ import annotations

from pydantic import Field
from torch import Tensor

from .base import Aggregation, LossConfig, TokenLoss
from .inputs import LossInputs
from .ops import broadcast, clipped_surrogate, dual_clip_cap, masked_mean, safe_exp


class GSPOConfig(LossConfig):
    """GSPO defaults from the paper (v2, section 5.1): eps_low 3e-4, eps_high 4e-4, no KL.
    Aggregation: mean over sequences of the sequence loss (seq_mean_token_mean)."""

    aggregation: Aggregation = Field("seq_mean_token_mean", description=LossConfig.model_fields[
        "aggregation"].description)
    eps_low: float = Field(3e-4, ge=0.0, lt=1.0, description="Lower clip of the sequence ratio.")
    eps_high: float = Field(4e-4, ge=0.0, description="Upper clip of the sequence ratio.")
    dual_clip: float | None = Field(
        None, gt=1.0,
        description="Dual clip c (Ye et al. 2020): for A < 0 the token loss is capped at "
                    "c*|A|, so one corrupt token (ratio up to e^20) cannot dominate the "
                    "loss. None (the paper's form) disables it.")


def sequence_mean(x: Tensor, inputs: LossInputs) -> tuple[Tensor, Tensor]:
    """(per-token broadcast of each sequence's active-token mean of x, per-seq mean [S])."""
    idx, _ = inputs.seq_index
    per_seq = inputs.seq_sum(x * inputs.mask) / inputs.seq_active_counts.clamp_min(1.0)
    return broadcast(per_seq, idx), per_seq


def _seq_metrics(log_s_tok: Tensor, clipped: Tensor, m: Tensor) -> dict[str, Tensor]:
    return {
        "clipfrac": masked_mean(clipped, m),
        "seq_ratio_mean": masked_mean(safe_exp(log_s_tok.detach()), m),
        "approx_kl": masked_mean(-log_s_tok.detach(), m),
    }


def sequence_stats(inputs: LossInputs, d: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(log s_i [S] differentiable, A_i [S], active counts [S], token->seq index [N])."""
    idx, _ = inputs.seq_index
    cnt = inputs.seq_active_counts
    m = inputs.mask
    log_s = inputs.seq_sum(d * m) / cnt.clamp_min(1.0)
    adv_i = inputs.seq_sum(inputs.flat("advantages").detach() * m) / cnt.clamp_min(1.0)
    return log_s, adv_i, cnt, idx


def gspo(inputs: LossInputs, cfg: GSPOConfig) -> TokenLoss:
    m = inputs.mask
    d = inputs.flat("logprobs") - inputs.behavior_or_old()
    log_s, adv_i, cnt, idx = sequence_stats(inputs, d)  # grad flows to every token of seq i
    s_i, clipped, r = clipped_surrogate(log_s, adv_i, cfg.eps_low, cfg.eps_high)
    live = (cnt > 0).to(m.dtype)
    n_seq = live.sum()
    metrics = {
        "clipfrac": masked_mean(clipped, live, n_seq),  # share of sequences clipped
        "seq_ratio_mean": masked_mean(r, live, n_seq),
        "approx_kl": -masked_mean(log_s.detach(), live, n_seq),
    }
    pg_i = dual_clip_cap(-s_i, adv_i, cfg.dual_clip)
    return TokenLoss(broadcast(pg_i, idx) * m, m, metrics)


def gspo_token(inputs: LossInputs, cfg: GSPOConfig) -> TokenLoss:
    m = inputs.mask
    logp = inputs.flat("logprobs")
    d = logp - inputs.behavior_or_old()
    log_s, _ = sequence_mean(d.detach(), inputs)
    log_s_it = log_s + logp - logp.detach()
    s, clipped, _ = clipped_surrogate(log_s_it, inputs.flat("advantages"),
                                      cfg.eps_low, cfg.eps_high)
    pg = dual_clip_cap(-s, inputs.flat("advantages"), cfg.dual_clip)
    return TokenLoss(pg * m, m, _seq_metrics(log_s, clipped, m))
