"""Fused token losses: one autograd node per loss, closed-form elementwise gradient.

Every token-level loss here has the form ``pg_t = f_t(log pi_t)`` (each token's loss depends
on its own log pi only; thresholds such as SAT's q or ESTR's tau are stop-gradient). So one
``torch.autograd.Function`` computes ``pg`` and ``dpg/dlog pi`` together in the forward (no
graph of ~15 eager ops, no intermediate tensors kept for autograd) and the backward is one
multiply ``grad_out * dpg``.

The PPO surrogate is computed with the negated, weighted advantage ``nA = -A*w``
(w = loss_mask, times a detached per-token weight where the method has one, w >= 0):

    -S(r, A) * w = max(r*nA, clip(r, lo, hi)*nA),   d/dlog pi = r*nA where r*nA >= clip*nA,
                                                     0 where the clipped branch wins

which equals the unfused ``-min(r*A, clip(r)*A) * w`` exactly for w in {0, 1} (a sign flip is
exact) and up to float reassociation for other weights. ``clipped`` is False where w == 0.

Pure PyTorch, [N] tensors only (no N x vocab); CPU or any device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .ops import LOG_RATIO_CLAMP

Kernel = Callable[[Tensor], tuple[Tensor, Tensor]]


class _FusedTokenLoss(torch.autograd.Function):
    """pg = kernel(x)[0] with elementwise derivative kernel(x)[1] (saved, [N])."""

    @staticmethod
    def forward(ctx, x, kernel):  # type: ignore[override]
        pg, grad = kernel(x)
        ctx.save_for_backward(grad)
        return pg

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        if grad_out.dim() == 1 and grad_out.stride() == (0,) and grad_out.numel() > 0:
            # expanded scalar (the usual sum() upstream): one multiply by a 0-dim tensor
            return grad * grad_out[0], None
        return grad_out * grad, None


def fused_token_loss(x: Tensor, kernel: Kernel) -> Tensor:
    """Per-token loss [N] = kernel(x)[0] whose gradient w.r.t. x is grad_out * kernel(x)[1].

    ``kernel`` runs without autograd on x's values and must return (loss [N], dloss/dx [N]),
    both fresh tensors. Valid only when loss_t depends on x_t alone.
    """
    return _FusedTokenLoss.apply(x, kernel)


def safe_exp_(d: Tensor, bounds: tuple[float, float] | None = None) -> Tensor:
    """exp(clamp(d, -C, C)) in place on d (the clamp pass only when some |d| > C).
    ``bounds``: (min, max) of d when the caller already has them."""
    if d.numel() == 0:
        return d
    lo, hi = torch.aminmax(d) if bounds is None else bounds
    if bool(lo < -LOG_RATIO_CLAMP) or bool(hi > LOG_RATIO_CLAMP):
        d.clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return d.exp_()


@dataclass
class Surrogate:
    """Results of ``ppo_surrogate`` (all detached)."""

    pg: Tensor  # [N] -S(r, A) * w
    grad: Tensor  # [N] d pg / d log-ratio
    clipped: Tensor  # bool [N]: clipped branch strictly smaller (False where w == 0)
    r: Tensor  # [N] ratio exp(clamped log-ratio)
    kl_sum: Tensor  # sum_t m_t * d_t (0-dim)
    ratio_sum: Tensor  # sum_t m_t * r_t (0-dim)


ClampFix = Callable[[Tensor, Tensor], None]  # (clip(r) in place, r) -> None


def ppo_surrogate(d: Tensor, adv: Tensor, m: Tensor, lo: float, hi: float,
                  weight: Tensor | None = None, dual_clip: float | None = None,
                  fix_clamp: ClampFix | None = None, nA: Tensor | None = None,
                  own_d: bool = False, kl_sum: Tensor | None = None) -> Surrogate:
    """PPO's surrogate on log-ratios d [N] (no autograd; call inside a kernel).

    ``weight`` (detached, >= 0) multiplies the per-token loss (folded into nA = -A*m*w).
    ``fix_clamp(rc, r)`` may edit clip(r) in place before it meets the advantage (SAT's
    per-token bounds on a subset). ``own_d``: d may be overwritten (saves a copy).
    ``kl_sum``: sum_t m_t d_t when the caller already has it.
    """
    if kl_sum is None:
        kl_sum = torch.dot(d, m)
    r = safe_exp_(d if own_d else d.clone())
    ratio_sum = torch.dot(r, m)
    if nA is None:
        if weight is None:
            nA = torch.mul(adv, m).neg_()
        else:
            nA = torch.mul(adv, weight).neg_()
    un = r * nA
    rc = torch.clamp(r, lo, hi)
    if fix_clamp is not None:
        fix_clamp(rc, r)
    cl = rc.mul_(nA)
    clipped = cl > un
    pg = torch.maximum(un, cl, out=cl)
    grad = un.masked_fill_(clipped, 0.0)
    if dual_clip is not None:
        cap = nA * dual_clip  # -c*A*w; binds only for A < 0 (nA > 0)
        capped = (pg > cap).logical_and_(nA > 0)
        pg = torch.where(capped, cap, pg)
        grad.masked_fill_(capped, 0.0)
        return _DualSurrogate(pg, grad, clipped, r, kl_sum, ratio_sum, capped)
    return Surrogate(pg, grad, clipped, r, kl_sum, ratio_sum)


@dataclass
class _DualSurrogate(Surrogate):
    capped: Tensor | None = None  # bool [N]: dual clip binds


def ppo_metrics(s: Surrogate, count: Tensor) -> dict[str, Tensor]:
    """clipfrac, approx_kl, ratio_mean (and dual_clipfrac) as the unfused PPO reports them."""
    den = count.clamp_min(1.0)
    dt = s.r.dtype
    out = {
        "clipfrac": torch.count_nonzero(s.clipped).to(dt) / den,
        "approx_kl": -s.kl_sum / den,
        "ratio_mean": s.ratio_sum / den,
    }
    capped = getattr(s, "capped", None)
    if capped is not None:
        out["dual_clipfrac"] = torch.count_nonzero(capped).to(dt) / den
    return out
