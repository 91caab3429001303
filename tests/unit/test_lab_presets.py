"""The lab's presets: a --quick smoke of each (seconds), the CLI's results.json contract,
and the simulator's mechanics (exact lag, same-rate masks, held-out score)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rollout_demo.lab import sim
from rollout_demo.lab.__main__ import main
from rollout_demo.lab.registry import RunContext, load_presets

ROOT = Path(__file__).resolve().parents[2]
CORE = ("regime", "sat-anchor", "sat-small-lag", "estr-entropy")


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("name", CORE)
def test_quick_preset_runs_pairs_its_seeds_and_renders(name, tmp_path):
    p = load_presets()[name]
    lines: list[str] = []
    res = p.run(RunContext(seeds=[0, 1], out=tmp_path, quick=True, progress=lines.append))
    assert lines and res["cells"] and res["claims"]
    for c in res["cells"]:
        assert {"method", "lag", "seed", "eval_curve", "final_eval", "collapsed",
                "diagnostics"} <= set(c)
        assert 0.0 <= c["final_eval"] <= 1.0 and c["final_eval"] == c["eval_curve"][-1]
    for cl in res["claims"]:
        assert cl["n"] == 2 and cl["verdict"] in ("reproduced", "not reproduced",
                                                  "not distinguishable")
    json.dumps(res)
    md = p.render({**res, "preset": name})
    assert "**Claim" in md and "| claim |" in md


def test_cli_writes_the_results_contract_and_the_report(tmp_path):
    out = tmp_path / "lab" / "regime"
    assert main(["--preset", "regime", "--quick", "--seeds", "0-1", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert {"preset", "paper", "commit", "machine", "seeds", "cpu_seconds", "cells",
            "claims"} <= set(res)
    assert res["seeds"] == [0, 1] and res["paper"] == "regime" and res["machine"]["cpu"]
    assert main(["--report", str(tmp_path / "lab")]) == 0
    text = (tmp_path / "lab.md").read_text()
    assert "## Where staleness hurts" in text and "staleness hurts GRPO" in text


def test_lag_zero_grpo_first_minibatch_is_on_policy_and_runs_are_seeded():
    cfg = sim.quick(sim.SimConfig(lag=0))
    a = sim.run(sim.Method("grpo", "grpo", {"kl_coef": 0.0}, recompute_old=True), cfg, 3)
    b = sim.run(sim.Method("grpo", "grpo", {"kl_coef": 0.0}, recompute_old=True), cfg, 3)
    assert a["eval_curve"] == b["eval_curve"]
    # no lag, no mismatch: mu is the learner's own policy before its first step
    assert a["diagnostics"]["abs_log_ratio_mu"]["min"] < 1e-5


def test_estr_and_magnitude_mask_the_same_rate_but_different_tokens():
    cfg = sim.quick(sim.SimConfig(lag=1, mismatch_sigma=0.5, lr=3e-2))
    cfg = sim.SimConfig(**{**vars(cfg), "iterations": 6})
    est = sim.run(sim.Method("estr", "estr", {"target_mask_rate": 0.25}), cfg, 0)
    mag = sim.run(sim.Method("mag", "estr", {"target_mask_rate": 0.25}, constant_entropy=True),
                  cfg, 0)
    for r in (est, mag):
        assert r["diagnostics"]["mask_rate"]["mean"] == pytest.approx(0.25, abs=0.05)
    # ESTR prefers low-entropy tokens: its masked tokens sit lower than the magnitude mask's
    assert (est["diagnostics"]["masked_entropy_median"]["mean"]
            < mag["diagnostics"]["masked_entropy_median"]["mean"])


def test_task_reward_and_held_out_score_agree_on_a_perfect_policy():
    task = sim.EchoClassTask()
    prompts = task.prompts(8, torch.Generator().manual_seed(0))
    good = task.good(prompts)
    perfect = good.float().argmax(-1)  # the echo, then the class's first symbol
    assert torch.all(task.reward(prompts, perfect) == 1.0)
    assert good[:, task.echo:].sum(-1).eq(task.symbols // task.classes).all()


def test_committed_lab_md_is_what_report_renders_from_the_committed_results(monkeypatch):
    """docs/lab.md matches docs/lab/**/results.json (regenerate with
    ``python -m rollout_demo.lab --report docs/lab``)."""
    from pathlib import Path

    from rollout_demo.lab.report import render_report

    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the text names the path given
    root = Path("docs/lab")
    assert render_report(root, load_presets()) == Path("docs/lab.md").read_text()


@pytest.mark.parametrize("path", sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "lab").glob("**/results.json")))
def test_a_presets_claims_function_restates_its_committed_claims(path):
    """The report pools two seed sets' cells with the preset's ``claims`` (every preset has
    one): on one set's committed cells it must give exactly the claims that run stated."""
    res = json.loads((ROOT / path).read_text())
    got = load_presets()[res["preset"]].claims(res)
    assert [c["claim"] for c in got] == [c["claim"] for c in res["claims"]]
    for g, c in zip(got, res["claims"]):
        assert g["verdict"] == c["verdict"] and g["n"] == c["n"]
        assert g["mean_diff"] == pytest.approx(c["mean_diff"], abs=1e-12)
        assert g["ci"] == pytest.approx(c["ci"], abs=1e-12)
