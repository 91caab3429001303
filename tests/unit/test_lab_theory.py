"""The theory and old-logit presets: their pure parts, and a --quick smoke of each preset
through the CLI's run_preset (results.json written, rendered, claims well formed)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rollout_demo.lab.oldlogit import version_schedule
from rollout_demo.lab.theory import bias_squared, bisect_eta_max, collapsed_by, lr_grid


def test_bias_squared_removes_the_sampling_noise():
    gen = torch.Generator().manual_seed(0)
    p, n = 400, 64
    shift = torch.zeros(p, dtype=torch.float64)
    shift[:4] = 0.5  # ||E g_stale - E g_fresh||^2 = 4 * 0.25 = 1
    stale = torch.randn(n, p, generator=gen, dtype=torch.float64) + shift
    fresh = torch.randn(n, p, generator=gen, dtype=torch.float64)
    naive = float((stale.mean(0) - fresh.mean(0)).pow(2).sum())
    est = bias_squared(stale, fresh)
    assert naive > 1.0 + 0.8 * 2 * p / n  # the raw distance is dominated by noise
    assert est == pytest.approx(1.0, abs=0.5)
    # no bias: the estimate scatters around 0 (either sign), far below the raw distance
    same = bias_squared(torch.randn(n, p, generator=gen, dtype=torch.float64),
                        torch.randn(n, p, generator=gen, dtype=torch.float64))
    assert abs(same) < 1.0


def test_bisection_finds_the_largest_stable_grid_point_in_log_calls():
    for true in range(-1, 9):
        calls: list[int] = []

        def stable(i: int, calls: list[int] = calls, true: int = true) -> bool:
            calls.append(i)
            return i <= true

        idx, seen = bisect_eta_max(stable, 9)
        assert idx == true and set(seen) == set(calls)
        assert len(calls) == len(set(calls)) <= 4  # ceil(log2(10))
    grid = lr_grid(4e-3, 3)
    assert grid[2] == pytest.approx(8e-3) and grid[1] == pytest.approx(4e-3 * math.sqrt(2))


def test_collapse_is_judged_on_the_last_two_evals_up_to_the_horizon():
    learning = [(0, 0.1, 3.0), (4, 0.2, 2.5), (8, 0.4, 1.5), (12, 0.7, 0.3)]
    assert not collapsed_by(learning, 12, None)  # deterministic but good: not dead
    assert collapsed_by(learning, 12, 9)  # non-finite loss by then
    assert not collapsed_by(learning, 12, 13)
    worse = [(0, 0.1, 3.0), (4, 0.1, 2.0), (8, 0.04, 0.1), (12, 0.03, 0.0)]
    assert collapsed_by(worse, 12, None) and not collapsed_by(worse, 4, None)
    dead = [(0, 0.1, 3.0), (4, 0.3, 1.0), (8, 0.38, 0.0), (12, 0.38, 0.0)]
    assert collapsed_by(dead, 12, None)
    one_dip = [(0, 0.1, 3.0), (4, 0.02, 2.0), (8, 0.12, 2.0), (12, 0.15, 2.0)]
    assert not collapsed_by(one_dip, 12, None)  # one noisy eval is not a collapse


def test_version_schedule_spans_s_versions_mid_rollout():
    assert version_schedule(10, 4, 8) == [6, 6, 7, 7, 8, 8, 9, 9]  # lags 4..1
    assert version_schedule(10, 1, 8) == [9] * 8
    assert version_schedule(1, 4, 8) == [0, 0, 0, 0, 0, 0, 0, 0]
    assert version_schedule(2, 4, 4) == [0, 0, 0, 1]


@pytest.mark.parametrize("preset", ["theory-bias", "theory-etamax", "old-logits"])
def test_quick_preset_writes_results_and_renders(preset, tmp_path):
    from rollout_demo.lab.__main__ import run_preset

    res = run_preset(preset, [0, 1], tmp_path, quick=True)
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["preset"] == preset and on_disk["seeds"] == [0, 1]
    assert res["cells"] and all({"method", "lag", "seed"} <= set(c) for c in res["cells"])
    for c in res["claims"]:
        assert c["n"] == 2 and c["verdict"] in ("reproduced", "not reproduced",
                                                "not distinguishable")
    from rollout_demo.lab.registry import load_presets

    md = load_presets()[preset].render(on_disk)
    assert "**Claim" in md and "**Verdict" in md and "**Limits" in md
