"""Through the product: the same training with lag made by the gateway, against the lab's
simulated lag.

The preset ``product-lag`` runs, per seed, three arms with the same initial weights
(``init_checkpoint(seed)``), loss, learning rate, batch shape and number of steps:

* **real**: ``rollout_demo.job.run_once`` (what ``rollout-gateway demo`` runs): a reference
  engine process and the gateway process, producer threads posting GRPO groups, the
  learner pulling trajectories over gRPC, saving each version and announcing it; the
  engine hot-swaps in place mid-generation, so sequences carry several policy versions
  and tokens are decoded over KV cache written by older weights. The lag is whatever the
  system produces under the gateway's admission bound (``max_lag``).
* **sim S=1**, **sim S=2**: the lab's in-process arm: every batch is sampled (float32, like
  the reference engine) from a frozen copy of the weights exactly ``S`` versions old.

The loss is AReaL's decoupled PPO with the log-linear proximal policy (``decoupled_ppo``,
``ratio_mode="loglinear"``): its pi_prox is built from each token's policy version, so
the correction consumes the gateway's per-token stamps directly. A step hook checks,
every step of the real arm, that the ``versions`` the loss received are exactly the
``policy_version`` stamps of the delivered rollouts, in order, and that the loss's own
``alpha_mean`` equals alpha recomputed from those stamps; it also counts sequences with
mixed versions and tokens whose KV version differs from their policy version.

Score: the held-out expected reward (``rollout_demo.lab.routing.held_out_reward``) of the
learner's weights at fixed versions, evaluated after the run (so evaluation never adds
lag to the real arm).
"""

from __future__ import annotations

import math
import random
import resource
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rollout_demo.lab.registry import Preset, RunContext, register
from rollout_demo.lab.report import claims_table
from rollout_demo.lab.routing import held_out_prompts, held_out_reward
from rollout_demo.lab.stats import claim, paired_ci


@dataclass(frozen=True)
class ProductSettings:
    loss: str = "decoupled_ppo"
    ratio_mode: str = "loglinear"
    steps: int = 24
    groups: int = 3
    group_size: int = 8
    max_new: int = 8
    lr: float = 3e-3
    max_lag: int = 2  # the gateway's admission bound (real arm)
    sim_lags: tuple[int, ...] = (1, 2)
    eval_every: int = 6
    eval_prompts: int = 24
    eval_samples: int = 2


QUICK = ProductSettings(steps=2, eval_every=1, eval_prompts=6, eval_samples=1, max_new=4,
                        sim_lags=(1,))


def _eval_steps(s: ProductSettings) -> list[int]:
    return sorted({*range(0, s.steps, s.eval_every), s.steps})


def _evaluate(ckpt: Path, snapshots: dict[int, dict], s: ProductSettings, seed: int
              ) -> tuple[list[int], list[float]]:
    """(versions, held-out expected reward) of the snapshots ``{version: state_dict}``."""
    import torch

    from learner_client.hf import load_model

    model = load_model(ckpt)
    prompts = held_out_prompts(s.eval_prompts)
    curve = []
    for v in sorted(snapshots):
        model.load_state_dict(snapshots[v])
        gen = torch.Generator().manual_seed(10_000 + 100 * seed + v)
        curve.append(held_out_reward(model, prompts, samples=s.eval_samples,
                                     max_new=s.max_new, generator=gen))
    return sorted(snapshots), curve


