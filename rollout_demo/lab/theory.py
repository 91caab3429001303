"""The theory paper (arXiv 2607.01083, Song, Xu et al. 2026, "Staleness-Learning Rate
Scaling Laws for Asynchronous RLHF"), abstract-level claims tested on the lab's toy model:

* ``theory-bias``: stale rollouts add a per-step surrogate-gradient bias of order
  O(S * eta). At a fixed checkpoint theta_c (after warm-up steps) the learner takes S
  steps of lr eta on fresh batches to theta_{c+S}; there the surrogate gradient is
  averaged over many batches sampled from theta_c (stale, lag S) and over as many sampled
  from theta_{c+S} (fresh). bias = ||E g(stale) - E g(fresh)||, its square estimated
  without the sampling noise (minus tr Cov / N of each arm). Configurations share values
  of S * eta with different S, so "the points fall on one curve" is a paired test.
* ``theory-etamax``: the largest stable learning rate on a sqrt(2) grid, per lag and seed,
  at two horizons (collapse judged on a held-out evaluation of the current policy up to
  step T1 and T2), found by bisection on the grid (stability assumed monotone in eta);
  the StalenessMonitor runs along every run and its bound (at the largest stable lr's
  run, at T2) is compared with the measured eta_max.

The loss is GRPO's clipped surrogate with the behaviour policy explicit (pi/mu, eps 0.2,
no KL: ``decoupled_ppo`` with ``ratio_mode="bypass"``), as the paper's analysis writes it.
"""

from __future__ import annotations

import copy
import math
import random
from pathlib import Path

import numpy as np
import torch

from learner_client.staleness_monitor import StalenessMonitor
from rollout_demo.lab import stats
from rollout_demo.lab.registry import Preset, RunContext, register
from rollout_demo.lab.stepview import (
    EVAL_PROMPTS,
    EVAL_SAMPLES,
    held_out,
    sample_batch,
    set_lr,
    surrogate_grad,
    train_step,
)

LOSS, LOSS_CONFIG = "decoupled_ppo", {"ratio_mode": "bypass"}
PAPER_ID = "arXiv 2607.01083"


#: the lab's toy Qwen3-MoE cut to one decoder layer (8 experts, top-2): 2.5x cheaper per
#: step than the 4-layer default, and it shows both effects (measured before the grids)
LAYERS = 1


def _checkpoint(out: Path) -> Path:
    from reference_engine.checkpoint import init_checkpoint
    from reference_engine.config import ModelConfig

    return init_checkpoint(out / ".ckpt-v0", ModelConfig(num_hidden_layers=LAYERS), seed=0)


def _learner(ckpt: Path, lr: float):
    from rollout_demo.learner import Learner

    return Learner(ckpt, loss=LOSS, loss_config=LOSS_CONFIG, lr=lr)


# ---------------------------------------------------------------- surrogate-gradient bias

def bias_squared(stale: torch.Tensor, fresh: torch.Tensor) -> float:
    """Unbiased estimate of ||E g_stale - E g_fresh||^2 from per-batch gradients [N, P]
    (the squared distance of the means minus each mean's sampling variance)."""
    d = stale.mean(0) - fresh.mean(0)
    noise = (stale.var(0, unbiased=True).sum() / stale.shape[0]
             + fresh.var(0, unbiased=True).sum() / fresh.shape[0])
    return float(d.pow(2).sum() - noise)


