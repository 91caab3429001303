"""SAT's fused backend: the PPO kernel with the contracted bounds on the gated tail only."""

from __future__ import annotations

import torch
from torch import Tensor

from ..base import TokenLoss
from ..inputs import LossInputs
from ..ops import LOG_RATIO_CLAMP, compress, gather, quantile_and_tail, scatter_
from ..ppo import add_k3_kl
from ..sat import SATConfig
from .kernel import (
    GradIsLoss,
    clip_free_bound,
    fused_token_loss,
    ppo_metrics,
    ppo_on_subset,
    ppo_surrogate,
    subset_metrics,
)

# Tail-only clipping (see ``sat``); tests switch it off to compare both forms bit for bit.
TAIL_ONLY_CLIP = True
# Below this many tokens the tail's ~30 small ops cost more than the [N] passes they save
# (measured on CPU: even at 16k-32k tokens, ahead from 64k).
TAIL_ONLY_MIN_TOKENS = 32768


def sat(inputs: LossInputs, cfg: SATConfig) -> TokenLoss:
    """SAT as one fused autograd node (plus the eager k3 term when kl_coef > 0).

    The factors differ from 1 only on the gated tail G = {active, |d| > q} (~10% of the
    tokens), and there only the endpoint on d's side of 1 moves: for d > q, r = e^d >= 1
    so clip(r, lo, hi) ignores lo; for d < -q, r <= 1 ignores hi. Hence clip(r, lo', hi')
    = clip(r, 1 - eps_low*c, 1 + eps_high*c) with c = psi(|d|; q) on G, 1 elsewhere.
    q: exact quantile of |d|*mask (inactive entries are 0 and shift the rank, no masked
    copy), capped at the ratio clamp inside the selection (no clamp pass). The ratio is
    exp(d*mask): 1 on inactive tokens, whose -A*m is 0 (same loss and gradient), and every
    active |d| > q is in G, so the ratio clamp is checked on G (no aminmax pass over N).

    Tail-only clipping, when q <= ``kernel.clip_free_bound`` (about 0.18 for eps 0.2) and
    N >= TAIL_ONLY_MIN_TOKENS (smaller batches: the dense form is cheaper): every token
    off G has |d| <= q, so its ratio is inside PPO's interval and below the dual clip; its
    loss is the unclipped -r*A*m and its derivative that same value. The work over N is
    then d, d*m, |d*m|, exp, -A*m and their product (no clamp, compare, maximum, fill or
    count over N); the clipped surrogate, the dual clip and the counts run on G (gathers of
    |G|) and are scattered into the loss, and the gradient is the loss with zeros at G's
    clipped tokens (``GradIsLoss``). Same values, bit for bit, as the dense form used for
    larger q: PPO's kernel over N with G re-clamped (gather/scatter of |G|).
    The eps means add the contractions of G to eps * #active (no [N] pass).
    """
    m = inputs.mask
    n_act = inputs.mask_count
    n_int = int(n_act)
    den = n_act.clamp_min(1.0)
    mu = inputs.flat("rollout_logprobs").detach()
    adv = inputs.flat("advantages").detach()
    el, eh, p, dual = cfg.eps_low, cfg.eps_high, cfg.kernel_power, cfg.dual_clip
    bound = clip_free_bound(el, eh, dual)
    box: dict = {}

    def kernel(x: Tensor) -> tuple[Tensor, Tensor | GradIsLoss]:
        d = x - mu
        am = torch.mul(d, m)
        kl_sum = am.sum()
        # |d|*m (into d's buffer) capped at the ratio clamp (r = exp(clamp(d)) anyway): an
        # infinite log-ratio on an active token cannot make q infinite (psi = inf/inf)
        q, gate = quantile_and_tail(torch.abs(am, out=d), n_int, cfg.quantile,
                                    cap=LOG_RATIO_CLAMP)
        box["q"] = q
        qf = float(q)
        d_g = gather(am, gate)
        outside = None  # bool over G: |d| past the ratio clamp (gradient 0 there)
        if d_g.numel():
            lo, hi = torch.aminmax(d_g)
            if bool(lo < -LOG_RATIO_CLAMP) or bool(hi > LOG_RATIO_CLAMP):
                outside = d_g.abs() > LOG_RATIO_CLAMP
                am.clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
                d_g.clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        psi = None
        if qf > 0.0 and d_g.numel():
            # psi = 1 / (1 + (|d|/q)^p); for p = 2 the square drops the abs (same bits)
            box["pos"] = d_g > 0
            u = d_g.div_(qf).square_() if p == 2.0 else d_g.abs_().div_(qf).pow_(p)
            psi = box["psi"] = u.add_(1.0).reciprocal_()
        # |d|*m's buffer is free now: PPO's -A*m goes there (one [N] buffer less)
        nA = torch.mul(adv.to(x.dtype), m, out=d).neg_()
        # d*m is inside +-20 now, unless G is empty because q reached the cap
        bounds = ((-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
                  if gate.numel() or qf < LOG_RATIO_CLAMP else None)
        if not (TAIL_ONLY_CLIP and qf <= bound and x.numel() >= TAIL_ONLY_MIN_TOKENS):
            fix = None
            if psi is not None:
                def fix(rc: Tensor, r: Tensor) -> None:
                    lo_g = psi.mul(-el).add_(1.0)
                    hi_g = psi.mul(eh).add_(1.0)
                    r_g = gather(r, gate)
                    scatter_(rc, gate, torch.clamp(r_g, lo_g, hi_g, out=r_g))

            s = ppo_surrogate(am, adv, m, 1.0 - el, 1.0 + eh, fix_clamp=fix, nA=nA,
                              own_d=True, kl_sum=kl_sum, dual_clip=dual, bounds=bounds)
            if outside is not None:
                s.grad.index_fill_(0, compress(gate, outside), 0.0)
            box["metrics"] = ppo_metrics(s, n_act)
            return s.pg, s.grad
        # tail-only clipping: -r*A*m over N, PPO's clip (contracted bounds) on G
        r = am.exp_()
        ratio_sum = torch.dot(r, m)
        if psi is not None:
            lo_b, hi_b = psi.mul(-el).add_(1.0), psi.mul(eh).add_(1.0)
        else:  # q = 0: no contraction
            lo_b, hi_b = 1.0 - el, 1.0 + eh
        sc = ppo_on_subset(r, nA, gate, lo_b, hi_b, dual, outside)
        box["metrics"] = subset_metrics(sc, kl_sum, ratio_sum, n_act, dual)
        return sc.pg, sc.grad

    pg = fused_token_loss(inputs.flat("logprobs"), kernel)
    metrics = box["metrics"]
    dt = pg.dtype
    lo_short = hi_short = torch.zeros((), dtype=dt)  # sum over G of c - 1 (<= 0), per side
    n_g, c_min = 0, torch.ones((), dtype=dt)
    if "psi" in box:
        psi, pos = box["psi"], box["pos"]
        short = psi - 1.0
        hi_short = torch.dot(short, pos.to(dt))
        lo_short = short.sum() - hi_short
        n_g = psi.numel()
        if n_g:
            c_min = psi.min()
    metrics.update({
        "sat_q": box["q"],
        "eps_low_mean": el * (n_act + lo_short) / den,
        "eps_high_mean": eh * (n_act + hi_short) / den,
        "gate_rate": torch.tensor(float(n_g), dtype=dt) / den,
        "c_min": c_min,
    })
    return add_k3_kl(TokenLoss(pg, m, metrics), inputs, cfg.kl_coef, "SAT")
