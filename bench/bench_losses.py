"""Forward+backward time of every registered correction loss relative to ppo_clip.

One command:  .venv/bin/python bench/bench_losses.py [--tokens 1000000] [--reps 7]

The losses run with ``backend="fused"`` (the hand-fused kernels of
learner_client/corrections/fused/, what the ratios and goals measure); the ``reference``
columns time the readable default backend (the definition) in the same round-robin, and
``ref / fused`` is what the fused kernel saves (``--fused-only`` skips them).
All losses run on the same packed [N] float32 tensors (sequences of --seq-len tokens),
round-robin in one process so the ratios are measured side by side. It also checks, with a
dispatch-mode tracer, that no op inside any loss produced a tensor with more than
--max-factor * N elements (an N x vocab tensor would be vocab times larger), and reports the
largest tensor each loss created and the total bytes its ops allocated (forward +
backward; views and in-place ops excluded), a load-independent proxy for memory traffic.

Page faults: glibc returns freed heap tops of more than a few MB to the kernel, so a loss
whose [N] buffers land on freshly mapped pages pays a minor fault per 4 KiB page (~2k
faults, several ms per 1M tokens) depending on what the previous case freed: the
``faults`` column (median minor page faults per call) shows it. ``--keep-heap`` (glibc
only) keeps freed memory in the heap (mallopt: no trim, no mmap for [N] buffers), so the
ratios measure the losses' own work without that run-order-dependent term.
"""

from __future__ import annotations

import argparse
import ctypes
import random
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from learner_client.corrections import LOSSES, LossInputs, compute_loss  # noqa: E402
from learner_client.corrections.estr import version_spread  # noqa: E402
from learner_client.corrections.ops import quantile_and_tail  # noqa: E402

SPECIAL_CFG = {"grpo": {}}  # published defaults everywhere (grpo's k3 KL uses ref_logprobs)
REF = "reference: "  # run-name prefix of a case timed with the reference backend


class MaxNumel(TorchDispatchMode):
    """Records the largest tensor any op produced, and the bytes all ops produced."""

    def __init__(self) -> None:
        super().__init__()
        self.max_numel = 0
        self.op = ""
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        aliasing = any(r.alias_info is not None for r in func._schema.returns)
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                if not aliasing:  # views and in-place ops allocate nothing
                    self.bytes += t.numel() * t.element_size()
                if t.numel() > self.max_numel:
                    self.max_numel, self.op = t.numel(), str(func)
        return out


