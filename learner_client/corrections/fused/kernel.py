"""The fused primitives: one autograd node per loss, closed-form elementwise gradient.

Every token-level loss has the form ``pg_t = f_t(log pi_t)`` (each token's loss depends on
its own log pi only; thresholds such as SAT's q or ESTR's tau are stop-gradient). So one
``torch.autograd.Function`` computes ``pg`` and ``dpg/dlog pi`` together in the forward (no
graph of ~15 eager ops, no intermediate tensors kept for autograd) and the backward is one
multiply ``grad_out * dpg``.

The PPO surrogate is computed with the negated, weighted advantage ``nA = -A*w``
(w = loss_mask, times a detached per-token weight where the method has one, w >= 0):

    -S(r, A) * w = max(r*nA, clip(r, lo, hi)*nA),   d/dlog pi = r*nA where r*nA >= clip*nA,
                                                     0 where the clipped branch wins

which equals the reference ``-min(r*A, clip(r)*A) * w`` exactly for w in {0, 1} (a sign flip
is exact) and up to float reassociation for other weights. ``clipped`` is False where
w == 0. Like the reference, r = exp(clamp(d, -20, 20)) and the gradient is 0 where that
clamp binds.

Off the clipped branch the derivative is the loss itself (d/dlog pi of r*nA is r*nA). A
token with |log r| <= ``clip_free_bound`` (~0.18 for eps 0.2) is never clipped, so where
a loss knows that only a few tokens can pass it (SAT's tail when q is below it; ESTR's
masked tokens and the few large |d|), ``ppo_on_subset`` computes r*nA over N, PPO's clip
on those tokens only, and the gradient as ``GradIsLoss`` (the saved loss with zeros at
the clipped entries): no clamp, compare, maximum, fill or count over N.

``fused_ppo_token_loss`` and ``fused_clipped_surrogate`` have the signatures and results of
the readable ``ppo.ppo_token_loss`` and ``ppo.clipped_surrogate``: the losses built on them
take the fused one as an argument (see fused/__init__.py).

Pure PyTorch, [N] tensors only (no N x vocab); CPU or any device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..ops import LOG_RATIO_CLAMP, compress, gather, scatter_

Kernel = Callable[[Tensor], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class GradIsLoss:
    """A kernel's derivative given as "d pg/dx = pg, except 0 at ``zero``" (long indices).

    PPO's unclipped branch has pg = r*nA = exp(x - base)*nA, whose derivative is pg itself:
    a kernel whose clipped tokens are few and known (SAT's tail) returns this instead of a
    dense [N] gradient, and the backward multiplies the saved loss (no [N] buffer for it)."""

    zero: Tensor


class _FusedTokenLoss(torch.autograd.Function):
    """pg = kernel(x)[0] with elementwise derivative kernel(x)[1] (saved, [N]; or
    ``GradIsLoss``: pg itself with zeros at a few indices)."""

    @staticmethod
    def forward(ctx, x, kernel):  # type: ignore[override]
        pg, grad = kernel(x)
        ctx.grad_is_loss = isinstance(grad, GradIsLoss)
        ctx.save_for_backward(*((pg, grad.zero) if ctx.grad_is_loss else (grad,)))
        return pg

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        grad = ctx.saved_tensors[0]
        if grad_out.dim() == 1 and grad_out.stride() == (0,) and grad_out.numel() > 0:
            # expanded scalar (the usual sum() upstream): one multiply by a 0-dim tensor
            g = grad * grad_out[0]
        else:
            g = grad_out * grad
        if ctx.grad_is_loss:
            g.index_fill_(0, ctx.saved_tensors[1], 0.0)
        return g, None


def fused_token_loss(x: Tensor, kernel: Kernel) -> Tensor:
    """Per-token loss [N] = kernel(x)[0] whose gradient w.r.t. x is grad_out * kernel(x)[1].

    ``kernel`` runs without autograd on x's values and must return (loss [N], dloss/dx [N]),
    both fresh tensors, or (loss, ``GradIsLoss(zero)``) where dloss/dx is the loss itself
    except 0 at the indices ``zero``. Valid only when loss_t depends on x_t alone.
    """
    return _FusedTokenLoss.apply(x, kernel)


def clamped_entries(d: Tensor, bounds: tuple[float, float] | None = None) -> Tensor | None:
    """Bool mask of the entries of d outside [-20, 20] (where exp(clamp(d)) has gradient 0),
    or None when there is none (one aminmax pass; ``bounds``: d's (min, max) if known)."""
    if d.numel() == 0:
        return None
    lo, hi = torch.aminmax(d) if bounds is None else bounds
    if bool(lo < -LOG_RATIO_CLAMP) or bool(hi > LOG_RATIO_CLAMP):
        return d.abs() > LOG_RATIO_CLAMP
    return None


def safe_exp_(d: Tensor, bounds: tuple[float, float] | None = None) -> tuple[Tensor, Tensor | None]:
    """(exp(clamp(d, -20, 20)) in place on d, the entries the clamp moved or None): the
    clamp pass runs only when some |d| > 20. ``bounds``: d's (min, max) if known."""
    out = clamped_entries(d, bounds)
    if out is not None:
        d.clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return d.exp_(), out


@dataclass
class Surrogate:
    """Results of ``ppo_surrogate`` (all detached)."""

    pg: Tensor  # [N] -S(r, A) * w
    grad: Tensor  # [N] d pg / d log-ratio
    clipped: Tensor  # bool [N]: clipped branch strictly smaller (False where w == 0)
    r: Tensor  # [N] ratio exp(clamped log-ratio)
    kl_sum: Tensor  # sum_t m_t * d_t (0-dim)
    ratio_sum: Tensor  # sum_t m_t * r_t (0-dim)
    capped: Tensor | None = None  # bool [N]: the dual clip binds (None without one)


ClampFix = Callable[[Tensor, Tensor], None]  # (clip(r) in place, r) -> None


def ppo_surrogate(d: Tensor, adv: Tensor, m: Tensor, lo: float, hi: float,
                  weight: Tensor | None = None, dual_clip: float | None = None,
                  fix_clamp: ClampFix | None = None, nA: Tensor | None = None,
                  own_d: bool = False, kl_sum: Tensor | None = None,
                  bounds: tuple[float, float] | None = None) -> Surrogate:
    """PPO's surrogate on log-ratios d [N] (no autograd; call inside a kernel).

    ``weight`` (detached, >= 0) multiplies the per-token loss (folded into nA = -A*m*w).
    ``fix_clamp(rc, r)`` may edit clip(r) in place before it meets the advantage (SAT's
    per-token bounds on a subset). ``own_d``: d may be overwritten (saves a copy).
    ``kl_sum``: sum_t m_t d_t when the caller already has it. ``bounds``: d's (min, max)
    or any interval holding d, when known (skips safe_exp_'s aminmax pass).
    """
    if kl_sum is None:
        kl_sum = torch.dot(d, m)
    r, outside = safe_exp_(d if own_d else d.clone(), bounds)
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
    if outside is not None:  # the ratio clamp binds: its gradient is 0
        grad.masked_fill_(outside, 0.0)
    capped = None
    if dual_clip is not None:
        cap = nA * dual_clip  # -c*A*w; binds only for A < 0 (nA > 0)
        capped = (pg > cap).logical_and_(nA > 0)
        pg = torch.where(capped, cap, pg)
        grad.masked_fill_(capped, 0.0)
    return Surrogate(pg, grad, clipped, r, kl_sum, ratio_sum, capped)


def clip_free_bound(eps_low: float, eps_high: float, dual_clip: float | None) -> float:
    """A log-ratio bound b such that |d| <= b puts r = exp(d) inside PPO's interval
    [1 - eps_low, 1 + eps_high] and below the dual clip c: such a token's loss is the
    unclipped r*nA, whose derivative is r*nA too. A relative 1e-4 below the exact bound
    (float exp is within an ulp, ~1e-7, of the true value), so the float ratio is inside."""
    b = min(math.log1p(eps_high), -math.log1p(-eps_low))
    if dual_clip is not None:
        b = min(b, math.log(dual_clip))
    return b * (1.0 - 1e-4)


@dataclass
class SubsetClip:
    """Results of ``ppo_on_subset``."""

    pg: Tensor  # [N] -S(r, A) * w, 0 at the dropped entries
    grad: GradIsLoss  # pg, with zeros where clipped, dual-capped, clamped or dropped
    n_clipped: Tensor  # 0-dim long: entries on the clipped branch (as Surrogate.clipped)
    n_capped: Tensor  # 0-dim long: entries the dual clip binds (0 without one)


def ppo_on_subset(r: Tensor, nA: Tensor, idx: Tensor, lo: float | Tensor, hi: float | Tensor,
                  dual_clip: float | None = None, outside: Tensor | None = None,
                  drop: Tensor | None = None) -> SubsetClip:
    """PPO's surrogate over N when only the entries ``idx`` (long, [K]) can be clipped: every
    other entry's ratio is inside [lo, hi] and below the dual clip (e.g. its |log-ratio| <=
    ``clip_free_bound``), so its loss is the unclipped r*nA and its derivative that same
    value. One product over N (into nA's buffer, in place); the clip, the dual clip and
    the clip counts run on the K entries and are scattered back. Equal, bit for bit, to
    ``ppo_surrogate``'s pg and grad with the same bounds at idx (lo / hi: floats, or
    per-entry tensors [K]).

    ``outside`` (bool [K]): entries whose log-ratio passed the ratio clamp (r already
    clamped; gradient 0). ``drop`` (bool [K]): entries whose loss and gradient are zeroed
    (a method's mask) after the clip.
    """
    nA_g, r_g = gather(nA, idx), gather(r, idx)
    pg = nA.mul_(r)
    zero = torch.zeros(0, dtype=torch.long, device=idx.device)
    n_clip = n_cap = torch.zeros((), dtype=torch.long, device=idx.device)
    if idx.numel():
        un = r_g * nA_g
        cl = torch.clamp(r_g, lo, hi).mul_(nA_g)
        clipped = cl > un
        pg_g = torch.maximum(un, cl, out=cl)
        n_clip = torch.count_nonzero(clipped)
        if outside is not None:
            clipped |= outside
        if dual_clip is not None:
            cap = nA_g * dual_clip  # -c*A*w; binds only for A < 0 (nA > 0)
            capped = (pg_g > cap).logical_and_(nA_g > 0)
            pg_g = torch.where(capped, cap, pg_g)
            n_cap = torch.count_nonzero(capped)
            clipped |= capped
        if drop is not None:
            pg_g.masked_fill_(drop, 0.0)
            clipped |= drop
        scatter_(pg, idx, pg_g)
        zero = compress(idx, clipped)
    return SubsetClip(pg, GradIsLoss(zero), n_clip, n_cap)


def subset_metrics(sc: SubsetClip, kl_sum: Tensor, ratio_sum: Tensor, count: Tensor,
                   dual_clip: float | None) -> dict[str, Tensor]:
    """``ppo_metrics`` for ``ppo_on_subset`` (same values)."""
    den = count.clamp_min(1.0)
    dt = sc.pg.dtype
    out = {"clipfrac": sc.n_clipped.to(dt) / den, "approx_kl": -kl_sum / den,
           "ratio_mean": ratio_sum / den}
    if dual_clip is not None:
        out["dual_clipfrac"] = sc.n_capped.to(dt) / den
    return out


def ppo_metrics(s: Surrogate, count: Tensor) -> dict[str, Tensor]:
    """clipfrac, approx_kl, ratio_mean (and dual_clipfrac) as ppo.ppo_token_loss reports them."""
    den = count.clamp_min(1.0)
    dt = s.r.dtype
    out = {
        "clipfrac": torch.count_nonzero(s.clipped).to(dt) / den,
        "approx_kl": -s.kl_sum / den,
        "ratio_mean": s.ratio_sum / den,
    }
    if s.capped is not None:
        out["dual_clipfrac"] = torch.count_nonzero(s.capped).to(dt) / den
    return out


def fused_ppo(x: Tensor, base: Tensor | None, adv: Tensor, mask: Tensor, count: Tensor,
              lo: float, hi: float, *, weight: Tensor | None = None,
              dual_clip: float | None = None) -> tuple[Tensor, Surrogate]:
    """Per-token -S(exp(x - base), A; lo, hi) * w as one autograd node, w = mask or
    ``weight`` (detached, mask already applied). Returns (pg [N], Surrogate for metrics)."""
    adv = adv.detach().to(x.dtype)
    box: list[Surrogate] = []

    def kernel(xv: Tensor) -> tuple[Tensor, Tensor]:
        d = xv - base if base is not None else xv
        s = ppo_surrogate(d, adv, mask, lo, hi, weight=weight, dual_clip=dual_clip,
                          own_d=base is not None)
        box.append(s)
        return s.pg, s.grad

    pg = fused_token_loss(x, kernel)
    return pg, box[0]


def fused_ppo_token_loss(log_pi: Tensor, log_pi_old: Tensor, adv: Tensor, mask: Tensor,
                         lo: float, hi: float, dual_clip: float | None = None,
                         weight: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """``ppo.ppo_token_loss`` as one fused node (scalar lo/hi): same arguments, same results."""
    count = mask.sum()
    pg, s = fused_ppo(log_pi, log_pi_old, adv, mask, count, lo, hi,
                      weight=None if weight is None else weight * mask, dual_clip=dual_clip)
    return pg, s.clipped, ppo_metrics(s, count)


class _ClippedSurrogate(torch.autograd.Function):
    """S = min(r*A, clip(r, lo, hi)*A), r = exp(clamp(d)); dS/dd = r*A where the unclipped
    branch is the min (ties count as unclipped) and the clamp does not bind, else 0."""

    @staticmethod
    def forward(ctx, d, adv, lo, hi):  # type: ignore[override]
        r, outside = safe_exp_(d.clone())
        un = r * adv
        rc = torch.clamp(r, min=lo, max=hi)
        cl = rc.mul_(adv)
        clipped = cl < un
        s = torch.minimum(un, cl)
        g = un.masked_fill_(clipped, 0.0)
        if outside is not None:
            g.masked_fill_(outside, 0.0)
        ctx.save_for_backward(g)
        ctx.mark_non_differentiable(clipped, r)
        return s, clipped, r

    @staticmethod
    def backward(ctx, grad_s, _g_clipped, _g_r):  # type: ignore[override]
        (g,) = ctx.saved_tensors
        return grad_s * g, None, None, None


def fused_clipped_surrogate(log_ratio: Tensor, adv: Tensor, lo: Tensor | float,
                            hi: Tensor | float) -> tuple[Tensor, Tensor, Tensor]:
    """``ppo.clipped_surrogate`` as one autograd node whose backward is a single multiply:
    (S, clipped bool, r detached); lo/hi may be per-entry tensors (SAT-GSPO)."""
    if isinstance(lo, Tensor):
        lo = lo.detach().to(log_ratio.dtype)
    if isinstance(hi, Tensor):
        hi = hi.detach().to(log_ratio.dtype)
    return _ClippedSurrogate.apply(log_ratio, adv.detach().to(log_ratio.dtype), lo, hi)
