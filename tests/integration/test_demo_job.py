"""`rollout-gateway demo` as a user runs it: a real process that starts reference engines and
the gateway, trains the toy MoE over gRPC with a hot-swap every step, and writes the report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _demo(out: Path, *extra: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "rollout_gateway", "demo", "--out", str(out), "--no-progress",
         "--batch-groups", "2", "--group-size", "4", "--max-new-tokens", "6", *extra],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_demo_trains_hot_swaps_and_writes_the_report(tmp_path):
    out = tmp_path / "demo"
    steps = 5
    p = _demo(out, "--steps", str(steps), "--loss", "sat", "--swap-mode", "retract",
              "--compare-sync")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "async/sync throughput ratio:" in p.stdout
    rep = json.loads((out / "report.json").read_text())
    assert rep["loss"] == "sat" and rep["steps"] == steps and rep["swap_mode"] == "retract"
    assert len(rep["reward_curve"]) == steps
    assert all(0.0 <= r <= 1.0 for r in rep["reward_curve"])
    # every trained token is counted once in the lag histogram, lags within the bound
    hist = {int(k): v for k, v in rep["lag_histogram"].items()}
    assert sum(hist.values()) == rep["train_tokens"] == steps * 2 * 4 * 6
    assert min(hist) >= 0 and max(hist) <= rep["max_lag"]
    # one hot-swap per optimizer step, each accepted, versions 1..steps in order
    assert rep["swap_failures"] == 0
    assert [w["version"] for w in rep["pause_windows"]] == list(range(1, steps + 1))
    assert all(w["end_s"] >= w["start_s"] >= 0 and w["pause_s"] >= 0
               for w in rep["pause_windows"])
    assert 0.0 <= rep["clip_rate"]["mean"] <= 1.0 and 0.0 <= rep["mask_rate"]["mean"] <= 1.0
    assert rep["tokens_per_s"] > 0 and rep["sync"]["tokens_per_s"] > 0
    assert rep["async_sync_ratio"] == pytest.approx(
        rep["tokens_per_s"] / rep["sync"]["tokens_per_s"])
    # the synchronous baseline trains on fresh samples only
    assert set(rep["sync"]["lag_histogram"]) == {"0"}
    for name in rep["plots"]:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, name


def test_demo_megatron_learner_on_redis_with_decoupled_ppo(tmp_path):
    """The megatron-core learner's checkpoints are what the engines hot-swap (accepted,
    every step), with Redis as store and registry, the learner reading the trajectory
    bytes from Redis by reference."""
    pytest.importorskip("megatron.core")
    import redis

    out = tmp_path / "demo"
    p = _demo(out, "--steps", "2", "--loss", "decoupled_ppo", "--swap-mode", "abort_resume",
              "--redis-url", "redis://127.0.0.1:6379/0", "--learner", "megatron",
              "--by-reference")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert rep["store"] == "redis" and rep["loss"] == "decoupled_ppo"
    assert rep["learner"] == "megatron"
    assert rep["by_reference"] and rep["fetched_by_reference"] >= rep["rollouts_trained"] > 0
    assert len(rep["reward_curve"]) == 2 and rep["swap_failures"] == 0
    assert [w["version"] for w in rep["pause_windows"]] == [1, 2]
    prefix = rep["redis_prefix"]
    assert prefix.startswith("demo-")
    r = redis.Redis()
    try:  # the run's own keys are removed at the end
        assert not list(r.scan_iter(f"{prefix}:*"))
    finally:
        r.close()


def test_demo_refuses_an_unknown_loss(tmp_path):
    p = _demo(tmp_path / "x", "--loss", "nope", "--steps", "1", timeout=60)
    assert p.returncode == 2
    assert "unknown --loss 'nope'" in p.stdout and "sat" in p.stdout
    assert not (tmp_path / "x").exists()


def test_demo_by_reference_needs_redis(tmp_path):
    p = _demo(tmp_path / "x", "--by-reference", "--steps", "1", timeout=60)
    assert p.returncode == 2 and "--by-reference needs --redis-url" in p.stdout
    assert not (tmp_path / "x").exists()
