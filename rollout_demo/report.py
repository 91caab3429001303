"""report.json and PNG plots of a demo run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np

REPORT = "report.json"
PLOTS = ("reward.png", "lag_histogram.png", "rates.png", "pauses.png")


def _moving(x: list[float], k: int = 5) -> np.ndarray:
    a = np.asarray(x, dtype=float)
    if a.size < k:
        return a
    c = np.convolve(a, np.ones(k) / k, mode="valid")
    return np.concatenate((np.full(k - 1, np.nan), c))


def write_report(cfg, runs: dict, out: Path) -> dict:
    """Write ``out/report.json`` and the plots; returns the report dict."""
    main = runs["async"]
    rewards = main.reward_curve
    head = float(np.mean(rewards[: max(1, len(rewards) // 5)]))
    tail = float(np.mean(rewards[-max(1, len(rewards) // 5):]))
    report = {
        "loss": cfg.loss, "learner": cfg.learner, "steps": main.steps, "swap_mode": cfg.swap_mode,
        "store": "redis" if cfg.redis_url else "embedded", "engines": cfg.engines,
        "by_reference": cfg.by_reference, "fetched_by_reference": main.fetched_by_reference,
        "batch": {"groups": cfg.batch_groups, "group_size": cfg.group_size,
                  "max_new_tokens": cfg.max_new_tokens},
        "routing_replay": cfg.replay, "max_lag": cfg.max_lag, "lr": cfg.lr,
        "reward_curve": rewards, "reward_first_fifth": head, "reward_last_fifth": tail,
        "loss_curve": main.loss_curve,
        "lag_histogram": main.lag_histogram,
        "clip_rate": {"mean": _mean(main.clip_rate), "per_step": main.clip_rate},
        "mask_rate": {"mean": _mean(main.mask_rate), "per_step": main.mask_rate},
        "train_inference_mismatch": {
            "mean_abs_logprob_diff": _mean(main.mismatch), "per_step": main.mismatch,
            "note": "tokens whose policy and KV versions equal the learner's (lag 0); "
                    "null when every token was stale"},
        "policy_gap": {"mean_abs_logprob_diff": _mean(main.policy_gap),
                       "per_step": main.policy_gap,
                       "note": "|log pi - log mu| over all trained tokens: staleness + mismatch"},
        "pause_windows": main.pause_windows,
        "tokens_per_s": main.tokens_per_s, "wall_s": main.wall_s,
        "train_tokens": main.train_tokens, "rollouts_trained": main.rollouts_trained,
        "producer": {"refused_429": main.producer_429, "errors": main.producer_errors},
        "swap_failures": main.swap_failures,
        "gateway_metrics": main.gateway_metrics,
        "redis_prefix": main.redis_prefix,
    }
    if "sync" in runs:
        s = runs["sync"]
        report["sync"] = {k: v for k, v in asdict(s).items() if k != "gateway_metrics"}
        report["async_sync_ratio"] = (main.tokens_per_s / s.tokens_per_s
                                      if s.tokens_per_s > 0 else None)
    report["plots"] = list(PLOTS)
    (out / REPORT).write_text(json.dumps(report, indent=2))
    plot(report, runs, out)
    return report


def _mean(x: list[float]) -> float | None:
    a = np.asarray(x, dtype=float)
    a = a[np.isfinite(a)]
    return float(a.mean()) if a.size else None


def plot(report: dict, runs: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    title = f"{report['loss']} / {report['swap_mode']}"
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for name, run in runs.items():
        x = np.arange(1, len(run.reward_curve) + 1)
        ax.plot(x, run.reward_curve, alpha=0.35, label=f"{name} (per step)")
        ax.plot(x, _moving(run.reward_curve), label=f"{name} (5-step mean)")
    ax.set(xlabel="optimizer step", ylabel="mean reward", ylim=(-0.02, 1.02),
           title=f"reward: {title}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "reward.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4))
    h = report["lag_histogram"]
    ks = [int(k) for k in h]
    ax.bar(ks, [h[str(k)] for k in ks], color="tab:blue")
    ax.set(xlabel="lag at train time (learner version - token's policy version)",
           ylabel="tokens", title="per-token lag (async)")
    ax.set_xticks(ks)
    fig.tight_layout()
    fig.savefig(out / "lag_histogram.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4))
    main = runs["async"]
    x = np.arange(1, len(main.clip_rate) + 1)
    ax.plot(x, main.clip_rate, label="clip rate")
    ax.plot(x, main.mask_rate, label="mask rate")
    ax.plot(x, main.policy_gap, label="|log pi - log mu| (all tokens)")
    if np.isfinite(np.asarray(main.mismatch, float)).any():
        ax.plot(x, main.mismatch, ".", label="|log pi - log mu| (lag-0 tokens)")
    ax.set(xlabel="optimizer step", title=f"correction diagnostics: {title}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "rates.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for name, run in runs.items():
        w = run.pause_windows
        ax.plot([p["version"] for p in w], [p["pause_s"] * 1000 for p in w], ".", label=name)
    ax.set(xlabel="weight version", ylabel="engine pause (ms)",
           title=f"hot-swap pause per step ({report['swap_mode']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "pauses.png", dpi=100)
    plt.close(fig)