def _bias_seed(ckpt: Path, seed: int, configs: list[tuple[int, float]], n: int,
               warm: int, warm_lr: float, progress) -> list[dict]:
    torch.manual_seed(seed)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    learner = _learner(ckpt, warm_lr)
    for k in range(warm):  # the checkpoint theta_c: warm-up steps on fresh batches
        train_step(learner, sample_batch(learner.model, rng, gen, learner.version, f"w{k}"))
    theta_c = copy.deepcopy(learner.model.state_dict())
    opt_c = copy.deepcopy(learner.opt.state_dict())
    frozen_c = copy.deepcopy(learner.model)
    stale_batches = [sample_batch(frozen_c, rng, gen, learner.version, f"s{i}")
                     for i in range(n)]
    cells = []
    etas = sorted({e for _, e in configs})
    for eta in etas:
        lags = [lag for lag, e in configs if e == eta]
        learner.model.load_state_dict(theta_c)
        learner.opt.load_state_dict(opt_c)
        set_lr(learner, eta)
        path_rng = random.Random(seed * 1000 + 7)
        path_gen = torch.Generator().manual_seed(seed * 1000 + 7)
        moved = 0
        for lag in sorted(lags):
            while moved < lag:  # theta_{c+S}: S steps of lr eta on fresh batches
                train_step(learner, sample_batch(learner.model, path_rng, path_gen,
                                                 learner.version, f"p{moved}"))
                moved += 1
            g_stale = torch.stack([surrogate_grad(learner, b) for b in stale_batches])
            fresh_batches = [sample_batch(learner.model, rng, gen, learner.version, f"f{i}")
                             for i in range(n)]
            g_fresh = torch.stack([surrogate_grad(learner, b) for b in fresh_batches])
            b2 = bias_squared(g_stale, g_fresh)
            fresh_norm2 = float(g_fresh.mean(0).pow(2).sum()
                                - g_fresh.var(0, unbiased=True).sum() / n)
            drift = math.sqrt(sum(float((learner.model.state_dict()[k] - v).pow(2).sum())
                                  for k, v in theta_c.items()))
            cell = {"method": "bypass", "lag": lag, "seed": seed, "eta": eta,
                    "s_eta": lag * eta, "bias": math.sqrt(max(b2, 0.0)), "bias_sq": b2,
                    "fresh_grad_norm": math.sqrt(max(fresh_norm2, 0.0)),
                    "param_drift": drift, "batches_per_arm": n,
                    "diagnostics": {"stale_clipfrac": None}}
            cells.append(cell)
            progress(f"bias seed {seed} S={lag} eta={eta:g}: bias norm {cell['bias']:.4f} "
                     f"(fresh ||E g|| {cell['fresh_grad_norm']:.4f}, drift {drift:.3f})")
    return cells


def _pick(cells: list[dict], seed: int, lag: int, eta: float) -> dict:
    return next(c for c in cells if c["seed"] == seed and c["lag"] == lag
                and math.isclose(c["eta"], eta))


def bias_claims(res: dict) -> list[dict]:
    """theory-bias's paired claims from ``res["cells"]`` (``seeds``, ``settings``)."""
    cells, seeds, st = res["cells"], res["seeds"], res["settings"]
    lags, etas = st["lags"], st["etas"]
    configs = [tuple(c) for c in st["configs"]]  # pairs (lists once read from JSON)
    lo_eta, hi_eta = min(etas), max(etas)
    ratio = hi_eta / lo_eta
    claims = []
    # the bias grows with S*eta: the largest S against S = 1 at the small eta
    claims.append(stats.claim(
        f"bias grows with S (eta {lo_eta:g}): S={max(lags)} above S=1", f"S={max(lags)}",
        "S=1", "bias norm",
        [_pick(cells, s, max(lags), lo_eta)["bias"] for s in seeds],
        [_pick(cells, s, 1, lo_eta)["bias"] for s in seeds]))
    claims.append(stats.claim(
        f"bias grows with eta (S=1): eta {hi_eta:g} above {lo_eta:g}", f"eta={hi_eta:g}",
        f"eta={lo_eta:g}", "bias norm",
        [_pick(cells, s, 1, hi_eta)["bias"] for s in seeds],
        [_pick(cells, s, 1, lo_eta)["bias"] for s in seeds]))
    # one curve: equal S*eta, S and eta traded (S x ratio at the small eta against S at the
    # large eta); a curve in S*eta alone predicts a difference of 0
    for s_small in lags:
        s_big = round(s_small * ratio)
        if (s_big, lo_eta) not in configs or (s_small, hi_eta) not in configs:
            continue
        claims.append(stats.claim(
            f"one curve in S*eta: S={s_big}, eta {lo_eta:g} against S={s_small}, eta "
            f"{hi_eta:g} (same S*eta = {s_small * hi_eta:g}; a difference means S matters "
            "beyond S*eta)", f"S={s_big},eta={lo_eta:g}", f"S={s_small},eta={hi_eta:g}",
            "bias norm", [_pick(cells, s, s_big, lo_eta)["bias"] for s in seeds],
            [_pick(cells, s, s_small, hi_eta)["bias"] for s in seeds]))
    return claims


