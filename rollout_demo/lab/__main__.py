"""``python -m rollout_demo.lab``: run a preset, list them, or regenerate docs/lab.md.

    python -m rollout_demo.lab --list
    python -m rollout_demo.lab --preset NAME --seeds 0-5 --out docs/lab/NAME
    python -m rollout_demo.lab --preset NAME --quick --out /tmp/x     # a smoke run
    python -m rollout_demo.lab --report docs/lab                      # -> docs/lab.md
    python -m rollout_demo.lab --grid [grid options]                  # the first lab's grid
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path


def machine() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "python": platform.python_version()}


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "rollout_demo",
                                "learner_client"], capture_output=True, text=True,
                               cwd=Path(__file__).parent).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_preset(name: str, seeds: list[int] | None, out: Path, quick: bool) -> dict:
    import torch

    from rollout_demo.lab.registry import RunContext, load_presets

    presets = load_presets()
    if name not in presets:
        raise SystemExit(f"unknown preset {name!r}; --list names them")
    p = presets[name]
    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    head = commit()  # the code that runs (read before it runs: later edits do not count)
    t0, c0 = time.monotonic(), time.process_time()

    def progress(line: str) -> None:
        print(f"[{time.monotonic() - t0:7.1f}s] {line}", flush=True)

    use = seeds if seeds is not None else list(p.default_seeds)
    body = p.run(RunContext(seeds=use, out=out, quick=quick, progress=progress))
    results = {"preset": p.name, "paper": p.paper, "commit": head, "machine": machine(),
               "seeds": use, "quick": quick, "cpu_seconds": time.process_time() - c0,
               "wall_seconds": time.monotonic() - t0, **body}
    results.setdefault("cells", [])
    results.setdefault("claims", [])
    (out / "results.json").write_text(json.dumps(results, indent=1, allow_nan=True) + "\n")
    from rollout_demo.lab.report import PLOT, plot_curves

    plot_curves(results, out / PLOT)
    print(p.render(results))
    return results


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--grid" in argv:
        from rollout_demo.lab import grid

        argv.remove("--grid")
        return grid.main(argv)
    ap = argparse.ArgumentParser(prog="python -m rollout_demo.lab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="name the presets with their CPU cost")
    ap.add_argument("--preset", help="the preset to run")
    ap.add_argument("--seeds", help="e.g. 0-5 or 0,2,4 (default: the preset's, 6 or more)")
    ap.add_argument("--out", help="output directory (results.json + plots)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: tiny, seconds")
    ap.add_argument("--report", metavar="DIR",
                    help="regenerate DIR.md from every DIR/<preset>/results.json")
    ap.add_argument("--grid", action="store_true",
                    help="run the first lab's methods x lags grid (its own options follow)")
    args = ap.parse_args(argv)
    from rollout_demo.lab.registry import load_presets
    from rollout_demo.lab.stats import parse_seeds

    if args.list:
        for p in sorted(load_presets().values(), key=lambda p: (p.paper, p.name)):
            print(f"{p.name:22s} {p.paper:11s} ~{p.cpu_minutes:5.1f} CPU min "
                  f"({len(p.default_seeds)} seeds)  {p.summary}")
        return 0
    if args.report:
        from rollout_demo.lab.report import write_report

        print(write_report(Path(args.report), load_presets()))
        return 0
    if not args.preset:
        ap.error("one of --list, --preset, --report, --grid")
    out = Path(args.out or f"lab-out/{args.preset}")
    seeds = parse_seeds(args.seeds) if args.seeds else None
    run_preset(args.preset, seeds, out, args.quick)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
