"""SAT's fused backend: the PPO kernel with the contracted bounds on the gated tail only."""

from __future__ import annotations

import torch
from torch import Tensor

from ..base import TokenLoss
from ..inputs import LossInputs
from ..ops import LOG_RATIO_CLAMP, gather, quantile_and_tail, scatter_
from ..ppo import add_k3_kl
from ..sat import SATConfig
from .kernel import fused_token_loss, ppo_metrics, ppo_surrogate


def sat(inputs: LossInputs, cfg: SATConfig) -> TokenLoss:
    """SAT as one fused autograd node (plus the eager k3 term when kl_coef > 0).

    The factors differ from 1 only on the gated tail G = {active, |d| > q} (~10% of the
    tokens), and there only the endpoint on d's side of 1 moves: for d > q, r = e^d >= 1
    so clip(r, lo, hi) ignores lo; for d < -q, r <= 1 ignores hi. Hence clip(r, lo', hi')
    = clip(r, 1 - eps_low*c, 1 + eps_high*c) with c = psi(|d|; q) on G, 1 elsewhere: the
    kernel clamps with PPO's scalar bounds and re-clamps only G (gather/scatter of |G|).
    q: exact quantile of |d|*mask (inactive entries are 0 and shift the rank, no masked
    copy), capped at the ratio clamp inside the selection (no clamp pass); that buffer
    then holds PPO's -A*m (no [N] buffer beyond ppo_clip's). The eps means add the
    contractions of G to eps * #active (no [N] pass).
    """
    m = inputs.mask
    n_act = inputs.mask_count
    n_int = int(n_act)
    den = n_act.clamp_min(1.0)
    mu = inputs.flat("rollout_logprobs").detach()
    adv = inputs.flat("advantages").detach()
    el, eh, p = cfg.eps_low, cfg.eps_high, cfg.kernel_power
    box: dict[str, Tensor] = {}

    def kernel(x: Tensor) -> tuple[Tensor, Tensor]:
        d = x - mu
        am = torch.mul(d, m)
        kl_sum = am.sum()
        # |d| capped at the ratio clamp (r = exp(clamp(d)) anyway): an infinite log-ratio
        # on an active token cannot make q infinite (psi = inf/inf)
        q, gate = quantile_and_tail(am.abs_(), n_int, cfg.quantile, cap=LOG_RATIO_CLAMP)
        box["q"] = q
        qf = float(q)
        fix = None
        if qf > 0.0 and gate.numel():
            d_g = gather(d, gate).clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            # psi = 1 / (1 + (|d|/q)^p); for p = 2 the square drops the abs (same bits)
            u = d_g.div(qf).square_() if p == 2.0 else d_g.abs().div_(qf).pow_(p)
            psi = u.add_(1.0).reciprocal_()
            box["psi"], box["pos"] = psi, d_g > 0

            def fix(rc: Tensor, r: Tensor) -> None:
                lo_g = psi.mul(-el).add_(1.0)
                hi_g = psi.mul(eh).add_(1.0)
                r_g = gather(r, gate)
                scatter_(rc, gate, torch.clamp(r_g, lo_g, hi_g, out=r_g))

        # |d|*m's buffer is free now: PPO's -A*m goes there (one [N] buffer less)
        a = adv.to(x.dtype)
        s = ppo_surrogate(d, a, m, 1.0 - el, 1.0 + eh, fix_clamp=fix,
                          nA=torch.mul(a, m, out=am).neg_(), own_d=True, kl_sum=kl_sum,
                          dual_clip=cfg.dual_clip)
        box["s"] = s  # type: ignore[assignment]
        return s.pg, s.grad

    pg = fused_token_loss(inputs.flat("logprobs"), kernel)
    metrics = ppo_metrics(box["s"], n_act)  # type: ignore[arg-type]
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