def run_bias(ctx: RunContext) -> dict:
    quick = ctx.quick
    # S*eta shared by (S, eta) pairs with different S: 4e-3 by (4, 1e-3) and (1, 4e-3),
    # 8e-3 by (8, 1e-3) and (2, 4e-3)
    configs = ([(1, 1e-3), (2, 1e-3), (1, 2e-3)] if quick else
               [(1, 1e-3), (4, 1e-3), (8, 1e-3), (1, 4e-3), (2, 4e-3)])
    lags = sorted({lag for lag, _ in configs})
    etas = sorted({e for _, e in configs})
    n = 3 if quick else 12
    warm = 2 if quick else 8
    ckpt = _checkpoint(ctx.out)
    cells: list[dict] = []
    for seed in ctx.seeds:
        cells += _bias_seed(ckpt, seed, configs, n, warm, 3e-3, ctx.progress)
    seeds = ctx.seeds
    lo_eta = min(etas)
    settings = {"lags": lags, "etas": etas, "configs": configs, "batches_per_arm": n,
                "warmup_steps": warm, "warmup_lr": 3e-3, "loss": LOSS,
                "loss_config": LOSS_CONFIG, "sampler_dtype": "float32"}
    claims = bias_claims({"cells": cells, "seeds": seeds, "settings": settings})
    slopes = []
    for s in seeds:  # log-log slope of bias against S at the small eta (O(S eta): <= 1)
        xs = [math.log(c["s_eta"]) for c in cells if c["seed"] == s
              and math.isclose(c["eta"], lo_eta) and c["bias"] > 0]
        ys = [math.log(c["bias"]) for c in cells if c["seed"] == s
              and math.isclose(c["eta"], lo_eta) and c["bias"] > 0]
        slopes.append(float(np.polyfit(xs, ys, 1)[0]) if len(xs) >= 2 else float("nan"))
    finite = [x for x in slopes if math.isfinite(x)]
    slope = stats.paired_ci(finite, [0.0] * len(finite)) if len(finite) >= 2 else None
    return {"cells": cells, "claims": claims, "settings": settings,
            "slope": ({"per_seed": slopes, "mean": slope.mean, "ci": [slope.lo, slope.hi],
                       "n": slope.n} if slope else {"per_seed": slopes})}


def bias_verdict(claims: list[dict], slope: dict | None = None) -> str:
    """The section's verdict sentence, from the claims' own verdicts."""
    grow = [c for c in claims if c["claim"].startswith("bias grows")]
    curve = [c for c in claims if c["claim"].startswith("one curve")]
    grows = all(c["verdict"] == "reproduced" for c in grow)
    split = [c for c in curve if c["verdict"] != "not distinguishable"]
    parts = [("The bias grows with S and with eta (both CIs above zero)" if grows else
              "The bias does not grow significantly with both S and eta ("
              + "; ".join(f"{c['a']} - {c['b']}: {c['verdict']}" for c in grow) + ")")]
    if not split:
        parts.append("at equal S*eta the (S, eta) pairs are not distinguishable, so the "
                     "points are consistent with one curve in S*eta at this scale")
    else:
        parts.append("at equal S*eta " + "; ".join(
            f"{c['a']} - {c['b']} = {c['mean_diff']:+.3f} ({c['verdict']})" for c in split)
            + ": S enters beyond S*eta")
    verdict = ("reproduced" if grows and not split else
               "not reproduced" if split else "not distinguishable at this scale")
    txt = "; ".join(parts) + f". O(S*eta) as one curve: **{verdict}**"
    if slope and "ci" in slope and math.isfinite(slope["ci"][1]):
        if slope["ci"][1] < 1:
            txt += (f"; but the growth is sublinear (log-log slope {slope['mean']:.2f}, CI "
                    "below 1): the bias saturates over this range, which an O(S*eta) upper "
                    "bound allows and a linear law does not")
        elif slope["ci"][0] > 1:
            txt += f"; the growth is superlinear (slope {slope['mean']:.2f}, CI above 1)"
    return txt + "."


