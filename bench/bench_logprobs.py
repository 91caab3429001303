"""Per-token logprob + entropy: chunked autograd function vs the plain log_softmax way.

One command:  .venv/bin/python bench/bench_logprobs.py [--rows 2048] [--vocab 32768] [--reps 3]

Both variants run forward + backward on the same [rows, vocab] float32 logits, alternating
in one process so the time ratio is measured side by side. Memory, per variant:

* saved MiB: bytes autograd keeps for backward (saved_tensors_hooks; the input logits
  themselves not counted): what stays alive between the forward and backward passes
  of a real training step, for every microbatch in flight;
* peak MiB: the rise of the peak resident set of a fresh child process during one
  forward + backward (input logits allocated before; the gradient buffer, needed by both
  variants, included).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from learner_client.logprobs import token_logprobs_entropy  # noqa: E402

TEMP = 0.9


def naive(logits: torch.Tensor, targets: torch.Tensor, chunk: int):
    ls = torch.log_softmax(logits.float() / TEMP, dim=-1)
    return ls.gather(-1, targets[:, None])[:, 0], -(ls.exp() * ls).sum(-1)


def chunked(logits: torch.Tensor, targets: torch.Tensor, chunk: int):
    return token_logprobs_entropy(logits, targets, temperature=TEMP, chunk_size=chunk)


VARIANTS = {"naive log_softmax": naive, "chunked": chunked}


def _inputs(rows: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=g).requires_grad_()
    return logits, torch.randint(0, vocab, (rows,), generator=g), torch.randn(rows, generator=g)


def _step(fn, logits, targets, w, chunk):
    lp, h = fn(logits, targets, chunk)
    ((lp * w).sum() + (h * w).sum()).backward()


def saved_bytes(fn, logits, targets, chunk) -> int:
    total, seen = 0, {logits.data_ptr()}

    def pack(t):
        nonlocal total
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(logits, targets, chunk)
    return total


def _hwm_kib() -> int:
    """Peak RSS of this process image (VmHWM; unlike ru_maxrss it is not inherited from
    the parent across fork + exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def child(args) -> None:
    """Peak RSS rise (bytes) of one forward + backward of one variant, as JSON."""
    torch.set_num_threads(args.threads)
    logits, targets, w = _inputs(args.rows, args.vocab)
    before = _hwm_kib()
    _step(VARIANTS[args.child], logits, targets, w, args.chunk)
    after = _hwm_kib()
    print(json.dumps({"peak_kib": after - before}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the results here (bench/run_all)")
    args = ap.parse_args()
    if args.child:
        return child(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _report import Report

    rep = Report("logprobs", "Learner logprobs + entropy, chunked vs naive (bench_logprobs.py)",
                 rows=args.rows, vocab=args.vocab, chunk=args.chunk, reps=args.reps,
                 threads=args.threads)
    torch.set_num_threads(args.threads)
    logits, targets, w = _inputs(args.rows, args.vocab)
    times = {k: [] for k in VARIANTS}
    for _ in range(args.reps):
        for name, fn in VARIANTS.items():
            logits.grad = None
            t0 = time.perf_counter()
            _step(fn, logits, targets, w, args.chunk)
            times[name].append(time.perf_counter() - t0)
    with torch.no_grad():
        a, b = naive(logits, targets, 0), chunked(logits, targets, args.chunk)
    err = max(float((a[0] - b[0]).abs().max()), float((a[1] - b[1]).abs().max()))
    base = statistics.median(times["naive log_softmax"])
    mib = 1 << 20
    print(f"rows={args.rows} vocab={args.vocab} chunk={args.chunk} reps={args.reps} "
          f"threads={args.threads}; rows x vocab float32 = {args.rows * args.vocab * 4 / mib:.0f} "
          f"MiB; max |diff| vs naive {err:.1e}")
    print(f"{'variant':20s} {'fwd+bwd s':>10s} {'ratio':>6s} {'saved MiB':>10s} {'peak MiB':>9s}")
    for name, fn in VARIANTS.items():
        out = subprocess.run(
            [sys.executable, __file__, "--child", name, "--rows", str(args.rows), "--vocab",
             str(args.vocab), "--chunk", str(args.chunk), "--threads", str(args.threads)],
            capture_output=True, text=True, check=True)
        peak = json.loads(out.stdout.strip().splitlines()[-1])["peak_kib"] / 1024
        med = statistics.median(times[name])
        saved = saved_bytes(fn, logits, targets, args.chunk) / mib
        print(f"{name:20s} {med:10.3f} {med / base:6.2f} {saved:10.2f} {peak:9.0f}")
        naive_row = name == "naive log_softmax"
        rep.row("forward + backward wall time (median)", name, med, "s",
                ratio=None if naive_row else med / base,
                ratio_to=None if naive_row else "naive log_softmax")
        rep.row("memory kept for backward", name, saved, "MiB")
        rep.row("peak RSS rise of one fwd+bwd (own process)", name, peak, "MiB")
    rep.note(f"max |difference| vs the naive log_softmax: {err:.1e}")
    rep.write(args.json)


if __name__ == "__main__":
    main()