def make_inputs(n: int, seq_len: int, seed: int = 0) -> dict[str, torch.Tensor | int]:
    g = torch.Generator().manual_seed(seed)
    mu = -torch.rand(n, generator=g) * 3
    old = mu + torch.randn(n, generator=g) * 0.05
    lp = old + torch.randn(n, generator=g) * 0.05
    n_seq = (n + seq_len - 1) // seq_len
    seq_adv = torch.randn(n_seq, generator=g)
    lens = torch.full((n_seq,), seq_len, dtype=torch.long)
    lens[-1] = n - seq_len * (n_seq - 1)
    cu = torch.zeros(n_seq + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(lens, 0)
    adv = seq_adv.repeat_interleave(lens)
    mask = (torch.rand(n, generator=g) > 0.05).float()
    ent = torch.rand(n, generator=g) * 4
    versions = torch.randint(6, 10, (n,), generator=g, dtype=torch.int32)  # as on the wire
    return dict(logprobs=lp, rollout_logprobs=mu, old_logprobs=old, ref_logprobs=mu - 0.02,
                advantages=adv, loss_mask=mask, entropy=ent, versions=versions,
                cu_seqlens=cu, learner_version=10)


def _floor_cases(data: dict) -> dict[str, Callable[[], object]]:
    """Building blocks timed beside the losses: one elementwise pass, the exact selections
    a quantile needs (numpy's introselect, as the losses use on CPU, and torch.kthvalue),
    SAT's selection with its tail indices, and ESTR's version diagnostics."""
    x = data["logprobs"]
    d = (x - data["rollout_logprobs"]) * data["loss_mask"]
    a = d.abs()
    n_act = int(data["loss_mask"].sum())
    k = int(0.9 * (n_act - 1)) + a.numel() - n_act
    inp = LossInputs(**data)
    inp.mask_count  # noqa: B018  (cached before timing, as inside a loss)
    return {
        "one elementwise pass (x * y over N)": lambda: x * data["rollout_logprobs"],
        "exact 0.9-quantile: np.partition over N": lambda: np.partition(a.numpy(), k),
        "exact 0.9-quantile: torch.kthvalue over N": lambda: torch.kthvalue(a, k + 1),
        "SAT quantile + tail indices (ops.quantile_and_tail)":
            lambda: quantile_and_tail(a, n_act, 0.9),
        "ESTR version diagnostics (estr.version_spread)": lambda: _fresh_version_spread(inp),
    }


def _loss_floor(case: str, cpu: dict[str, list[float]], base: float) -> str:
    """What the loss cannot undercut, from the floors measured in the same run."""
    def x(name: str) -> str:
        return f"{statistics.median(cpu[name]) / base:.2f}x" if cpu.get(name) else "?"

    one = x("one elementwise pass (x * y over N)")
    if case == "sat":
        return (f"ppo_clip + the exact quantile and its tail "
                f"({x('SAT quantile + tail indices (ops.quantile_and_tail)')}); one pass "
                f"over N {one}")
    if case == "estr":
        return (f"ppo_clip + the score (~3 passes of {one}) + the version diagnostics "
                f"({x('ESTR version diagnostics (estr.version_spread)')})")
    return f"ppo_clip + the weight (~1 pass of {one})"


def _fresh_version_spread(inp: LossInputs) -> dict[str, torch.Tensor]:
    """version_spread's first call on a batch (LossInputs caches the per-sequence bounds)."""
    inp.__dict__.pop("seq_version_bounds", None)
    return version_spread(inp)


def _keep_heap() -> None:
    """glibc's mallopt: no heap trimming, no mmap below 32 MiB (--keep-heap)."""
    libc = ctypes.CDLL(None)
    m_trim_threshold, m_mmap_threshold = -1, -3
    if not (libc.mallopt(m_mmap_threshold, 32 * 2**20)
            and libc.mallopt(m_trim_threshold, 2**31 - 1)):
        raise SystemExit("--keep-heap: mallopt refused (not glibc?)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-factor", type=float, default=2.0)
    ap.add_argument("--only", default="",
                    help="comma-separated case names to run besides ppo_clip (default: all)")
    ap.add_argument("--json", help="write the results here (bench/run_all)")
    ap.add_argument("--fused-only", action="store_true",
                    help="time the fused backend only (no reference columns)")
    ap.add_argument("--keep-heap", action="store_true",
                    help="glibc: never trim the heap nor mmap [N] buffers (no page faults "
                         "from run order; see the module docstring)")
    args = ap.parse_args(argv)
    if args.keep_heap:
        _keep_heap()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _report import Report

    rep = Report("losses", "Correction losses, forward + backward (bench_losses.py)",
                 tokens=args.tokens, seq_len=args.seq_len, reps=args.reps,
                 threads=args.threads, device="cpu")
    torch.set_num_threads(args.threads)
    data = make_inputs(args.tokens, args.seq_len)
    names = ["ppo_clip"] + sorted(n for n in LOSSES if n != "ppo_clip")
    extra = {"decoupled_ppo[loglinear]": ("decoupled_ppo", {"ratio_mode": "loglinear"}),
             "mis[geometric]": ("mis", {"level": "geometric"}),
             "estr[tau]": ("estr", {"tau": 0.05, "target_mask_rate": None}),
             "estr[target rate]": ("estr", {"target_mask_rate": 0.02}),  # default: tau 1.0
             "estr[no version diag]": ("estr", {"version_diagnostics": False}),
             "estr[tau][no version diag]": ("estr", {"tau": 0.05, "target_mask_rate": None,
                                                    "version_diagnostics": False})}
    cases = {n: (n, SPECIAL_CFG.get(n)) for n in names} | extra
    if args.only:
        keep = {"ppo_clip", *args.only.split(",")}
        cases = {c: v for c, v in cases.items() if c in keep}
    # what the ratios measure: the fused backend; its readable reference beside it
    runs = {c: (name, {**(cfg or {}), "backend": "fused"}) for c, (name, cfg) in cases.items()}
    if not args.fused_only:
        runs |= {REF + c: (name, {**(cfg or {}), "backend": "reference"})
                 for c, (name, cfg) in cases.items()}

    floors = _floor_cases(data)

    def timed(case: str) -> tuple[float, float]:
        if case in floors:
            t0, c0 = time.perf_counter(), time.process_time()
            floors[case]()
            return time.perf_counter() - t0, time.process_time() - c0
        name, cfg = runs[case]
        x = data["logprobs"].clone().requires_grad_()
        inp = LossInputs(**{**data, "logprobs": x})
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0, c0 = time.perf_counter(), time.process_time()
        loss, _ = compute_loss(name, inp, cfg)
        loss.backward()
        t1, c1 = time.perf_counter(), time.process_time()
        faults[case].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        return t1 - t0, c1 - c0

    order = [*runs, *floors]
    faults: dict[str, list[int]] = {c: [] for c in order}
    for c in order:  # warm-up
        timed(c)
    times: dict[str, list[float]] = {c: [] for c in order}
    cpu: dict[str, list[float]] = {c: [] for c in order}
    faults = {c: [] for c in order}
    rng = random.Random(0)
    for _ in range(args.reps):  # round-robin: every loss sees the same machine state, in a
        rng.shuffle(order)  # fresh order each rep (no case always runs after the same one)
        for c in order:
            w, p = timed(c)
            times[c].append(w)
            cpu[c].append(p)
    largest: dict[str, int] = {}
    produced: dict[str, int] = {}
    for c, (name, cfg) in runs.items():
        x = data["logprobs"].clone().requires_grad_()
        with MaxNumel() as tr:
            loss, _ = compute_loss(name, LossInputs(**{**data, "logprobs": x}), cfg)
            loss.backward()
        largest[c] = tr.max_numel
        produced[c] = tr.bytes
    base_cpu = statistics.median(cpu["ppo_clip"])
    base_med = statistics.median(times["ppo_clip"])
    n = args.tokens
    print(f"N = {n} tokens (float32, packed, seq_len {args.seq_len}), threads = "
          f"{args.threads}, {args.reps} round-robin reps of fwd+bwd, medians. CPU ms = process "
          f"CPU time (not inflated by other processes on a shared machine); wall ms beside it. "
          f"backend='fused'; 'reference' = the readable default backend")
    ref_cols = "" if args.fused_only else f"{'reference ms':>14}{'ref / fused':>13}"
    print(f"{'loss':<26}{'CPU ms':>8}{'x ppo_clip':>12}{'wall ms':>9}{'x ppo_clip':>12}"
          f"{'max tensor / N':>16}{'MB allocated':>14}{'x ppo_clip':>12}{'faults':>8}{ref_cols}")
    ok = all(largest[c] / n <= args.max_factor for c in runs)
    for c in cases:
        pc = statistics.median(cpu[c])
        med = statistics.median(times[c])
        line = (f"{c:<26}{pc * 1e3:>8.1f}{pc / base_cpu:>12.2f}{med * 1e3:>9.1f}"
                f"{med / base_med:>12.2f}{largest[c] / n:>16.2f}"
                f"{produced[c] / 2**20:>14.1f}{produced[c] / produced['ppo_clip']:>12.2f}"
                f"{statistics.median(faults[c]):>8.0f}")
        rep.row("process CPU time per forward+backward (median)", c, pc * 1e3, "ms",
                ratio=None if c == "ppo_clip" else pc / base_cpu,
                ratio_to=None if c == "ppo_clip" else "ppo_clip")
        if not args.fused_only:
            pr = statistics.median(cpu[REF + c])
            line += f"{pr * 1e3:>14.1f}{pr / pc:>13.2f}"
            rep.row("reference backend: process CPU time per forward+backward (median)",
                    c, pr * 1e3, "ms", ratio=pr / pc, ratio_to=f"{c} (fused)")
        print(line)
        if c in ("sat", "estr", "decoupled_ppo"):
            rep.goal(f"{c} fwd+bwd / ppo_clip on {n // 1000}k tokens (CPU)", pc / base_cpu,
                     1.25, "<=", floor=_loss_floor(c, cpu, base_cpu))
    print("Floors (the same round-robin; what a loss cannot undercut):")
    for c in floors:
        pc = statistics.median(cpu[c])
        print(f"  {c:<54}{pc * 1e3:>7.2f} ms {pc / base_cpu:>6.2f} x ppo_clip")
        rep.row("floors (what a loss cannot undercut)", c, pc * 1e3, "ms",
                ratio=pc / base_cpu, ratio_to="ppo_clip")
    rep.note(f"no loss created a tensor larger than {args.max_factor} x N: "
             f"{'OK' if ok else 'FAILED'}")
    rep.write(args.json)
    print(f"no loss created a tensor larger than {args.max_factor} x N "
          f"(an N x vocab tensor would be vocab x N): {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