def _snapshot(model: Any) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class _RecordingLoss:
    """Wraps a ``LossSpec``: keeps the versions and learner_version of the last call."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.versions = None
        self.learner_version: int | None = None
        self.mask = None

    def fn(self, inputs: Any, config: Any = None):
        self.versions = inputs.versions.detach().clone()
        self.learner_version = inputs.learner_version
        self.mask = inputs.loss_mask.detach().clone()
        return self.spec.fn(inputs, config)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.spec, name)


class _RealObserver:
    """The real arm's :class:`rollout_demo.job.StepObserver`: checks every step that the
    loss consumed the gateway's stamps, counts mixed-version sequences and KV-stale
    tokens, and snapshots the weights at the evaluation versions."""

    def __init__(self, eval_versions: set[int]) -> None:
        self.eval_versions = eval_versions
        self.snapshots: dict[int, dict] = {}
        self.lags: dict[int, int] = {}
        self.recorder: _RecordingLoss | None = None
        self.stamps = {"steps_checked": 0, "versions_equal": True, "alpha_equal": True,
                       "max_alpha_error": 0.0, "mixed_version_sequences": 0, "sequences": 0,
                       "kv_older_tokens": 0, "tokens": 0}

    def started(self, learner: Any) -> None:
        self.recorder = learner.spec = _RecordingLoss(learner.spec)
        self.snapshots[0] = _snapshot(learner.model)

    def stepped(self, step: int, learner: Any, rollouts: list, result: Any) -> None:
        import torch

        from learner_client.corrections.decoupled import version_alpha

        rec, st = self.recorder, self.stamps
        trained = learner.version - 1  # the version the step trained
        given = torch.from_numpy(np.concatenate([r.policy_version for r in rollouts])
                                 .astype(np.int64))
        kv = np.concatenate([r.kv_version for r in rollouts]).astype(np.int64)
        consumed = rec.versions.reshape(-1).to(torch.int64)
        same = consumed.shape == given.shape and bool(torch.equal(consumed, given))
        st["versions_equal"] &= same and rec.learner_version == trained
        mask = rec.mask.reshape(-1) > 0
        alpha = version_alpha(given, trained)
        want = float(alpha[mask].mean()) if bool(mask.any()) else 0.0
        err = abs(want - result.metrics.get("alpha_mean", math.nan))
        st["max_alpha_error"] = max(st["max_alpha_error"], err)
        st["alpha_equal"] &= err < 1e-5
        st["steps_checked"] += 1
        st["sequences"] += len(rollouts)
        st["mixed_version_sequences"] += sum(
            int(r.policy_version.min() != r.policy_version.max()) for r in rollouts)
        st["kv_older_tokens"] += int((kv < given.numpy()).sum())
        st["tokens"] += int(given.numel())
        for lag in (trained - given[mask]).tolist():
            self.lags[int(lag)] = self.lags.get(int(lag), 0) + 1
        if learner.version in self.eval_versions:
            self.snapshots[learner.version] = _snapshot(learner.model)


def run_real(seed: int, s: ProductSettings, work: Path) -> dict:
    """The arm through the gateway; returns its ``cells`` entry."""
    from rollout_demo.job import DemoConfig, run_once
    from reference_engine.checkpoint import init_checkpoint

    cfg = DemoConfig(loss=s.loss, loss_config={"ratio_mode": s.ratio_mode}, steps=s.steps,
                     batch_groups=s.groups, group_size=s.group_size, max_new_tokens=s.max_new,
                     lr=s.lr, max_lag=s.max_lag, seed=seed, progress=False)
    obs = _RealObserver(set(_eval_steps(s)))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = run_once(cfg, sync=False, work=work, observer=obs)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the engine and gateway, reaped
    services_cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    ckpt0 = init_checkpoint(work / "eval-v0", seed=seed)
    steps, curve = _evaluate(ckpt0, obs.snapshots, s, seed)
    return {"method": "real", "lag": "gateway", "seed": seed, "eval_steps": steps,
            "eval_curve": curve, "final_eval": curve[-1], "collapsed": _collapsed(curve, res.loss_curve),
            "lag_histogram": {str(k): v for k, v in sorted(obs.lags.items())},
            "diagnostics": {**obs.stamps, "producer_429": res.producer_429,
                            "swap_failures": res.swap_failures,
                            "mean_pause_s": float(np.mean([p["pause_s"]
                                                           for p in res.pause_windows])),
                            "wall_s": res.wall_s, "services_cpu_seconds": services_cpu,
                            "mismatch_mean": _nanmean(res.mismatch),
                            "policy_gap_mean": _nanmean(res.policy_gap)}}


def _nanmean(xs: list[float]) -> float:
    """Mean of the finite values (nan when there are none)."""
    vals = [x for x in xs if math.isfinite(x)]
    return sum(vals) / len(vals) if vals else math.nan


def _collapsed(curve: list[float], losses: list[float]) -> bool:
    return bool(not all(math.isfinite(x) for x in losses) or curve[-1] < 0.5 * curve[0])


def run_sim(seed: int, lag: int, s: ProductSettings) -> dict:
    """The lab's in-process arm with an exact lag ``S``; returns its ``cells`` entry."""
    import torch

    from learner_client.hf import load_model
    from rollout_demo import task
    from rollout_demo.learner import Learner
    from rollout_demo.sampler import sample_groups
    from reference_engine.checkpoint import init_checkpoint

    work = Path(tempfile.mkdtemp(prefix="lab-product-sim-"))
    try:
        ckpt = init_checkpoint(work / "v0", seed=seed)
        torch.manual_seed(seed)
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        learner = Learner(ckpt, loss=s.loss, loss_config={"ratio_mode": s.ratio_mode},
                          lr=s.lr)
        sampler = load_model(ckpt)
        history = {0: _snapshot(learner.model)}
        wanted = set(_eval_steps(s))
        snapshots = {0: history[0]}
        lags: dict[int, int] = {}
        losses, mismatch, gap = [], [], []
        for step in range(s.steps):
            v = max(step - lag, 0)
            sampler.load_state_dict(history[v])
            prompts = [task.make_prompt(rng)[1] for _ in range(s.groups)]
            samples = sample_groups(sampler, prompts, s.group_size, s.max_new,
                                    temperature=1.0, version=v,
                                    groups=[f"{step}-{j}" for j in range(s.groups)],
                                    reward_fn=task.reward, generator=gen)
            out = learner.train_step(samples)
            losses.append(out.loss)
            mismatch.append(out.mismatch)
            gap.append(out.policy_gap)
            for x in out.lags.tolist():
                lags[int(x)] = lags.get(int(x), 0) + 1
            history[learner.version] = _snapshot(learner.model)
            history.pop(learner.version - lag - 1, None)
            if learner.version in wanted:
                snapshots[learner.version] = history[learner.version]
        steps, curve = _evaluate(ckpt, snapshots, s, seed)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"method": f"sim S={lag}", "lag": lag, "seed": seed, "eval_steps": steps,
            "eval_curve": curve, "final_eval": curve[-1], "collapsed": _collapsed(curve, losses),
            "lag_histogram": {str(k): v for k, v in sorted(lags.items())},
            "diagnostics": {"mismatch_mean": _nanmean(mismatch),
                            "policy_gap_mean": _nanmean(gap)}}


