"""The first staleness lab's grid: train the toy MoE with a controlled lag, all corrections.

    python -m rollout_demo.lab --grid --out docs/lab/grid          # the first lab's run
    python -m rollout_demo.lab --grid --quick --out /tmp/lab       # a smoke run

In process (no engine processes, so the lag is exact): at optimizer step k the batch is
sampled from the policy of version ``max(k - S, 0)`` (a frozen copy, run in bfloat16 while
the learner trains in float32, so behaviour and learner disagree the way an inference
engine and a trainer do: that is the train-inference mismatch TIS/MIS and routing replay
address). Each run records the reward curve, clip/mask rates, |log pi - log mu| and
whether it collapsed.

Collapse (defined here, detected per run from its reward curve): the loss becomes
non-finite; or the 5-step moving mean of the reward ever falls below half its starting
value (the policy moved away from the target, below the random initialization); or it
ends more than 0.25 below its running peak after that peak exceeded 0.3 (a run that
learned and then unlearned).

The learning-rate probe: for each loss and lag, the largest learning rate of a grid whose
runs (all seeds) do not collapse (and end with reward at least ``--stable-reward``,
default 0); the staleness theory (arXiv 2607.01083) predicts it shrinks like 1/S.

``--summarize lab.json`` recomputes the table and plots from a finished run's curves.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

#: (label, loss, routing replay)
METHODS = [
    ("grpo", "grpo", True), ("gspo", "gspo", True), ("tis", "tis", True),
    ("decoupled_ppo", "decoupled_ppo", True), ("ppo_ewma", "ppo_ewma", True),
    ("sat", "sat", True), ("sat_gspo", "sat_gspo", True),
    ("sat_gspo (no R3)", "sat_gspo", False), ("estr", "estr", True),
]


@dataclass
class RunSpec:
    label: str
    loss: str
    replay: bool
    lag: int
    seed: int
    lr: float
    steps: int
    groups: int
    group_size: int
    max_new: int
    sampler_dtype: str = "bfloat16"


@dataclass
class RunOut:
    spec: RunSpec
    rewards: list[float]
    clip_rate: float
    mask_rate: float
    policy_gap: float
    mismatch_step0: float
    final_reward: float
    peak_reward: float
    collapsed: bool
    nonfinite: bool
    wall_s: float


def moving(x: list[float], k: int = 5) -> np.ndarray:
    a = np.asarray(x, float)
    if a.size < k:
        return a
    return np.convolve(a, np.ones(k) / k, mode="valid")


def detect_collapse(rewards: list[float], nonfinite: bool, *, drop: float = 0.25,
                    floor: float = 0.3) -> bool:
    """See the module docstring."""
    if nonfinite:
        return True
    m = moving(rewards)
    if m.size == 0:
        return False
    if bool((m < 0.5 * m[0]).any()):
        return True
    peak = np.maximum.accumulate(m)
    fell = (peak > floor) & (m < peak - drop)
    return bool(fell[-1])


def run_one(spec: RunSpec, ckpt: Path) -> RunOut:
    import torch

    from learner_client.old_logits import EwmaWeightTracker
    from rollout_demo import task
    from rollout_demo.learner import Learner
    from rollout_demo.sampler import sample_groups

    torch.manual_seed(spec.seed)
    rng, gen = random.Random(spec.seed), torch.Generator().manual_seed(spec.seed)
    learner = Learner(ckpt, loss=spec.loss, lr=spec.lr, replay=spec.replay)
    dtype = getattr(torch, spec.sampler_dtype)
    sampler = copy.deepcopy(learner.model).to(dtype)
    snapshots = {0: {k: v.detach().clone() for k, v in learner.model.state_dict().items()}}
    tracker = prox = None
    if spec.loss == "ppo_ewma":
        tracker = EwmaWeightTracker(w_stale=spec.lag)
        tracker.update(learner.model.state_dict())
        prox = copy.deepcopy(learner.model)
    rewards, clips, masks, gaps = [], [], [], []
    nonfinite = False
    mismatch0 = float("nan")
    t0 = time.monotonic()
    for step in range(spec.steps):
        v = max(step - spec.lag, 0)
        sampler.load_state_dict(snapshots[v])
        prompts = [task.make_prompt(rng)[1] for _ in range(spec.groups)]
        samples = sample_groups(sampler, prompts, spec.group_size, spec.max_new,
                                temperature=1.0, version=v,
                                groups=[f"{step}-{j}" for j in range(spec.groups)],
                                reward_fn=task.reward, generator=gen)
        if prox is not None:
            prox.load_state_dict(tracker.weights)
        out = learner.train_step(samples, prox_model=prox)
        if tracker is not None:
            tracker.update(learner.model.state_dict())
        if step == 0:
            mismatch0 = out.policy_gap  # same weights, bf16 vs fp32: pure mismatch
        rewards.append(out.reward_mean)
        clips.append(out.clip_rate)
        masks.append(out.mask_rate)
        gaps.append(out.policy_gap)
        snapshots[learner.version] = {k: v.detach().clone()
                                      for k, v in learner.model.state_dict().items()}
        snapshots.pop(learner.version - spec.lag - 1, None)
        if not math.isfinite(out.loss):
            nonfinite = True
            break
    tail = rewards[-max(1, len(rewards) // 5):]
    m = moving(rewards)
    return RunOut(spec=spec, rewards=rewards, clip_rate=float(np.nanmean(clips)),
                  mask_rate=float(np.nanmean(masks)), policy_gap=float(np.nanmean(gaps)),
                  mismatch_step0=mismatch0, final_reward=float(np.mean(tail)),
                  peak_reward=float(m.max()) if m.size else float("nan"),
                  collapsed=detect_collapse(rewards, nonfinite), nonfinite=nonfinite,
                  wall_s=time.monotonic() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rollout_demo.lab --grid", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="lab-out")
    p.add_argument("--lags", default="1,4,8")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--probe-lrs", default="3e-3,1e-2,3e-2",
                   help="learning-rate grid of the 1/S probe ('' skips it)")
    p.add_argument("--probe-losses", default="grpo,sat")
    p.add_argument("--probe-seeds", type=int, default=1)
    p.add_argument("--stable-reward", type=float, default=0.0)
    p.add_argument("--summarize", metavar="LAB_JSON",
                   help="recompute table and plots from a finished run's lab.json")
    p.add_argument("--methods", default="",
                   help="comma-separated labels (default: all; 'none': only the lr probe)")
    p.add_argument("--quick", action="store_true", help="2 methods, lag 1 and 4, 6 steps")
    args = p.parse_args(argv)
    if args.summarize:
        return resummarize(Path(args.summarize), Path(args.out), args.stable_reward)
    import torch

    from reference_engine.checkpoint import init_checkpoint

    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = init_checkpoint(out / ".ckpt-v0", seed=0)
    lags = [int(x) for x in args.lags.split(",")]
    methods = METHODS
    if args.methods == "none":  # the learning-rate probe only
        methods = []
    elif args.methods:
        want = set(args.methods.split(","))
        methods = [m for m in METHODS if m[0] in want]
    steps, seeds, probe_lrs = args.steps, args.seeds, [float(x) for x in args.probe_lrs.split(",") if x]
    probe_losses = [x for x in args.probe_losses.split(",") if x]
    if args.quick:
        methods = methods if args.methods else [METHODS[0], METHODS[5]]
        lags, steps, seeds = [1, 4], 6, 1
        probe_lrs, probe_losses = probe_lrs[:2], probe_losses[:1]
    base = dict(steps=steps, groups=3, group_size=8, max_new=8)
    runs: list[RunOut] = []
    t0 = time.monotonic()
    for label, loss, replay in methods:
        for lag in lags:
            for seed in range(seeds):
                r = run_one(RunSpec(label, loss, replay, lag, seed, args.lr, **base), ckpt)
                runs.append(r)
                print(f"[{time.monotonic() - t0:6.0f}s] {label:18s} lag {lag} seed {seed}: "
                      f"final {r.final_reward:.2f} peak {r.peak_reward:.2f} "
                      f"collapsed {r.collapsed}", flush=True)
    probe: list[RunOut] = []
    for loss in probe_losses:
        for lag in lags:
            for lr in probe_lrs:
                for seed in range(args.probe_seeds):
                    r = run_one(RunSpec(loss, loss, True, lag, seed, lr, **base), ckpt)
                    probe.append(r)
                    print(f"[{time.monotonic() - t0:6.0f}s] probe {loss} lag {lag} lr {lr:g} "
                          f"seed {seed}: final {r.final_reward:.2f} collapsed {r.collapsed}",
                          flush=True)
    result = summarize(runs, probe, args.stable_reward)
    result["settings"] = {**base, "lags": lags, "seeds": seeds, "lr": args.lr,
                          "probe_lrs": probe_lrs, "probe_losses": probe_losses,
                          "probe_seeds": args.probe_seeds, "stable_reward": args.stable_reward,
                          "sampler_dtype": "bfloat16", "learner_dtype": "float32",
                          "wall_s": time.monotonic() - t0}
    result["num_main_runs"] = len(runs)
    result["runs"] = [{**asdict(r.spec), **{k: v for k, v in asdict(r).items() if k != "spec"}}
                      for r in runs + probe]
    (out / "lab.json").write_text(json.dumps(result, indent=2))
    (out / "table.md").write_text(table_md(result))
    plots(runs, probe, result, out)
    import shutil

    shutil.rmtree(out / ".ckpt-v0", ignore_errors=True)
    print(table_md(result))
    return 0


def resummarize(path: Path, out: Path, stable_reward: float) -> int:
    """Table and plots again from ``lab.json`` (collapse re-detected from the curves)."""
    data = json.loads(path.read_text())
    fields = {f for f in RunSpec.__dataclass_fields__}
    main_runs, probe = [], []
    n_main = data.get("num_main_runs")
    for i, d in enumerate(data["runs"]):
        spec = RunSpec(**{k: v for k, v in d.items() if k in fields})
        nonfinite = bool(d["nonfinite"])
        r = RunOut(spec=spec, rewards=d["rewards"], clip_rate=d["clip_rate"],
                   mask_rate=d["mask_rate"], policy_gap=d["policy_gap"],
                   mismatch_step0=d["mismatch_step0"], final_reward=d["final_reward"],
                   peak_reward=d["peak_reward"],
                   collapsed=detect_collapse(d["rewards"], nonfinite), nonfinite=nonfinite,
                   wall_s=d["wall_s"])
        is_probe = (i >= n_main) if n_main is not None else (
            i >= len(data["table"]) * data["settings"]["seeds"])
        (probe if is_probe else main_runs).append(r)
    result = summarize(main_runs, probe, stable_reward)
    result["settings"] = {**data["settings"], "stable_reward": stable_reward}
    result["num_main_runs"] = len(main_runs)
    result["runs"] = [{**asdict(r.spec), **{k: v for k, v in asdict(r).items() if k != "spec"}}
                      for r in main_runs + probe]
    out.mkdir(parents=True, exist_ok=True)
    (out / "lab.json").write_text(json.dumps(result, indent=2))
    (out / "table.md").write_text(table_md(result))
    plots(main_runs, probe, result, out)
    print(table_md(result))
    return 0


def summarize(runs: list[RunOut], probe: list[RunOut], stable_reward: float) -> dict:
    rows = []
    keys = list(dict.fromkeys((r.spec.label, r.spec.lag) for r in runs))
    for label, lag in keys:
        rs = [r for r in runs if r.spec.label == label and r.spec.lag == lag]
        rows.append({"method": label, "lag": lag, "seeds": len(rs),
                     "final_reward": float(np.mean([r.final_reward for r in rs])),
                     "final_reward_min": float(np.min([r.final_reward for r in rs])),
                     "collapsed": sum(r.collapsed for r in rs),
                     "clip_rate": float(np.mean([r.clip_rate for r in rs])),
                     "mask_rate": float(np.mean([r.mask_rate for r in rs])),
                     "policy_gap": float(np.mean([r.policy_gap for r in rs])),
                     "mismatch_step0": float(np.mean([r.mismatch_step0 for r in rs]))})
    lr_rows = []
    for loss, lag in dict.fromkeys((r.spec.loss, r.spec.lag) for r in probe):
        ok = []
        for lr in sorted({r.spec.lr for r in probe}):
            rs = [r for r in probe if (r.spec.loss, r.spec.lag, r.spec.lr) == (loss, lag, lr)]
            if rs and all(not r.collapsed and r.final_reward >= stable_reward for r in rs):
                ok.append(lr)
        best = max(ok) if ok else None
        lr_rows.append({"loss": loss, "lag": lag, "largest_stable_lr": best,
                        "lr_times_lag": best * lag if best else None})
    return {"table": rows, "lr_probe": lr_rows}


def table_md(result: dict) -> str:
    lines = ["| method | lag S | final reward (mean / min over seeds) | collapsed | clip rate | "
             "mask rate | mean abs(log pi - log mu) | mismatch at step 0 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["table"]:
        lines.append(f"| {r['method']} | {r['lag']} | {r['final_reward']:.2f} / "
                     f"{r['final_reward_min']:.2f} | {r['collapsed']}/{r['seeds']} | "
                     f"{r['clip_rate']:.3f} | {r['mask_rate']:.3f} | {r['policy_gap']:.3f} | "
                     f"{r['mismatch_step0']:.4f} |")
    if result["lr_probe"]:
        lines += ["", "| loss | lag S | largest stable lr | lr x S |", "|---|---|---|---|"]
        for r in result["lr_probe"]:
            lr = "none" if r["largest_stable_lr"] is None else f"{r['largest_stable_lr']:g}"
            ls = "-" if r["lr_times_lag"] is None else f"{r['lr_times_lag']:g}"
            lines.append(f"| {r['loss']} | {r['lag']} | {lr} | {ls} |")
    return "\n".join(lines) + "\n"


def plots(runs: list[RunOut], probe: list[RunOut], result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    lags = sorted({r.spec.lag for r in runs + probe})
    labels = list(dict.fromkeys(r.spec.label for r in runs))
    if runs:
        _grid_plots(runs, result, out, lags, labels)
    if probe:
        _probe_plot(probe, out, lags)


def _grid_plots(runs: list[RunOut], result: dict, out: Path, lags: list[int],
                labels: list[str]) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(lags), figsize=(5 * len(lags), 4), sharey=True,
                             squeeze=False)
    for ax, lag in zip(axes[0], lags):
        for label in labels:
            rs = [r for r in runs if r.spec.label == label and r.spec.lag == lag]
            curve = np.mean([r.rewards for r in rs if len(r.rewards) == rs[0].spec.steps]
                            or [rs[0].rewards], axis=0)
            ax.plot(np.arange(1, len(curve) + 1), curve, label=label)
        ax.set(title=f"lag S = {lag}", xlabel="optimizer step", ylim=(-0.02, 1.02))
    axes[0][0].set_ylabel("mean reward (mean over seeds)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "lab_rewards.png", dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(len(lags), 1)
    x = np.arange(len(labels))
    for i, lag in enumerate(lags):
        vals = [next((r["final_reward"] for r in result["table"]
                      if r["method"] == lb and r["lag"] == lag), np.nan) for lb in labels]
        ax.bar(x + i * width, vals, width, label=f"S={lag}")
    ax.set_xticks(x + width * (len(lags) - 1) / 2, labels, rotation=35, ha="right", fontsize=8)
    ax.set(ylabel="final reward (last fifth)", ylim=(0, 1.2), title="final reward by lag")
    ax.legend(loc="upper center", ncol=len(lags), fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "lab_final.png", dpi=90)
    plt.close(fig)



def _probe_plot(probe: list[RunOut], out: Path, lags: list[int]) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    pts = sorted({r.spec.lr for r in probe})
    for loss in dict.fromkeys(r.spec.loss for r in probe):
        for lag in lags:
            sel = [[r for r in probe if (r.spec.loss, r.spec.lag, r.spec.lr) == (loss, lag, lr)]
                   for lr in pts]
            vals = [np.mean([r.final_reward for r in rs]) if rs else np.nan for rs in sel]
            line, = ax.plot(pts, vals, "o-", label=f"{loss} S={lag}")
            bad = [(lr, v) for lr, v, rs in zip(pts, vals, sel) if rs and any(r.collapsed for r in rs)]
            if bad:
                ax.plot(*zip(*bad), "x", color=line.get_color(), markersize=12)
    ax.set(xscale="log", xlabel="learning rate", ylabel="final reward (x: a seed collapsed)",
           title="learning-rate probe", ylim=(-0.02, 1.02))
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "lab_lr_probe.png", dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
