"""The lab's paired statistics, seed parsing, registry and report assembly (pure code)."""

from __future__ import annotations

import json
import math

import pytest

from rollout_demo.lab import registry, report
from rollout_demo.lab.stats import PairedDiff, claim, paired_ci, parse_seeds, t_quantile, verdict


def test_t_quantiles_match_the_tables():
    # two-sided 95% critical values of Student's t (any statistics table)
    for df, want in [(1, 12.7062), (2, 4.3027), (5, 2.5706), (10, 2.2281), (30, 2.0423)]:
        assert t_quantile(0.975, df) == pytest.approx(want, abs=1e-4)
    assert t_quantile(0.95, 5) == pytest.approx(2.0150, abs=1e-4)


def test_paired_ci_is_a_t_interval_over_the_per_seed_differences():
    a = [0.9, 0.8, 0.7, 0.85, 0.75, 0.95]
    b = [0.5, 0.6, 0.4, 0.55, 0.45, 0.5]
    d = [x - y for x, y in zip(a, b)]
    mean = sum(d) / 6
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 5)
    r = paired_ci(a, b)
    assert r.n == 6 and r.mean == pytest.approx(mean)
    assert r.hi - r.mean == pytest.approx(2.5706 * sd / math.sqrt(6), rel=1e-4)
    assert r.mean - r.lo == pytest.approx(r.hi - r.mean)
    assert verdict(r) == "reproduced" and verdict(r, expect="less") == "not reproduced"
    # pairing matters: a shift common to both methods per seed cancels
    base = [0.1, 0.9, 0.3, 0.7, 0.2, 0.8]
    tight = paired_ci([x + 0.05 for x in base], base)
    assert tight.lo == pytest.approx(0.05) and tight.hi == pytest.approx(0.05)


