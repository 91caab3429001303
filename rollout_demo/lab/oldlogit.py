"""The old-logit paper (arXiv 2605.12070, Guan et al. 2026, "Missing Old Logits in
Asynchronous Agentic RL"): where pi_old comes from when the batch does not carry it,
tested on the lab's toy model with mid-rollout version switches.

``old-logits``: every batch is generated across an in-flight hot-swap schedule: token j
of a response is sampled by version ``k - S + floor(j S / MAX_NEW)`` (a bfloat16 copy,
as an engine would hold it), so one response carries S versions and lags S..1. Five
sources of the proximal policy pi_prox under one loss (the decoupled ratio: r_d =
pi_prox/mu kept inside [1/c, c] with c = 2, r_s = pi/pi_prox with PPO's clip 0.2):

* ``exact``: pi_old per token from the snapshot of its own version (``WeightSnapshotStore``
  recompute, one forward pass per distinct version in the batch);
* ``ewma``: ``RevisedPPOEWMA`` (debiased EWMA weights, beta from the observed window
  S + 1, reset when the active-token fraction drops below 0.9; one forward pass);
* ``loglinear``: AReaL's interpolation log mu + alpha (log pi - log mu) from versions;
* ``current``: sg[log pi] of the current weights (r_s = 1, r_d = pi/mu);
* ``bypass``: pi_prox = mu (r_s = pi/mu, r_d = 1).

Per step it records the error of each method's log pi_prox against the exact pi_old by
token lag, the spread (std) of log r_d = log pi_prox - log mu, the EWMA resets, the extra
forward passes the method needs, and the held-out evaluation of the current policy.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from learner_client.old_logits import RevisedPPOEWMA, WeightSnapshotStore
from rollout_demo import task
from rollout_demo.lab import stats
from rollout_demo.lab.registry import Preset, RunContext, register
from rollout_demo.lab.stepview import GROUP_SIZE, GROUPS, MAX_NEW, held_out, train_step
from rollout_demo.learner import Learner, Sample, pack_batch

PAPER_ID = "arXiv 2605.12070"
METHODS = ("exact", "ewma", "loglinear", "current", "bypass")
BASE = {"discrepancy": "mask", "discrepancy_c": 2.0}
LOSS_CONFIGS: dict[str, dict] = {
    "exact": {"ratio_mode": "decoupled", **BASE},
    "ewma": {"ratio_mode": "decoupled", **BASE},  # run through RevisedPPOEWMA's own loss
    "loglinear": {"ratio_mode": "loglinear", **BASE},
    "current": {"ratio_mode": "decoupled", **BASE},
    "bypass": {"ratio_mode": "bypass"},
}
LAYERS = 1  # the toy MoE cut to one layer, as in the theory presets


def version_schedule(step: int, lag: int, max_new: int = MAX_NEW) -> list[int]:
    """The version that samples each of the ``max_new`` tokens of a batch trained at step
    ``step``: k - S + floor(j S / max_new) (>= 0): S versions, lags S down to 1."""
    return [max(step - lag + (j * lag) // max_new, 0) for j in range(max_new)]


@torch.no_grad()
def sample_mixed(sampler: Any, weights: dict[int, dict], schedule: list[int],
                 prompts: list[list[int]], n: int, gen: torch.Generator, tag: str
                 ) -> list[Sample]:
    """``n`` responses per prompt, token j sampled by version ``schedule[j]`` (the weights
    are swapped into ``sampler`` between tokens, as an in-flight hot-swap does); mu and
    the entropy of each token come from the version that sampled it."""
    sampler.eval()
    width = max(len(p) for p in prompts)
    rows = [list(p) for p in prompts for _ in range(n)]
    pads = [width - len(r) for r in rows]
    ids = torch.tensor([[0] * k + r for k, r in zip(pads, rows)], dtype=torch.long)
    mask = torch.tensor([[False] * k + [True] * len(r) for k, r in zip(pads, rows)])
    lps, ents = [], []
    loaded = None
    for v in schedule:
        if v != loaded:
            sampler.load_state_dict(weights[v])
            loaded = v
        pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
        logits = sampler(input_ids=ids, attention_mask=mask, position_ids=pos,
                         use_cache=False).logits[:, -1].float()
        logp = torch.log_softmax(logits, -1)
        nxt = torch.multinomial(logp.exp(), 1, generator=gen)
        lps.append(logp.gather(1, nxt).squeeze(1))
        ents.append(-(logp.exp() * logp).sum(-1))
        ids = torch.cat((ids, nxt), 1)
        mask = torch.cat((mask, torch.ones_like(nxt, dtype=torch.bool)), 1)
    lp = torch.stack(lps, 1).numpy()
    ent = torch.stack(ents, 1).numpy()
    out = []
    for i, row in enumerate(rows):
        resp = ids[i, width:].numpy()
        out.append(Sample(prompt_ids=np.asarray(row, np.int64), response_ids=resp,
                          rollout_logprobs=lp[i].astype(np.float32),
                          entropy=ent[i].astype(np.float32),
                          versions=np.asarray(schedule, np.int32),
                          reward=task.reward(row, resp), group=f"{tag}-{i // n}"))
    return out


def _logprobs_fn(learner: Learner, scratch: Any) -> Callable:
    """``run(weights, token_index) -> logprobs`` of the current batch (set ``.batch``)."""
    from learner_client.hf import packed_logprobs

    def run(weights, idx: torch.Tensor) -> torch.Tensor:
        scratch.load_state_dict(weights)
        with torch.no_grad():
            lp, _ = packed_logprobs(scratch, run.batch, temperature=learner.temperature,
                                    replay=False)
        run.calls += 1
        return lp[idx.to(torch.long)]

    run.batch = None
    run.calls = 0
    return run


def one_run(ckpt: Path, method: str, lag: int, seed: int, steps: int, lr: float,
            eval_every: int) -> dict:
    torch.manual_seed(seed)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    learner = Learner(ckpt, loss="decoupled_ppo", loss_config=LOSS_CONFIGS[method], lr=lr,
                      replay=False)
    sampler = copy.deepcopy(learner.model).to(torch.bfloat16)
    scratch = copy.deepcopy(learner.model).eval().requires_grad_(False)
    bf16 = {0: {k: v.to(torch.bfloat16) for k, v in learner.model.state_dict().items()}}
    store = WeightSnapshotStore(max_versions=lag + 2)
    store.put(0, learner.model.state_dict())
    run = _logprobs_fn(learner, scratch)
    ewma = RevisedPPOEWMA(run, learner.model.state_dict()) if method == "ewma" else None
    curve = [(0, held_out(learner.model)[0])]
    err_by_lag: dict[int, list[float]] = {}
    rd_std, extra, resets, train_reward, clipfrac, active = [], [], [], [], [], []
    nonfinite = False
    for step in range(steps):
        sched = version_schedule(step, lag)
        prompts = [task.make_prompt(rng)[1] for _ in range(GROUPS)]
        samples = sample_mixed(sampler, bf16, sched, prompts, GROUP_SIZE, gen, str(step))
        batch = pack_batch(samples, False)
        run.batch = batch
        versions = batch.columns["versions"].to(torch.int64)
        mu = batch.columns["rollout_logprobs"]
        calls0 = run.calls
        exact = store.recompute(versions, run)  # diagnostic for every method
        exact_calls = run.calls - calls0
        old = exact if method == "exact" else None
        calls1 = run.calls
        loss_fn = ewma.loss if ewma is not None else None
        view = train_step(learner, samples, old_logprobs=old, loss_fn=loss_fn)
        extra.append(exact_calls if method == "exact" else run.calls - calls1)
        lp = view.logprobs
        if method in ("exact",):
            prox = exact
        elif method == "ewma":
            prox = run(ewma.tracker.weights, torch.arange(lp.numel()))
            run.calls -= 1  # diagnostic, not the method's cost
        elif method == "loglinear":
            from learner_client.corrections.decoupled import loglinear_proximal

            prox, _ = loglinear_proximal(lp, mu, versions, learner.version - 1)
        elif method == "current":
            prox = lp
        else:
            prox = mu
        m = view.mask > 0
        tok_lag = (learner.version - 1) - versions
        for g in torch.unique(tok_lag[m]).tolist():
            sel = m & (tok_lag == g)
            err_by_lag.setdefault(int(g), []).append(float((prox - exact)[sel].abs().mean()))
        rd_std.append(float((prox - mu)[m].std()))
        if ewma is not None:
            ewma.after_step(learner.model.state_dict(),
                            {k: torch.tensor(v) for k, v in view.metrics.items()})
            resets.append(ewma.tracker.resets)
        train_reward.append(float(np.mean([s.reward for s in samples])))
        clipfrac.append(view.metrics.get("clipfrac", 0.0))
        active.append(view.metrics.get("active_token_fraction", float("nan")))
        store.put(learner.version, learner.model.state_dict())
        bf16[learner.version] = {k: v.to(torch.bfloat16)
                                 for k, v in learner.model.state_dict().items()}
        bf16.pop(learner.version - lag - 1, None)
        if not math.isfinite(view.loss):
            nonfinite = True
            break
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            curve.append((step + 1, held_out(learner.model)[0]))
    last = [r for _, r in curve[-2:]]
    return {"method": method, "lag": lag, "seed": seed, "eval_curve": curve,
            "final_eval": float(np.mean(last)), "collapsed": nonfinite,
            "diagnostics": {
                "prox_error_by_lag": {str(k): float(np.mean(v))
                                      for k, v in sorted(err_by_lag.items())},
                "prox_error": float(np.mean([x for v in err_by_lag.values() for x in v])),
                "log_rd_std": float(np.mean(rd_std)),
                "resets": int(resets[-1]) if resets else 0,
                "extra_forward_per_step": float(np.mean(extra)),
                "train_reward": train_reward, "clipfrac": float(np.mean(clipfrac)),
                "active_token_fraction": float(np.nanmean(active))
                if not all(math.isnan(a) for a in active) else None}}


def old_logit_claims(cells: list[dict], seeds: list[int], lags: list[int]) -> list[dict]:
    """The paired claims of the preset from its cells."""
    claims = []

    def col(method: str, lag: int, key: str) -> list[float]:
        out = []
        for s in seeds:
            c = next(c for c in cells if (c["method"], c["lag"], c["seed"]) == (method, lag, s))
            out.append(c["final_eval"] if key == "final_eval" else c["diagnostics"][key])
        return out

    for lag in lags:
        claims.append(stats.claim(
            f"S={lag}: the EWMA proximal is closer to exact pi_old than log-linear",
            "ewma", "loglinear", "mean abs(log pi_prox - log pi_old)",
            col("ewma", lag, "prox_error"), col("loglinear", lag, "prox_error"),
            expect="less"))
        claims.append(stats.claim(
            f"S={lag}: exact pi_old narrows the discrepancy ratio against current weights",
            "exact", "current", "std of log r_d", col("exact", lag, "log_rd_std"),
            col("current", lag, "log_rd_std"), expect="less"))
        claims.append(stats.claim(
            f"S={lag}: revised PPO-EWMA trains better than log-linear (the paper's gain)",
            "ewma", "loglinear", "held-out eval (last two evals)",
            col("ewma", lag, "final_eval"), col("loglinear", lag, "final_eval")))
        for other in ("ewma", "loglinear", "current", "bypass"):
            claims.append(stats.claim(
                f"S={lag}: exact pi_old trains better than {other}", "exact", other,
                "held-out eval (last two evals)", col("exact", lag, "final_eval"),
                col(other, lag, "final_eval")))
    return claims


def run_preset(ctx: RunContext) -> dict:
    from reference_engine.checkpoint import init_checkpoint
    from reference_engine.config import ModelConfig

    quick = ctx.quick
    lags = [2] if quick else [4]
    steps = 3 if quick else 16
    eval_every = 2 if quick else 4
    lr = 4e-3
    ckpt = init_checkpoint(ctx.out / ".ckpt-v0", ModelConfig(num_hidden_layers=LAYERS), seed=0)
    cells = []
    for lag in lags:
        for seed in ctx.seeds:
            for method in METHODS:
                c = one_run(ckpt, method, lag, seed, steps, lr, eval_every)
                cells.append(c)
                d = c["diagnostics"]
                ctx.progress(f"old-logits S={lag} seed {seed} {method:9s}: final eval "
                             f"{c['final_eval']:.2f} prox err {d['prox_error']:.4f} "
                             f"std log r_d {d['log_rd_std']:.3f} resets {d['resets']} "
                             f"extra fwd {d['extra_forward_per_step']:.1f}")
    claims = old_logit_claims(cells, ctx.seeds, lags)
    return {"cells": cells, "claims": claims,
            "settings": {"lags": lags, "steps": steps, "lr": lr, "eval_every": eval_every,
                         "methods": list(METHODS), "loss_configs": LOSS_CONFIGS,
                         "layers": LAYERS, "sampler_dtype": "bfloat16",
                         "schedule": "token j by version k - S + floor(j S / max_new)"}}


def verdict_text(res: dict) -> str:
    """One sentence per claim from its own CI, then the EWMA reset count."""
    from rollout_demo.lab.report import claim_numbers

    out = [f"{c['claim']}: {claim_numbers(c, 3)}, **{c['verdict']}**" for c in res["claims"]]
    resets = [c["diagnostics"]["resets"] for c in res["cells"] if c["method"] == "ewma"]
    steps = res["settings"]["steps"]
    txt = "; ".join(out) + "."
    if resets:
        txt += (f" The EWMA reset rule fired on {np.mean(resets):.1f} of {steps} steps on "
                "average: " + ("after a reset theta_prox is the current weights, so where "
                              "it fires nearly every step EWMA degenerates to `current`."
                              if np.mean(resets) > 0.5 * steps else
                              "the EWMA weights mostly persist between resets."))
    clip = {m: np.mean([c["diagnostics"]["clipfrac"] for c in res["cells"] if c["method"] == m])
            for m in res["settings"]["methods"]}
    txt += (" Clip rates on r_s (" + ", ".join(f"{m} {v:.2f}" for m, v in clip.items())
            + "): a proximal anchored at the sampling version (exact, bypass) clips the stale "
            "tokens' updates, one at the current weights does not, so at this lr and horizon "
            "a lower held-out score for exact means a more conservative step, not a "
            "less stable one.")
    return txt


def render(res: dict) -> str:
    from rollout_demo.lab.report import claims_table

    st = res["settings"]
    lines = [
        (f"**Claim ({PAPER_ID}).** With stale, mixed-version rollouts the ratio splits into "
        "r_d = pi_old/mu (train-inference discrepancy) and r_s = pi/pi_old (staleness); pi_old "
        "is needed exactly (snapshot recompute) or approximated (revised PPO-EWMA with "
        "resets; AReaL's log-linear interpolation); using the current weights or mu instead "
        "mixes the two terms; the paper adopts revised PPO-EWMA for its gains in training "
        "speed and optimization."),
        "",
        (f"**Experiment.** Toy MoE ({st['layers']} layer), lr {st['lr']:g}, {st['steps']} "
        f"steps, lags {st['lags']}: every response switches version mid-rollout "
        f"({st['schedule']}; bfloat16 samplers). One loss (decoupled: r_d kept in "
        "[1/2, 2], PPO clip 0.2 on r_s), five sources of pi_prox. Per method: the error "
        "of log pi_prox against the exact per-version log pi_old by token lag, the spread "
        "of log r_d, EWMA resets, extra forward passes per step, the held-out eval."),
        "",
        ("| S | method | final held-out eval | prox error (all lags) | error by lag | "
        "std log r_d | clip rate on r_s | resets | extra fwd / step |"),
        "|---|---|---|---|---|---|---|---|---|"]
    for lag in st["lags"]:
        for m in st["methods"]:
            cs = [c for c in res["cells"] if c["method"] == m and c["lag"] == lag]
            if not cs:
                continue
            d = [c["diagnostics"] for c in cs]
            by = {}
            for x in d:
                for k, v in x["prox_error_by_lag"].items():
                    by.setdefault(k, []).append(v)
            by_s = ", ".join(f"{k}: {np.mean(v):.3f}" for k, v in
                             sorted(by.items(), key=lambda kv: int(kv[0])))
            lines.append(
                f"| {lag} | {m} | {np.mean([c['final_eval'] for c in cs]):.3f} | "
                f"{np.mean([x['prox_error'] for x in d]):.4f} | {by_s} | "
                f"{np.mean([x['log_rd_std'] for x in d]):.3f} | "
                f"{np.mean([x['clipfrac'] for x in d]):.3f} | "
                f"{np.mean([x['resets'] for x in d]):.1f} | "
                f"{np.mean([x['extra_forward_per_step'] for x in d]):.1f} |")
    lines += ["", claims_table(res), "",
              "**Verdict.** " + verdict_text(res), "",
              ("**Limits.** One-layer toy MoE, 8-token responses, one lag; the version "
              "schedule is synthetic (the product's real in-flight swaps are lab-product's "
              "preset); exact pi_old is recomputed in float32 while mu is bfloat16, so "
              "r_d carries the dtype mismatch only."),
              ""]
    return "\n".join(lines)


register(Preset(
    name="old-logits", paper="old_logits",
    summary="exact pi_old vs RevisedPPOEWMA vs log-linear vs current vs bypass, "
            "mixed-version rollouts",
    cpu_minutes=1.5, run=run_preset, render=render,
    claims=lambda res: old_logit_claims(res["cells"], res["seeds"], res["settings"]["lags"])))
