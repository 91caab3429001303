"""topk_entropy's unmasked branches give bit-identical results to the all-masked original."""

from __future__ import annotations

import numpy as np
import pytest

from rollout_gateway.engines.decode_entropy import (
    _F32_REL,
    _SUM_TOLERANCE,
    DEFAULT_VOCAB_UPPER,
    topk_entropy,
)
from rollout_gateway.errors import EngineError

def reference_topk_entropy(top_logprobs: np.ndarray, vocab_size: int = DEFAULT_VOCAB_UPPER
                           ) -> tuple[np.ndarray, np.ndarray]:
    """The implementation before the unmasked branches (every step masked)."""
    lp = np.asarray(top_logprobs, dtype=np.float64)
    if lp.ndim != 2:
        raise EngineError(f"top logprobs must be [T, k], got shape {lp.shape}")
    t, k = lp.shape
    if t == 0:
        return np.zeros(0, np.float32), np.zeros(0, np.float32)
    if k == 0:
        raise EngineError("top logprobs rows are empty")
    if np.isnan(lp).any() or (lp > 1e-6).any():
        raise EngineError("top logprobs contain NaN or positive values")
    if vocab_size < k:
        raise EngineError(f"vocab_size {vocab_size} is smaller than top-k {k}")
    lp = np.minimum(lp, 0.0)
    p = np.exp(lp)
    nlogp = np.where(p > 0, -lp, 0.0)  # -log p, with 0 log 0 = 0
    h_top = (p * nlogp).sum(axis=1)
    total = p.sum(axis=1)
    if (total > 1.0 + _SUM_TOLERANCE).any():
        raise EngineError(f"top logprobs sum to {float(total.max()):.4f} > 1")
    r = np.clip(1.0 - total, 0.0, 1.0)
    c = p.min(axis=1)
    m = float(vocab_size - k)

    upper = np.zeros(t)
    pos = (r > 0) & (m > 0)
    upper[pos] = r[pos] * np.log(m / r[pos])

    lower = np.zeros(t)
    ok = pos & (c > 0)
    n = np.minimum(np.floor(r[ok] / c[ok]), m)
    s = np.clip(r[ok] - n * c[ok], 0.0, None)
    lo = n * c[ok] * -np.log(c[ok])
    s_pos = s > 0
    lo[s_pos] += s[s_pos] * -np.log(s[s_pos])
    lower[ok] = np.minimum(lo, upper[ok])

    # float32 rounding: each p_i is off by at most eps_i = p_i * |lp_i| * 2^-23 (plus one ulp)
    eps = p * (nlogp + 1.0) * _F32_REL
    d_top = (eps * (nlogp + 1.0)).sum(axis=1)
    d_r = eps.sum(axis=1)
    # both tail bounds move by at most d_r * (log m + |log r| + 1) plus the modulus of
    # continuity of -x log x, d log(1/d), when r itself is ~d_r
    d_log = np.where(d_r > 0, -np.log(np.where(d_r > 0, d_r, 1.0)), 0.0)
    d_rest = d_r * (np.log(max(m, 1.0)) + nlogp.max(axis=1) + 2.0 + d_log)
    estimate = h_top + 0.5 * (lower + upper)
    bound = 0.5 * (upper - lower) + d_top + d_rest + 1e-7 * (1.0 + np.abs(estimate))
    # the float32 cast of the outputs must not break the bound
    est32 = estimate.astype(np.float32)
    bound = bound + np.abs(est32.astype(np.float64) - estimate)
    return est32, np.nextafter(bound.astype(np.float32), np.float32(np.inf))


def _cases(rng: np.random.Generator) -> list[tuple[np.ndarray, int]]:
    with np.errstate(divide="ignore"):
        return _make_cases(rng)


def _make_cases(rng: np.random.Generator) -> list[tuple[np.ndarray, int]]:
    out = []
    for t in (1, 2, 7, 64, 300):
        for k in (1, 3, 5, 20):
            p = rng.dirichlet(np.ones(k + int(rng.integers(0, 4))) * rng.uniform(0.05, 3),
                              size=t)[:, :k]
            lp = -np.sort(-np.log(p), axis=1) if k > 1 else np.log(p)
            lp = np.sort(lp, axis=1)[:, ::-1].copy()
            if rng.random() < 0.5:
                lp = lp.astype(np.float32).astype(np.float64)
            if rng.random() < 0.4:  # some zero-probability tokens
                lp[rng.random(lp.shape) < 0.2] = -np.inf
            out.append((lp, int(rng.choice([k, k + 1, 1000, 151936, 1 << 20]))))
    # edge rows: whole mass in the top-k (r = 0), leftover an exact multiple of the
    # smallest probability (s = 0), only -inf but one, vocab equal to k (m = 0)
    q = np.log(np.array([[0.25, 0.25, 0.25], [0.5, 0.25, 0.25], [0.5, 0.125, 0.125],
                         [1.0, 0.0, 0.0], [0.75, 0.125, 0.125]]))
    out += [(q, 3), (q, 4), (q, 1000), (q[:1], 100), (q[2:3], 10), (q[3:4], 5)]
    return out


@pytest.mark.parametrize("seed", range(4))
def test_bit_identical_to_the_masked_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for lp, vocab in _cases(rng):
        with np.errstate(divide="ignore"):
            try:
                want = reference_topk_entropy(lp, vocab)
            except EngineError as exc:
                with pytest.raises(EngineError, match="sum to"):
                    topk_entropy(lp, vocab)
                assert "sum to" in exc.message
                continue
            got = topk_entropy(lp, vocab)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype == np.float32
            assert g.tobytes() == w.tobytes(), (lp, vocab)


@pytest.mark.parametrize("bad", [[[np.nan, -1.0]], [[-0.1, 0.5]], [[-0.1, np.inf]]])
def test_nan_and_positive_rows_still_rejected(bad: list) -> None:
    with pytest.raises(EngineError, match="NaN or positive"):
        topk_entropy(np.array(bad), 100)
