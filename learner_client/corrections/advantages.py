"""Group advantage estimators (outcome rewards, one scalar per sampled response) and the
DAPO data-side rules. Inputs are rewards [B, G] (B prompts x G samples) or flat [M] with
``group_ids`` [M]; outputs have the rewards' shape. Broadcast to tokens with
``broadcast_to_tokens``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .inputs import LossInputError


def _group_stats(rewards: Tensor, group_ids: Tensor | None, unbiased: bool
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """(per-sample group mean, per-sample group std, per-sample group size)."""
    r = rewards.to(torch.float64)
    if group_ids is None:
        if r.dim() == 1:
            r = r.unsqueeze(0)
        if r.dim() != 2:
            raise LossInputError("rewards must be [B, G] or [M] with group_ids")
        g = r.shape[1]
        mean = r.mean(dim=1, keepdim=True)
        var = ((r - mean) ** 2).sum(dim=1, keepdim=True) / max(g - (1 if unbiased else 0), 1)
        size = torch.full_like(r, float(g))
        return (mean.expand_as(r).reshape(rewards.shape), var.sqrt().expand_as(r).reshape(
            rewards.shape), size.reshape(rewards.shape))
    if r.dim() != 1 or group_ids.shape != r.shape:
        raise LossInputError("with group_ids, rewards and group_ids must both be [M]")
    _, inv = torch.unique(group_ids, return_inverse=True)
    k = int(inv.max().item()) + 1 if inv.numel() else 0
    cnt = torch.zeros(k, dtype=torch.float64).index_add(0, inv, torch.ones_like(r))
    mean = torch.zeros(k, dtype=torch.float64).index_add(0, inv, r) / cnt
    sq = torch.zeros(k, dtype=torch.float64).index_add(0, inv, (r - mean[inv]) ** 2)
    var = sq / (cnt - (1 if unbiased else 0)).clamp_min(1.0)
    return mean[inv], var.sqrt()[inv], cnt[inv]


def grpo_advantages(rewards: Tensor, group_ids: Tensor | None = None, eps: float = 1e-6,
                    unbiased_std: bool = True) -> Tensor:
    """GRPO: A_i = (R_i - mean(R_group)) / (std(R_group) + eps)."""
    mean, std, _ = _group_stats(rewards, group_ids, unbiased_std)
    return ((rewards.to(torch.float64) - mean) / (std + eps)).to(rewards.dtype)


def dr_grpo_advantages(rewards: Tensor, group_ids: Tensor | None = None) -> Tensor:
    """Dr.GRPO: A_i = R_i - mean(R_group) (no std division)."""
    mean, _, _ = _group_stats(rewards, group_ids, False)
    return (rewards.to(torch.float64) - mean).to(rewards.dtype)


def dapo_dynamic_sampling_keep(rewards: Tensor, group_ids: Tensor | None = None) -> Tensor:
    """DAPO dynamic sampling: True for samples whose group's rewards are not all equal
    (groups with accuracy 0 or 1 give zero advantage and are filtered out / resampled)."""
    _, std, size = _group_stats(rewards, group_ids, False)
    return (std > 0) & (size > 1)


def overlong_penalty(lengths: Tensor, max_len: int, cache_len: int) -> Tensor:
    """DAPO soft overlong punishment added to the reward: 0 if L <= L_max - L_cache,
    (L_max - L_cache - L) / L_cache inside the cache window, -1 beyond L_max."""
    if cache_len <= 0 or cache_len > max_len:
        raise LossInputError("need 0 < cache_len <= max_len")
    L = lengths.to(torch.float64)
    start = max_len - cache_len
    pen = torch.where(L <= start, torch.zeros_like(L), (start - L) / cache_len)
    return torch.where(L > max_len, torch.full_like(L, -1.0), pen)


def broadcast_to_tokens(seq_values: Tensor, seq_index: Tensor) -> Tensor:
    """Per-token tensor [N] from per-sequence values [S] and each token's sequence index."""
    return seq_values[seq_index]
