"""bench/run_all's page: repeats merge into median [range], ratios and goals are judged,
a failed benchmark is shown as failed (never silently absent). No benchmark is run."""

import argparse
import importlib.machinery
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run_all():
    loader = importlib.machinery.SourceFileLoader("run_all", str(ROOT / "bench" / "run_all"))
    spec = importlib.util.spec_from_loader("run_all", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _doc(value, ratio, goal_value):
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    from _report import Report

    rep = Report("gateway", "Gateway", concurrency=8)
    rep.row("B. end to end", "direct", 100.0, "tok/s")
    rep.row("B. end to end", "gateway", value, "tok/s", ratio=ratio, ratio_to="direct")
    rep.goal("gateway vs direct", goal_value, 0.9)
    rep.goal("loss ratio", 1.1, 1.25, "<=")
    rep.note("a note")
    d = rep.doc
    d["shown_command"] = "python bench/bench_gateway.py"
    return json.loads(json.dumps(d))


def test_page_merges_repeats_judges_goals_and_shows_failures():
    ra = _run_all()
    results = {"gateway": [_doc(50.0, 0.5, 0.5), _doc(70.0, 0.7, 0.7), _doc(60.0, 0.6, 0.6)],
               "transport": [{"bench": "transport", "failed": "timed out after 600 s",
                              "log_tail": "Traceback: boom", "shown_command": "python x"}]}
    args = argparse.Namespace(quick=True, repeat=3, only="")
    info = {"cpu": "cpu", "cores": "2", "memory": "1 GiB", "os": "Linux", "python": "3.11",
            "commit": "abc", "load": "1.0 1.0 1.0"}
    page = ra.render(results, args, info, "2026-01-01 00:00 UTC", 60.0)
    assert "| gateway | 60.0 [50.0 – 70.0] | tok/s | 0.6 [0.5 – 0.7] | direct |" in page
    assert "| gateway vs direct | gateway | 0.6 [0.5 – 0.7]  | >= 0.9  | **no** |" in page
    assert "| loss ratio | gateway | 1.10  | <= 1.25  | yes |" in page
    assert "**FAILED** (timed out after 600 s)" in page and "Traceback: boom" in page
    assert "2 cores available" in page and "commit abc" in page
    assert "Command: `python bench/bench_gateway.py` (3 runs)" in page
    assert page.count("- a note") == 1


def test_every_benchmark_script_exists_and_takes_json():
    ra = _run_all()
    for name, (script, *_rest) in ra.BENCHES.items():
        text = (ROOT / "bench" / script).read_text()
        assert '"--json"' in text, name
