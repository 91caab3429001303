"""The staleness lab's pure parts: collapse detection, the summary table, the lr probe."""

from __future__ import annotations

from rollout_demo.lab.grid import RunOut, RunSpec, detect_collapse, summarize, table_md


def test_collapse_is_learning_then_unlearning_or_a_non_finite_loss():
    rising = [0.1] * 5 + [0.5] * 5 + [0.9] * 10
    assert not detect_collapse(rising, False)
    assert detect_collapse(rising, True)  # NaN/inf loss
    assert detect_collapse(rising + [0.2] * 10, False)  # peak 0.9, ends 0.2
    assert not detect_collapse([0.1] * 20, False)  # never learned: not a collapse
    assert not detect_collapse([0.25] * 10 + [0.15] * 10, False)  # peak below the floor
    # a dip that recovers by the end is not a collapse
    assert not detect_collapse([0.1] * 5 + [0.9] * 10 + [0.3] * 5 + [0.9] * 10, False)
    # falling below half the starting reward (worse than the random start) is
    assert detect_collapse([0.12, 0.06, 0.11, 0.02, 0.07] + [0.0] * 10, False)
    assert not detect_collapse([0.12, 0.06, 0.11, 0.02, 0.07] + [0.05] * 10, False)


def _run(label, lag, lr, final, collapsed=False, seed=0):
    spec = RunSpec(label, label, True, lag, seed, lr, 10, 2, 4, 4)
    return RunOut(spec, [final] * 10, 0.1, 0.05, 0.2, 0.04, final, final, collapsed, False, 1.0)


def test_summary_and_largest_stable_lr():
    runs = [_run("sat", 1, 3e-3, 0.9), _run("sat", 1, 3e-3, 0.7, seed=1),
            _run("grpo", 1, 3e-3, 0.2, collapsed=True)]
    probe = [_run("sat", 1, 1e-3, 0.8), _run("sat", 1, 1e-2, 0.9),
             _run("sat", 1, 3e-2, 0.3, collapsed=True),
             _run("sat", 4, 1e-3, 0.6), _run("sat", 4, 1e-2, 0.4)]
    res = summarize(runs, probe, stable_reward=0.5)
    sat = next(r for r in res["table"] if r["method"] == "sat")
    assert sat["seeds"] == 2 and abs(sat["final_reward"] - 0.8) < 1e-9
    assert sat["final_reward_min"] == 0.7 and sat["collapsed"] == 0
    assert next(r for r in res["table"] if r["method"] == "grpo")["collapsed"] == 1
    lr = {(r["loss"], r["lag"]): r["largest_stable_lr"] for r in res["lr_probe"]}
    assert lr == {("sat", 1): 1e-2, ("sat", 4): 1e-3}
    md = table_md(res)
    assert "| sat | 1 | 0.80 / 0.70 | 0/2 |" in md and "| sat | 4 | 0.001 | 0.004 |" in md