def test_verdicts_and_degenerate_inputs():
    assert verdict(paired_ci([0.1, 0.5, 0.2], [0.3, 0.1, 0.25])) == "not distinguishable"
    assert verdict(PairedDiff(-0.2, -0.3, -0.1, 6)) == "not reproduced"
    assert verdict(PairedDiff(-0.2, -0.3, -0.1, 6), expect="less") == "reproduced"
    one = paired_ci([1.0], [0.0])
    assert one.n == 1 and math.isnan(one.lo) and verdict(one) == "not distinguishable"
    with pytest.raises(ValueError):
        paired_ci([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        paired_ci([float("nan"), 1.0], [0.0, 0.0])
    c = claim("a beats b", "a", "b", "final_eval", [1, 2, 3], [0, 0.5, 1.5])
    assert c["verdict"] == "reproduced" and c["n"] == 3 and c["ci"][0] > 0
    json.dumps(c)
    nd = claim("x beats y", "x", "y", "m", [1, 0, 1], [0, 1, 0.5])
    text = report.verdict_summary({"claims": [c, nd]})
    assert text.startswith("Reproduced") and "a beats b (+1.33" in text
    assert "Not distinguishable at this scale: x beats y" in text


def test_parse_seeds():
    assert parse_seeds("0-5") == [0, 1, 2, 3, 4, 5]
    assert parse_seeds("0,2,7-8") == [0, 2, 7, 8]
    for bad in ["", "3-1", "1,1"]:
        with pytest.raises(ValueError):
            parse_seeds(bad)


def test_report_puts_each_preset_under_its_paper_in_order(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "PRESETS", {})
    for name, paper in [("b-theory", "theory"), ("a-sat", "sat")]:
        registry.register(registry.Preset(
            name=name, paper=paper, summary=f"{name} summary", cpu_minutes=1.0,
            run=lambda ctx: {}, render=lambda r: report.claims_table(r)))
        d = tmp_path / "lab" / name
        d.mkdir(parents=True)
        res = {"preset": name, "paper": paper, "commit": "abc", "seeds": [0, 1, 2],
               "cpu_seconds": 60, "machine": {"cpu": "TestCPU", "torch": "x", "threads": 1},
               "cells": [], "claims": [claim(f"{name} claim", "x", "y", "m", [1, 2, 3],
                                             [0, 1, 2.5])]}
        (d / "results.json").write_text(json.dumps(res))
        (d / "rerun").mkdir()
        (d / "rerun" / "results.json").write_text(json.dumps({**res, "seeds": [6, 7, 8]}))
    (tmp_path / "lab" / "extra" / "sat").mkdir(parents=True)
    (tmp_path / "lab" / "extra" / "sat" / "bench.md").write_text("### SAT bench by hand\n")
    (tmp_path / "lab" / "extra" / "old.md").write_text("### Old grid\n")
    out = report.write_report(tmp_path / "lab", registry.PRESETS)
    text = out.read_text()
    assert out == tmp_path / "lab.md"
    assert text.index("## SAT") < text.index("a-sat claim") < text.index("## Theory") \
        < text.index("b-theory claim")
    assert text.index("a-sat claim") < text.index("SAT bench by hand") < text.index("## ESTR")
    assert text.index("## Other measurements") < text.index("### Old grid")
    assert "verdict, seeds 6-8 |" in text and "| reproduced (+0.83 [" in text
    assert "TestCPU" in text and "seeds 0-2" in text
    assert "_No committed results yet" in text  # the ESTR section, for one
    with pytest.raises(ValueError):
        registry.register(registry.Preset("a-sat", "sat", "again", 1, lambda c: {}, str))
    with pytest.raises(ValueError):
        registry.register(registry.Preset("z", "nopaper", "", 1, lambda c: {}, str))


def _cells_claims(res: dict) -> list[dict]:
    """A preset's claims from its cells (as a real preset's ``claims``): x - y per seed."""
    def col(m: str) -> list[float]:
        return [c["v"] for c in sorted((c for c in res["cells"] if c["method"] == m),
                                       key=lambda c: c["seed"])]
    return [claim("p claim", "x", "y", "m", col("x"), col("y")),
            claim("q claim", "x", "z", "m", col("x"), col("z"))]


def _write_run(root, d: str, seeds: list[int], y: list[float]) -> dict:
    """Results of preset ``p`` in ``root/d``: x is 1 + seed/10, z far below, y as given."""
    cells = [{"method": m, "seed": s, "v": v} for s, yv in zip(seeds, y)
             for m, v in (("x", 1 + s / 10), ("y", yv), ("z", -5.0 + s / 7))]
    res = {"preset": "p", "paper": "sat", "seeds": seeds, "cells": cells}
    res["claims"] = _cells_claims(res)
    (root / d).mkdir(parents=True)
    (root / d / "results.json").write_text(json.dumps(res))
    return res


def test_a_results_directory_not_named_after_its_preset_is_a_rerun(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "PRESETS", {})
    registry.register(registry.Preset("p", "sat", "s", 1.0, lambda c: {},
                                      lambda r: report.claims_table(r)
                                      + report.verdict_summary(r), claims=_cells_claims))
    _write_run(tmp_path / "lab", "p", [0, 1, 2], [0.5, 0.55, 0.6])  # x - y > 0: reproduced
    _write_run(tmp_path / "lab", "p-seeds-6-8", [6, 7, 8], [2.0, 1.2, 2.1])  # straddles 0
    text = report.render_report(tmp_path / "lab", registry.PRESETS)
    assert text.count("### `p`") == 1 and "verdict, seeds 6-8 |" in text
    assert "not distinguishable (-0.07 [" in text
    assert ("- `p`: re-run on seeds 6-8: 1 of 2 verdicts the same; 1 stated as not robust "
            "(flips between seed sets) (both sets' CIs and the pooled CI in the section's "
            "verdict): p claim.") in text
    assert "**Replication.** `p`: re-run on seeds 6-8: 1 of 2" in text


def test_a_claim_whose_seed_sets_disagree_is_not_robust_with_both_cis_and_the_pooled_one(
        tmp_path):
    a = _write_run(tmp_path, "a", [0, 1, 2], [0.5, 0.55, 0.6])
    b = _write_run(tmp_path, "b", [6, 7, 8], [2.0, 1.2, 2.1])
    assert [c["verdict"] for c in a["claims"]] == ["reproduced", "reproduced"]
    assert [c["verdict"] for c in b["claims"]] == ["not distinguishable", "reproduced"]
    r = report.replicate(a, b, _cells_claims)
    flip, kept = r["claims"]
    assert kept == a["claims"][1]  # both sets agree: its verdict and numbers stand
    assert flip["verdict"] == report.NOT_ROBUST
    assert (flip["mean_diff"], flip["ci"]) == (a["claims"][0]["mean_diff"], a["claims"][0]["ci"])
    assert [s["verdict"] for s in flip["seed_sets"]] == ["reproduced", "not distinguishable"]
    assert [s["seeds"] for s in flip["seed_sets"]] == [[0, 1, 2], [6, 7, 8]]
    # pooled: the paired CI of the six per-seed differences, both sets together
    d_a = [1.0 - 0.5, 1.1 - 0.55, 1.2 - 0.6]
    d_b = [1.6 - 2.0, 1.7 - 1.2, 1.8 - 2.1]
    want = paired_ci(d_a + d_b, [0.0] * 6)
    p = flip["pooled"]
    assert p["n"] == 6 and p["seeds"] == [0, 1, 2, 6, 7, 8]
    assert p["mean_diff"] == pytest.approx(want.mean)
    assert p["ci"] == pytest.approx([want.lo, want.hi])
    table = report.claims_table(r)
    assert "| pooled, seeds 0-2,6-8 |" in table
    assert "**not robust (flips between seed sets); seeds 0-2: reproduced**" in table
    assert f"{report.fmt(want.mean, 2)} [{report.fmt(want.lo, 2)}, " in table
    summary = report.verdict_summary(r)
    assert "Not robust (the two seed sets' verdicts differ): p claim (seeds 0-2: " in summary
    assert "reproduced; seeds 6-8: " in summary and "pooled seeds 0-2,6-8 (n 6): " in summary
    assert summary.startswith("Reproduced (95% CI excludes zero): q claim")
    # per-seed records keyed by seed (e.g. estr's probe) reach the pool merged
    seen: list[dict] = []
    report.replicate({**a, "probe": {"0": 1, "1": 2, "2": 3}},
                     {**b, "probe": {"6": 4, "7": 5, "8": 6}},
                     lambda res: seen.append(res) or _cells_claims(res))
    assert seen[0]["probe"] == {"0": 1, "1": 2, "2": 3, "6": 4, "7": 5, "8": 6}
    assert len(seen[0]["cells"]) == len(a["cells"]) + len(b["cells"])
    # no flip: nothing pooled, no pooled column
    same = report.replicate(a, {**a, "seeds": [6, 7, 8]}, None)
    assert same["claims"] == a["claims"] and "pooled" not in report.claims_table(same)
    # a flip needs the preset's claims function and seed sets that do not overlap
    with pytest.raises(SystemExit, match="no `claims` function"):
        report.replicate(a, b, None)
    with pytest.raises(SystemExit, match="other seeds"):
        report.replicate(a, {**b, "seeds": [2, 7, 8]}, _cells_claims)