def render_bias(res: dict) -> str:
    from rollout_demo.lab.report import claims_table

    st = res["settings"]
    lines = [
        (f"**Claim ({PAPER_ID}).** Stale rollouts add a per-step surrogate-gradient bias of "
        "order O(S * eta): the bias depends on lag and learning rate through S * eta."),
        "",
        (f"**Experiment.** Per seed, {st['warmup_steps']} warm-up steps (lr "
        f"{st['warmup_lr']:g}) give a checkpoint theta_c; from it S steps of lr eta (Adam, "
        "fresh batches) give theta_{c+S}. At theta_{c+S} the surrogate gradient (GRPO's clip "
        "on pi/mu, no KL) is averaged over "
        f"{st['batches_per_arm']} batches sampled from theta_c (stale, lag S) and "
        f"{st['batches_per_arm']} sampled from theta_{{c+S}} (fresh); ||bias||^2 = "
        "||mean g_stale - mean g_fresh||^2 minus each mean's sampling variance. "
        f"(S, eta) in {[tuple(c) for c in st['configs']]}; samplers in float32 (no train-inference "
        "mismatch, so the bias is staleness only)."),
        "",
        "| S | eta | S*eta | bias norm (mean over seeds) | norm of E g fresh | parameter drift |",
        "|---|---|---|---|---|---|"]
    keys = sorted({(c["lag"], c["eta"]) for c in res["cells"]}, key=lambda k: (k[0] * k[1], k))
    for lag, eta in keys:
        cs = [c for c in res["cells"] if c["lag"] == lag and math.isclose(c["eta"], eta)]
        lines.append(f"| {lag} | {eta:g} | {lag * eta:g} | "
                     f"{np.mean([c['bias'] for c in cs]):.4f} | "
                     f"{np.mean([c['fresh_grad_norm'] for c in cs]):.4f} | "
                     f"{np.mean([c['param_drift'] for c in cs]):.3f} |")
    lines += ["", claims_table(res)]
    sl = res.get("slope", {})
    if "ci" in sl:
        lines.append(f"Log-log slope of the bias norm against S*eta at eta {min(st['etas']):g}: "
                     f"{sl['mean']:.2f}, 95% CI [{sl['ci'][0]:.2f}, {sl['ci'][1]:.2f}] over "
                     f"{sl['n']} seeds (O(S eta) at small drift predicts 1; below 1 means "
                     "the bias saturates).")
        lines.append("")
    lines += ["**Verdict.** " + bias_verdict(res["claims"], res.get("slope")), ""]
    lines += [
        ("**Limits.** A one-layer toy MoE (8 experts, top-2) on an 8-token task; Adam "
         "makes the step size nearly independent of the gradient, so S*eta is a drift proxy "
         "in parameter space only through Adam's normalized steps; the bias is measured at "
         "one checkpoint per seed; at S*eta = 1e-3 some seeds' bias is at the noise floor "
         "(a squared estimate <= 0 is shown as 0 and left out of that seed's slope fit)."),
        ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- eta_max(S)

#: a dead policy: eval entropy below ENTROPY_FLOOR nats (no exploration left, so GRPO's
#: group advantages vanish and it cannot improve) with reward below DEAD_REWARD
ENTROPY_FLOOR, DEAD_REWARD = 0.5, 0.5


def collapsed_by(curve: list[tuple[int, float, float]], horizon: int,
                 nonfinite_at: int | None) -> bool:
    """The run's state at step ``horizon`` from its held-out eval curve
    ``[(step, reward, entropy)]`` (step 0 = before training), averaged over the last two
    eval points at or before ``horizon`` (one eval is noisy): collapsed when the loss went
    non-finite by then, the reward fell below half the starting reward (worse than the
    random start), or the policy is dead (entropy below ENTROPY_FLOOR with reward below
    DEAD_REWARD: a deterministic policy stuck short of the task)."""
    if nonfinite_at is not None and nonfinite_at <= horizon:
        return True
    pts = [(r, h) for t, r, h in curve if t <= horizon]
    if len(pts) < 2:
        return False
    last = pts[1:][-2:]
    reward = float(np.mean([r for r, _ in last]))
    entropy = float(np.mean([h for _, h in last]))
    return reward < 0.5 * pts[0][0] or (entropy < ENTROPY_FLOOR and reward < DEAD_REWARD)


def stability_run(ckpt: Path, seed: int, lag: int, lr: float, steps: int, eval_every: int,
                  horizons: list[int]) -> dict:
    """One training run with lag ``lag`` (batch k sampled by the bfloat16 copy of version
    max(k - S, 0)), the held-out eval every ``eval_every`` steps and the monitor along."""
    torch.manual_seed(seed)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    learner = _learner(ckpt, lr)
    ref = copy.deepcopy(learner.model).eval().requires_grad_(False)
    sampler = copy.deepcopy(learner.model).to(torch.bfloat16)
    snaps = {0: copy.deepcopy(learner.model.state_dict())}
    mon = StalenessMonitor()
    curve = [(0, *held_out(learner.model))]
    reports: dict[int, dict] = {}
    nonfinite_at = None
    clip = []
    for step in range(steps):
        v = max(step - lag, 0)
        sampler.load_state_dict(snaps[v])
        view = train_step(learner, sample_batch(sampler, rng, gen, v, str(step)),
                          ref_model=ref)
        rep = mon.step(lr, view.versions, learner.version - 1, view.mask,
                       update_norm=view.update_norm,
                       log_ratio=view.logprobs - view.rollout_logprobs,
                       ref_log_ratio=view.logprobs - view.ref_logprobs)
        clip.append(view.metrics.get("clipfrac", 0.0))
        snaps[learner.version] = copy.deepcopy(learner.model.state_dict())
        snaps.pop(learner.version - lag - 1, None)
        if step + 1 in horizons:
            d = rep.as_dict()
            # the bound for the run's nominal lag S at this horizon
            d["eta_bound_at_lag"] = mon.eta_bound(lag, step + 1)
            d["binding_at_lag"] = mon.binding(lag, step + 1)
            reports[step + 1] = d
        if not math.isfinite(view.loss):
            nonfinite_at = step + 1
            break
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            curve.append((step + 1, *held_out(learner.model)))
    return {"curve": curve, "nonfinite_at": nonfinite_at, "monitor": reports,
            "clipfrac": float(np.mean(clip)) if clip else float("nan"),
            "collapsed": {str(h): collapsed_by(curve, h, nonfinite_at) for h in horizons}}


def lr_grid(lo: float, n: int) -> list[float]:
    return [lo * math.sqrt(2) ** i for i in range(n)]


def bisect_eta_max(stable, n: int) -> tuple[int, dict[int, bool]]:
    """Largest grid index i with ``stable(i)`` True (-1 if none), assuming stability is
    monotone in i; calls ``stable`` about log2(n) times. Returns (index, every answer)."""
    seen: dict[int, bool] = {}

    def ask(i: int) -> bool:
        if i not in seen:
            seen[i] = stable(i)
        return seen[i]

    lo, hi = -1, n  # invariant: lo stable (or -1), hi unstable (or n)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ask(mid):
            lo = mid
        else:
            hi = mid
    return lo, seen


def etamax_claims(cells: list[dict], seeds: list[int], lags: list[int], horizons: list[int],
                  grid: list[float]) -> list[dict]:
    """The paired claims of theory-etamax from its cells (log2 eta_max per seed; a run
    unstable on the whole grid counts half a grid step below it)."""
    t1, t2 = min(horizons), max(horizons)
    s_max = max(lags)

    def log_eta(lag: int, h: int) -> list[float]:
        out = []
        for s in seeds:
            c = next(c for c in cells if (c["seed"], c["lag"], c["horizon"]) == (s, lag, h))
            i = c["grid_index"]
            out.append(math.log2(grid[0]) - 0.5 if i < 0 else math.log2(grid[i]))
        return out

    claims = []
    for h in horizons:
        claims.append(stats.claim(
            f"eta_max falls with S (T={h}): S=1 above S={s_max}", "S=1", f"S={s_max}",
            "log2 eta_max", log_eta(1, h), log_eta(s_max, h)))
    for h in horizons:
        claims.append(stats.claim(
            f"eta_max falls slower than 1/S (T={h}): eta_max*S at S={s_max} above S=1 "
            "(0 = exactly 1/S, the stale-limited regime)", f"S={s_max}", "S=1",
            "log2(eta_max * S)", [x + math.log2(s_max) for x in log_eta(s_max, h)],
            log_eta(1, h)))
    claims.append(stats.claim(
        f"the short horizon tolerates more: eta_max at T={t1} above T={t2} (S=1)",
        f"T={t1}", f"T={t2}", "log2 eta_max", log_eta(1, t1), log_eta(1, t2)))
    return claims


def scan_eta_max(ckpt: Path, seed: int, lag: int, grid: list[float], steps: int,
                 eval_every: int, horizons: list[int], progress
                 ) -> tuple[dict[int, dict], dict[int, int]]:
    """Bisection on the lr grid for every horizon, sharing runs (one run answers every
    horizon). Returns (grid index -> run, horizon -> largest stable grid index)."""
    runs: dict[int, dict] = {}

    def run(i: int) -> dict:
        if i not in runs:
            runs[i] = stability_run(ckpt, seed, lag, grid[i], steps, eval_every, horizons)
            progress(f"eta_max seed {seed} S={lag} lr {grid[i]:.3g}: collapsed "
                     f"{runs[i]['collapsed']} final eval {runs[i]['curve'][-1][1]:.2f}")
        return runs[i]

    best = {}
    for h in sorted(horizons, reverse=True):
        def stable(i: int, h: int = h) -> bool:
            return not run(i)["collapsed"][str(h)]

        best[h] = bisect_eta_max(stable, len(grid))[0]
    return runs, best


def run_etamax(ctx: RunContext) -> dict:
    quick = ctx.quick
    lags = [1, 2] if quick else [1, 4, 8]
    steps = 4 if quick else 24
    horizons = [2, 4] if quick else [12, 24]
    grid = lr_grid(5.66e-3, 2 if quick else 8)  # 5.66e-3 ... 6.4e-2 in sqrt(2) steps
    eval_every = 2 if quick else 4
    ckpt = _checkpoint(ctx.out)
    cells: list[dict] = []
    for seed in ctx.seeds:
        for lag in lags:
            runs, best = scan_eta_max(ckpt, seed, lag, grid, steps, eval_every, horizons,
                                      ctx.progress)
            for h in horizons:
                idx = best[h]
                r = runs[idx] if idx >= 0 else None
                mon = (r or {}).get("monitor", {}).get(h, {}) if r else {}
                cells.append({
                    "method": "bypass", "lag": lag, "seed": seed, "horizon": h,
                    "eta_max": grid[idx] if idx >= 0 else None,
                    "grid_index": idx, "below_grid": idx < 0, "above_grid": idx == len(grid) - 1,
                    "runs": {f"{grid[i]:.4g}": {"collapsed": v["collapsed"][str(h)],
                                                "final_eval": v["curve"][-1][1],
                                                "eval_curve": v["curve"]}
                             for i, v in sorted(runs.items())},
                    "final_eval": r["curve"][-1][1] if r else None,
                    "diagnostics": {"monitor_at_eta_max": mon,
                                    "monitor_bound": mon.get("eta_bound_at_lag"),
                                    "monitor_binding": mon.get("binding_at_lag")}})
    claims = etamax_claims(cells, ctx.seeds, lags, horizons, grid)
    return {"cells": cells, "claims": claims,
            "settings": {"lags": lags, "steps": steps, "horizons": horizons, "lr_grid": grid,
                         "eval_every": eval_every, "loss": LOSS, "loss_config": LOSS_CONFIG,
                         "sampler_dtype": "bfloat16", "learner_dtype": "float32"}}


def monitor_ratios(res: dict) -> dict[tuple[int, int], list[float]]:
    """(S, T) -> eta_max / the monitor's bound, per seed (where both are known)."""
    out: dict[tuple[int, int], list[float]] = {}
    for c in res["cells"]:
        b = c["diagnostics"]["monitor_bound"]
        if c["eta_max"] and b:
            out.setdefault((c["lag"], c["horizon"]), []).append(c["eta_max"] / b)
    return out


def etamax_verdict(res: dict) -> str:
    """The section's verdict sentences, from the claims and the monitor's ratios."""
    by = {c["claim"].split(":")[0]: c for c in res["claims"]}
    parts = []
    for key, c in by.items():
        parts.append(f"{key}: {c['a']} - {c['b']} = {c['mean_diff']:+.2f} "
                     f"[{c['ci'][0]:+.2f}, {c['ci'][1]:+.2f}] ({c['verdict']})")
    ratios = monitor_ratios(res)
    lags = sorted({k[0] for k in ratios})
    txt = "; ".join(parts) + "."
    for h in sorted({k[1] for k in ratios}):
        med = [float(np.median(ratios[(lag, h)])) for lag in lags if (lag, h) in ratios]
        if len(med) >= 2:
            txt += (f" Monitor at T={h}: measured eta_max / bound = "
                    + ", ".join(f"S={lag}: {m:.1f}" for lag, m in zip(lags, med))
                    + f" (spread x{max(med) / min(med):.1f} across S: "
                    + ("the bound follows the measured S-dependence within a factor 2"
                       if max(med) / min(med) <= 2 else
                       "the bound does not follow the measured S-dependence") + ").")
    s_max = max(res["settings"]["lags"])
    for c in res["claims"]:
        if not c["claim"].startswith("eta_max falls slower than 1/S"):
            continue
        h = int(c["claim"].split("T=")[1].split(")")[0])
        binds = [x["diagnostics"]["monitor_binding"] for x in res["cells"]
                 if x["lag"] == s_max and x["horizon"] == h]
        stale = binds.count("stale")
        if c["verdict"] == "reproduced" and stale > len(binds) / 2:
            txt += (f" At T={h} the monitor calls S={s_max} stale-limited ({stale}/"
                    f"{len(binds)} seeds), i.e. predicts eta_max ~ 1/S, while the measured "
                    "eta_max falls slower than 1/S: its regime call is contradicted.")
        elif c["verdict"] == "reproduced":
            txt += (f" At T={h} the monitor calls S={s_max} horizon-limited in most seeds, "
                    "as the measured eta_max (slower than 1/S) says.")
    return txt


def render_etamax(res: dict) -> str:
    from rollout_demo.lab.report import claims_table

    st = res["settings"]
    grid = st["lr_grid"]
    lines = [
        (f"**Claim ({PAPER_ID}).** Stability needs eta << min{{R_batch/(S G_upd), "
        "R_crit/(T G_upd)}: the max stable eta scales like 1/S where the stale term binds "
        "and is nearly independent of S where the horizon term does."),
        "",
        (f"**Experiment.** Bypass GRPO (clip on pi/mu, no KL), lag S in {st['lags']} (batch k "
        f"from the bfloat16 copy of version k - S), {st['steps']} steps. eta_max = the "
        f"largest lr of the sqrt(2) grid {grid[0]:.3g} ... {grid[-1]:.3g} whose run did not "
        f"collapse by horizon T in {st['horizons']} (held-out eval of the current policy "
        f"every {st['eval_every']} steps, {EVAL_PROMPTS} prompts x {EVAL_SAMPLES} samples, the "
        "last two evals up to T averaged: reward below half its start, or a dead policy "
        f"(entropy below {ENTROPY_FLOOR} nats with reward below {DEAD_REWARD}), or a "
        "non-finite loss), found by bisection. The StalenessMonitor "
        "(update norms, |log pi - log mu|, |log pi - log pi_0|) runs along; its bound is "
        "read at the eta_max run at each horizon."),
        "",
        ("| S | T | eta_max (median, [min, max] over seeds) | monitor bound (median) | "
        "eta_max / bound | binding term |"),
        "|---|---|---|---|---|---|"]
    for lag in st["lags"]:
        for h in st["horizons"]:
            cs = [c for c in res["cells"] if c["lag"] == lag and c["horizon"] == h]
            em = [c["eta_max"] if c["eta_max"] is not None else grid[0] / math.sqrt(2)
                  for c in cs]
            bd = [c["diagnostics"]["monitor_bound"] for c in cs
                  if c["diagnostics"]["monitor_bound"]]
            ratio = [c["eta_max"] / c["diagnostics"]["monitor_bound"] for c in cs
                     if c["eta_max"] and c["diagnostics"]["monitor_bound"]]
            bind = [c["diagnostics"]["monitor_binding"] for c in cs]
            lines.append(
                f"| {lag} | {h} | {np.median(em):.3g} [{min(em):.3g}, {max(em):.3g}] | "
                f"{np.median(bd):.3g} | " if bd else
                f"| {lag} | {h} | {np.median(em):.3g} [{min(em):.3g}, {max(em):.3g}] | - | ")
            lines[-1] += (f"{np.median(ratio):.2f} | " if ratio else "- | ")
            lines[-1] += ", ".join(f"{b}: {bind.count(b)}" for b in dict.fromkeys(bind)) + " |"
    lines += ["", claims_table(res), "", "**Verdict.** " + etamax_verdict(res), "",
              ("**Limits.** Toy model and task, 24 steps; eta_max is resolved only to the "
               "sqrt(2) grid and bisection assumes stability is monotone in eta; the collapse "
               "rule is ours. The monitor's R_batch is the drift at which the typical token "
               "leaves the clip band; with PPO's clip on pi/mu such tokens stop contributing "
               "(their gradient is masked), which shrinks the batch rather than collapsing "
               "the run: one untested explanation of why the bound sits far below the "
               "measured eta_max."),
              ""]
    return "\n".join(lines)


register(Preset(
    name="theory-bias", paper="theory",
    summary="||E g(stale) - E g(fresh)|| against S*eta at fixed checkpoints (one curve?)",
    cpu_minutes=1.0, run=run_bias, render=render_bias, claims=bias_claims))
register(Preset(
    name="theory-etamax", paper="theory",
    summary="eta_max(S) on a sqrt(2) grid at two horizons, against the monitor's bound",
    cpu_minutes=3.0, run=run_etamax, render=render_etamax, default_seeds=(0, 1, 2, 3),
    claims=lambda res: etamax_claims(res["cells"], res["seeds"], res["settings"]["lags"],
                                     res["settings"]["horizons"], res["settings"]["lr_grid"])))
