"""ESTR's fused backend: the PPO kernel, the score and a sparse mask in one node."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..base import TokenLoss
from ..estr import ESTRConfig, check_entropy_exactness, version_spread
from ..inputs import LossInputs
from ..ops import (
    LOG_RATIO_CLAMP,
    above_mask,
    compress,
    gather,
    indices_above,
    mask_indices,
    masked_mean,
    masked_quantile,
    quantile_and_tail,
)
from .kernel import (
    GradIsLoss,
    clip_free_bound,
    fused_token_loss,
    ppo_metrics,
    ppo_on_subset,
    ppo_surrogate,
    subset_metrics,
)

SPARSE_CLIP = True  # the sparse form of ``estr`` (tests switch it off to compare both)
_SPARSE_MAX_SHARE = 0.3  # above this share of tokens past the clip bound: the dense kernel
_PROBE = 1024  # tokens of the strided probe that estimates that share
# Below this many tokens the sparse form's small ops cost about what its [N] passes save
# (measured on CPU: even at 128k tokens, ahead from 256k, 1.2 ms of ~6 at 1M)
SPARSE_MIN_TOKENS = 262144


def _sparse_pays(x: Tensor, mu: Tensor, m: Tensor, bound: float) -> bool:
    """Whether a strided probe of ~1k tokens puts at most _SPARSE_MAX_SHARE of them past
    the clip bound (only the speed depends on it: both forms give the same results)."""
    step = max(x.numel() // _PROBE, 1)
    probe = ((x[::step] - mu[::step]) * m[::step]).abs_() > bound
    return probe.numel() > 0 and int(probe.sum()) <= _SPARSE_MAX_SHARE * probe.numel()


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
    A NaN score (missing entropy, or 0/0 where an inactive token's H is -eps_h; detected
    by one sum) takes the masked-copy path for tau.

    Sparse form (fixed tau, N >= SPARSE_MIN_TOKENS, under 30% of a ~1k-token probe past
    the clip bound): a token's loss differs from the unclipped -r*A*m only where it is
    masked (score > tau) or its |d| exceeds ``kernel.clip_free_bound`` (~0.18 for eps
    0.2). The score over N is the dense kernel's (d*m squared, / (H + eps_h)); two numpy
    compares and one flatnonzero give that set S (~1-3% of the tokens), the mask and
    PPO's clip run on S (``kernel.ppo_on_subset``), the ratio is exp(d*m) (clamp checked
    on S), and the gradient is the loss with zeros (no clamp, compare, maximum, fill or
    count over N). Same values, bit for bit.
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
    clip_bound = clip_free_bound(cfg.eps_low, cfg.eps_high, cfg.dual_clip)
    sparse = SPARSE_CLIP and cfg.tau is not None and clip_bound > 0.0

    def sparse_kernel(x: Tensor) -> tuple[Tensor, GradIsLoss]:
        """Fixed tau: the score over N as the dense kernel, then only the tokens it masks
        or whose |d| can reach the clip (S) see more than -r*A*m (see ``estr``)."""
        d = x - mu
        kl_sum = torch.dot(d, m)  # as the dense kernel (same bits)
        am = torch.mul(d, m)  # d on active tokens, 0 elsewhere (score 0 or NaN: kept)
        sq = torch.square(am, out=d)
        # |d| > clip_bound implies d^2 > this (rounding is monotone): S may hold a few
        # tokens more, never fewer (ppo_on_subset is exact on any superset)
        hit = above_mask(sq, (clip_bound * (1.0 - 1e-6)) ** 2)
        buf = h + cfg.eps_h
        score = sq.div_(buf)  # the dense kernel's score
        tau = cfg.tau
        hit |= above_mask(score, tau)
        if math.isinf(tau):  # score > inf never holds; +inf is masked all the same
            hit |= above_mask(score, torch.finfo(score.dtype).max)
        idx = mask_indices(hit)
        s_s = gather(score, idx)
        drop = (s_s > tau).logical_or_(torch.isposinf(s_s))
        d_s = gather(am, idx)
        outside = None  # |d| past the ratio clamp: all in S (clip_bound < 20)
        if d_s.numel():
            lo, hi = torch.aminmax(d_s)
            if bool(lo < -LOG_RATIO_CLAMP) or bool(hi > LOG_RATIO_CLAMP):
                outside = d_s.abs() > LOG_RATIO_CLAMP
                am.clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        nA = torch.mul(adv.to(x.dtype), m, out=buf).neg_()
        r = am.exp_()  # exp(d * m): 1 on inactive tokens, whose -A*m is 0
        ratio_sum = torch.dot(r, m)
        sc = ppo_on_subset(r, nA, idx, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high,
                           cfg.dual_clip, outside, drop)
        box["metrics"] = subset_metrics(sc, kl_sum, ratio_sum, n_act, cfg.dual_clip)
        box["tau"] = torch.tensor(tau, dtype=x.dtype, device=x.device)
        box["drop"] = compress(idx, drop)
        return sc.pg, sc.grad

    def kernel(x: Tensor) -> tuple[Tensor, Tensor | GradIsLoss]:
        if sparse and x.numel() >= SPARSE_MIN_TOKENS and _sparse_pays(x, mu, m, clip_bound):
            return sparse_kernel(x)
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
            # quantile); NaN where the entropy is missing, and 0/0 = NaN on an inactive
            # token whose H is -eps_h: NaN scores leave the quantile, as in the reference
            score = torch.mul(d, m).square_().div_(h + cfg.eps_h)
            if not any_missing and not bool(torch.isnan(score.sum())):
                tau, drop = quantile_and_tail(score, int(n_act), 1.0 - cfg.target_mask_rate)
            else:
                valid = inputs.active & ~torch.isnan(score)
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
        box["metrics"], box["tau"], box["drop"] = ppo_metrics(s, n_act), tau, drop
        return s.pg, s.grad

    pg = fused_token_loss(inputs.flat("logprobs"), kernel)
    metrics = box["metrics"]
    den = n_act.clamp_min(1.0)
    metrics["mask_rate"] = m.index_select(0, box["drop"]).sum() / den
    metrics["tau"] = box["tau"].detach().to(torch.float32)
    metrics["entropy_missing_rate"] = (masked_mean(missing_b.to(m.dtype), m, n_act)
                                       if any_missing else torch.zeros_like(n_act))
    metrics["entropy_inexact_rate"] = inexact
    if cfg.version_diagnostics:
        metrics.update(version_spread(inputs))
    return TokenLoss(pg, m, metrics)
