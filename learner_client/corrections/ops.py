"""Small pure tensor helpers shared by the losses (all [N] tensors, no N x vocab)."""

from __future__ import annotations

import torch
from torch import Tensor

# Log-ratios are clamped before exp so a wild token cannot overflow to inf.
LOG_RATIO_CLAMP = 20.0


def safe_exp(log_ratio: Tensor) -> Tensor:
    return torch.exp(torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over mask (0 when the mask is empty). Detach the result for metrics."""
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


def clipped_surrogate(ratio: Tensor, adv: Tensor, eps_low: Tensor | float,
                      eps_high: Tensor | float) -> tuple[Tensor, Tensor]:
    """PPO's S(r, A; lo, hi) = min(r*A, clip(r, 1-lo, 1+hi)*A) and the clipped indicator.

    ``eps_low``/``eps_high`` may be per-token tensors (SAT). Returns (S, clipped) where
    clipped is 1.0 where the clipped branch is strictly the smaller one (the gradient is 0).
    """
    lo = 1.0 - eps_low
    hi = 1.0 + eps_high
    if isinstance(lo, Tensor) or isinstance(hi, Tensor):
        clipped_ratio = torch.minimum(torch.maximum(ratio, torch.as_tensor(lo, dtype=ratio.dtype)),
                                      torch.as_tensor(hi, dtype=ratio.dtype))
    else:
        clipped_ratio = torch.clamp(ratio, lo, hi)
    unclipped = ratio * adv
    clipped = clipped_ratio * adv
    s = torch.minimum(unclipped, clipped)
    return s, (clipped < unclipped).to(ratio.dtype).detach()


def seg_sum(x: Tensor, index: Tensor, num: int) -> Tensor:
    """Per-segment sums: out[s] = sum_{i: index[i]=s} x[i] (differentiable)."""
    return torch.zeros(num, dtype=x.dtype, device=x.device).index_add(0, index, x)


def seg_masked_mean(x: Tensor, mask: Tensor, index: Tensor, num: int) -> tuple[Tensor, Tensor]:
    """(per-segment mean of x over active tokens [S], active count per segment [S])."""
    cnt = seg_sum(mask, index, num)
    return seg_sum(x * mask, index, num) / cnt.clamp_min(1.0), cnt


def masked_quantile(x: Tensor, mask: Tensor, q: float) -> Tensor:
    """q-quantile (linear interpolation, like torch.quantile) of x over active tokens.

    Uses kthvalue on the selected values (torch.quantile caps its input at 16M elements
    and sorts; kthvalue is a selection). Returns 0 when no token is active.
    """
    vals = x.detach()[mask > 0]
    n = vals.numel()
    if n == 0:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    pos = q * (n - 1)
    lo_i = int(pos)
    frac = pos - lo_i
    lo_v = torch.kthvalue(vals, lo_i + 1).values
    if frac == 0.0 or lo_i + 1 >= n:
        return lo_v
    hi_v = torch.kthvalue(vals, lo_i + 2).values
    return lo_v + (hi_v - lo_v) * frac
