"""Paired statistics of the lab: every claim is a per-seed paired difference with a 95% CI.

Two methods run on the same seeds (same initial weights, same prompts, same sampling
stream where the methods allow), so the per-seed difference ``a - b`` removes the seed's
own luck; its mean gets a Student-t confidence interval over the seeds. A claim "a beats
b" is *reproduced* when the whole interval lies above zero, *not reproduced* when it
lies below, and *not distinguishable* (at this scale) when it contains zero.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

Verdict = Literal["reproduced", "not reproduced", "not distinguishable"]


@dataclass(frozen=True)
class PairedDiff:
    mean: float  # mean over seeds of a - b
    lo: float  # lower end of the CI (nan with fewer than 2 pairs)
    hi: float  # upper end
    n: int  # pairs


def _t_pdf(x: float, df: int) -> float:
    c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(c - (df + 1) / 2 * math.log1p(x * x / df))


def _t_cdf_from_zero(x: float, df: int, intervals: int = 4000) -> float:
    """P(0 < T < x) by Simpson's rule (the density is smooth; error far below 1e-9)."""
    h = x / intervals
    s = _t_pdf(0.0, df) + _t_pdf(x, df)
    for i in range(1, intervals):
        s += (4 if i % 2 else 2) * _t_pdf(i * h, df)
    return s * h / 3


@functools.lru_cache(maxsize=256)
def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (p > 0.5) of Student's t with ``df`` degrees of freedom (Newton's
    method on the CDF from a bracket found by doubling; the CDF by Simpson's rule)."""
    if not 0.5 < p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 < p < 1 and df >= 1, got p={p}, df={df}")
    target = p - 0.5
    lo, hi = 0.0, 1.0
    while _t_cdf_from_zero(hi, df) < target:
        lo, hi = hi, hi * 2
    x = (lo + hi) / 2
    for _ in range(50):
        err = _t_cdf_from_zero(x, df) - target
        if abs(err) < 1e-12:
            break
        lo, hi = (x, hi) if err < 0 else (lo, x)
        step = x - err / _t_pdf(x, df)
        x = step if lo < step < hi else (lo + hi) / 2  # Newton, bisection when it leaves
    return x


def paired_ci(a: list[float], b: list[float], level: float = 0.95) -> PairedDiff:
    """Mean of ``a[i] - b[i]`` with its two-sided Student-t CI at ``level``.

    ``a`` and ``b`` are per-seed values in the same seed order. Non-finite pairs are an
    error (a diverged run needs a finite score, e.g. its held-out eval, to be compared).
    """
    if len(a) != len(b):
        raise ValueError(f"paired_ci needs equal lengths, got {len(a)} and {len(b)}")
    d = [float(x) - float(y) for x, y in zip(a, b)]
    if not all(math.isfinite(x) for x in d):
        raise ValueError("paired_ci got a non-finite value")
    n = len(d)
    if n == 0:
        return PairedDiff(math.nan, math.nan, math.nan, 0)
    mean = sum(d) / n
    if n < 2:
        return PairedDiff(mean, math.nan, math.nan, n)
    var = sum((x - mean) ** 2 for x in d) / (n - 1)
    half = t_quantile(0.5 + level / 2, n - 1) * math.sqrt(var / n)
    return PairedDiff(mean, mean - half, mean + half, n)


def verdict(diff: PairedDiff, *, expect: Literal["greater", "less"] = "greater") -> Verdict:
    """The verdict on "a - b is > 0" (``expect="greater"``) or "< 0" (``"less"``)."""
    if not (math.isfinite(diff.lo) and math.isfinite(diff.hi)):
        return "not distinguishable"
    if diff.lo > 0:
        return "reproduced" if expect == "greater" else "not reproduced"
    if diff.hi < 0:
        return "reproduced" if expect == "less" else "not reproduced"
    return "not distinguishable"


def claim(text: str, a: str, b: str, metric: str, a_vals: list[float], b_vals: list[float],
          *, expect: Literal["greater", "less"] = "greater", level: float = 0.95) -> dict:
    """One entry of ``results.json``'s ``claims``: the paired CI of a - b and its verdict."""
    d = paired_ci(a_vals, b_vals, level)
    return {"claim": text, "a": a, "b": b, "metric": metric, "mean_diff": d.mean,
            "ci": [d.lo, d.hi], "n": d.n, "level": level, "expect": expect,
            "verdict": verdict(d, expect=expect)}


def parse_seeds(spec: str) -> list[int]:
    """``"0-5"`` -> [0..5]; ``"0,2,7-8"`` -> [0, 2, 7, 8]."""
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = (int(x) for x in part.split("-", 1))
            if hi < lo:
                raise ValueError(f"bad seed range {part!r}")
            out.extend(range(lo, hi + 1))
        else:
            out.append(int(part))
    if not out or len(set(out)) != len(out):
        raise ValueError(f"bad seeds {spec!r}: empty or repeated")
    return out