def run(ctx: RunContext) -> dict:
    s = QUICK if ctx.quick else ProductSettings()
    cells = []
    for seed in ctx.seeds:
        work = Path(tempfile.mkdtemp(prefix="lab-product-real-"))
        try:
            c = run_real(seed, s, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        cells.append(c)
        d = c["diagnostics"]
        ctx.progress(f"product real seed {seed}: held-out {c['eval_curve'][0]:.3f} -> "
                     f"{c['final_eval']:.3f}, lags {c['lag_histogram']}, stamps consumed "
                     f"{d['versions_equal'] and d['alpha_equal']}, mixed sequences "
                     f"{d['mixed_version_sequences']}/{d['sequences']}")
        for lag in s.sim_lags:
            c = run_sim(seed, lag, s)
            cells.append(c)
            ctx.progress(f"product sim S={lag} seed {seed}: held-out "
                         f"{c['eval_curve'][0]:.3f} -> {c['final_eval']:.3f}")
    settings = {**asdict(s), "sim_lags": list(s.sim_lags)}
    real = [c for c in cells if c["method"] == "real"]
    mean_lag = [_mean_lag(c["lag_histogram"]) for c in real]
    services = sum(c["diagnostics"]["services_cpu_seconds"] for c in real)
    results = {"settings": settings, "cells": cells,
               "claims": claims({"cells": cells, "seeds": ctx.seeds, "settings": settings}),
               "real_mean_lag": mean_lag, "services_cpu_seconds": services}
    plot(results, ctx.out)
    return results


def _plot_arms(cells: list[dict], title: str, path: Path) -> None:
    """Mean held-out curve per method (thin lines: the seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, m in enumerate(dict.fromkeys(c["method"] for c in cells)):
        color = f"C{i}"
        mine = [c for c in cells if c["method"] == m]
        for c in mine:
            ax.plot(c["eval_steps"], c["eval_curve"], color=color, alpha=0.2, lw=0.8)
        if len({tuple(c["eval_steps"]) for c in mine}) == 1:
            mean = np.mean([c["eval_curve"] for c in mine], axis=0)
            ax.plot(mine[0]["eval_steps"], mean, color=color, lw=2, label=m)
    ax.set(xlabel="policy version (optimizer steps)", ylabel="held-out expected reward",
           ylim=(0, 1.02), title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot(results: dict, out: Path) -> None:
    """Held-out curves per arm, and the per-token lag histograms side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = results["cells"]
    _plot_arms(cells, "real (gateway) vs simulated lag", out / "arms_curves.png")
    methods = list(dict.fromkeys(c["method"] for c in cells))
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        total: dict[int, int] = {}
        for c in cells:
            if c["method"] == m:
                for k, v in c["lag_histogram"].items():
                    total[int(k)] = total.get(int(k), 0) + v
        n = sum(total.values()) or 1
        ks = sorted(total)
        ax.bar(np.asarray(ks) + i * width, [total[k] / n for k in ks], width, label=m)
    ax.set(xlabel="per-token lag (versions)", ylabel="share of trained tokens",
           title="lag distribution")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "product_lags.png", dpi=90)
    plt.close(fig)


def claims(res: dict) -> list[dict]:
    """The preset's paired claims from ``res["cells"]``: the real arm against each sim lag."""
    cells, seeds, st = res["cells"], res["seeds"], res["settings"]
    return [claim(f"the real arm differs from the simulated lag S={lag}", "real", f"sim S={lag}",
                  f"held-out expected reward after {st['steps']} steps",
                  _vals(cells, "real", seeds), _vals(cells, f"sim S={lag}", seeds))
            for lag in st["sim_lags"]]


def _vals(cells: list[dict], method: str, seeds: list[int]) -> list[float]:
    by_seed = {c["seed"]: c["final_eval"] for c in cells if c["method"] == method}
    return [by_seed[x] for x in seeds]


def _mean_lag(hist: dict[str, int]) -> float:
    n = sum(hist.values())
    return sum(int(k) * v for k, v in hist.items()) / n if n else math.nan


def _hist_share(cells: list[dict], method: str) -> str:
    total: dict[int, int] = {}
    for c in cells:
        if c["method"] == method:
            for k, v in c["lag_histogram"].items():
                total[int(k)] = total.get(int(k), 0) + v
    n = sum(total.values())
    return ", ".join(f"{k}: {v / n:.0%}" for k, v in sorted(total.items()))


def render(results: dict) -> str:
    s = results["settings"]
    cells, seeds = results["cells"], results["seeds"]
    methods = list(dict.fromkeys(c["method"] for c in cells))
    rows = ["| arm | per-token lag (share of trained tokens) | held-out reward at step 0 | "
            f"after {s['steps']} steps (mean, 95% CI) | collapsed | mean abs(log pi - log mu) "
            "(all tokens / fresh tokens) |", "|---|---|---|---|---|---|"]
    for m in methods:
        mc = [c for c in cells if c["method"] == m]
        vals = _vals(cells, m, seeds)
        d = paired_ci(vals, [0.0] * len(vals))
        ci = f"{d.mean:.3f}" if not math.isfinite(d.lo) else f"{d.mean:.3f} [{d.lo:.3f}, {d.hi:.3f}]"
        rows.append(f"| {m} | {_hist_share(cells, m)} | "
                    f"{np.mean([c['eval_curve'][0] for c in mc]):.3f} | {ci} | "
                    f"{sum(c['collapsed'] for c in mc)}/{len(mc)} | {_gaps(mc)} |")
    real = [c for c in cells if c["method"] == "real"]
    dg = [c["diagnostics"] for c in real]
    ok = all(d["versions_equal"] and d["alpha_equal"] for d in dg)
    steps_checked = sum(d["steps_checked"] for d in dg)
    mixed = sum(d["mixed_version_sequences"] for d in dg)
    seqs = sum(d["sequences"] for d in dg)
    kv_old = sum(d["kv_older_tokens"] for d in dg)
    toks = sum(d["tokens"] for d in dg)
    agree = [c for c in results["claims"]]
    sentence = "; ".join(
        f"real - {c['b']}: {c['mean_diff']:+.3f} [{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}] "
        f"({'agree within the CI' if c['verdict'] == 'not distinguishable' else 'differ'})"
        for c in agree)
    return f"""**Claim**: the lab's simulated lag (a frozen copy of the weights `S` versions
old) stands for the lag the product makes, and the corrections consume what the gateway
stamps on each token.

**Experiment** (`rollout_demo/lab/product.py`, preset `product-lag`): per seed the same
initial weights, loss (`{s['loss']}`, `ratio_mode="{s['ratio_mode']}"`: pi_prox from each
token's policy version), Adam lr {s['lr']:g}, {s['steps']} steps of {s['groups']} groups x
{s['group_size']} samples x {s['max_new']} tokens, in three arms: **real** =
`rollout_demo.job.run_once` (the `rollout-gateway demo` machinery: one reference engine
process and the gateway process, rollouts over HTTP, the learner over gRPC, a checkpoint
announced after every step and hot-swapped in place mid-generation, admission bound
`max_lag={s['max_lag']}`), and **sim S=1/2** = the lab's in-process sampler at an exact lag.
Score: held-out expected reward of the learner's weights at versions
{', '.join(map(str, _eval_steps_from(s)))}, evaluated after the run.

{chr(10).join(rows)}

What the gateway stamped is what the correction consumed: on all {steps_checked} real steps
the `versions` column the loss received equals the delivered rollouts' `policy_version`
stamps token for token, and the loss's `alpha_mean` equals alpha recomputed from the
stamps ({'all checks held' if ok else 'A CHECK FAILED'}; largest alpha error
{max(d['max_alpha_error'] for d in dg):.1e}). In-flight swaps really happened:
{mixed}/{seqs} trained sequences carry more than one policy version, and {kv_old}/{toks}
tokens were decoded over KV cache written by older weights.

{claims_table(results)}
**Verdict**: {sentence}. The real arm's lag is a mixture (mean
{np.mean(results['real_mean_lag']):.2f} versions), the simulated arms' a constant; the held-out
rewards are compared at equal versions, with the CIs above.

**What differs and why**: the real lag is set by timing (generation speed against the
learner's step and swap time under the admission bound), so it varies from step to step
and within a sequence; the simulated arm has one version per sequence and none of the KV
staleness; the real arm's prompts come from the producers' stream and its samples from the
engine's own sampler, so only the initial weights are paired per seed. One engine, a
toy model, {s['steps']} steps: the arms can only be said to agree within the CI, not to be
equal.
Cost: the engine and gateway processes of the real arm used
{results.get('services_cpu_seconds', 0) / 60:.1f} CPU minutes besides the lab process's.

![held-out curves per arm](lab/{results['preset']}/arms_curves.png)
![per-token lag distributions](lab/{results['preset']}/product_lags.png)
"""


def _gaps(cells: list[dict]) -> str:
    """Mean over seeds of the policy gap (all active tokens: staleness + mismatch) and of
    the mismatch (tokens whose weights and KV were the learner's own), when recorded."""
    g = [c["diagnostics"].get("policy_gap_mean", math.nan) for c in cells]
    m = [c["diagnostics"].get("mismatch_mean", math.nan) for c in cells]
    if not any(math.isfinite(x) for x in g):
        return "not recorded"
    return f"{_nanmean(g):.3f} / {_nanmean(m):.4f}"


def _eval_steps_from(s: dict) -> list[int]:
    return sorted({*range(0, s["steps"], s["eval_every"]), s["steps"]})


register(Preset(
    name="product-lag", paper="product",
    summary="real lag from the gateway + engine with in-place hot-swaps vs simulated S=1,2",
    cpu_minutes=3.0, run=run, render=render, claims=claims))
