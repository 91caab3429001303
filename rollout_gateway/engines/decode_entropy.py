"""Entropy of the next-token distribution estimated from top-k logprobs, with a rigorous bound.

SGLang returns, per output position, the k largest log-probabilities of the
temperature-scaled distribution (before top-p/top-k truncation), never the entropy. Let
p_1 >= ... >= p_k be those probabilities, c = p_k, r = max(0, 1 - sum p_i) the leftover
mass, and m = V - k the number of other tokens, each with probability q_j <= c. Then

    H = H_top + H_rest,  H_top = -sum_i p_i log p_i  (known),
    H_rest = -sum_j q_j log q_j  with  sum_j q_j = r,  0 <= q_j <= c.

Upper bound: -x log x is concave, so H_rest is largest with the mass spread evenly:
``H_rest <= r log(m / r)`` (uniform r/m <= c is feasible since r <= m c).
Lower bound: a concave function on the polytope {0 <= q_j <= c, sum q_j = r} attains its
minimum at a vertex, where every q_j but one is 0 or c: n = floor(r / c) atoms at c and one
atom s = r - n c, so ``H_rest >= n c log(1/c) + s log(1/s)``.

The estimate is the midpoint and the error bound is the half-width, plus a term for
the float32 rounding of the reported logprobs (relative 2^-23 on each logprob, propagated
through H_top and r). Both bounds are attained by some distribution consistent with the
top-k, so no estimator from top-k alone has a smaller worst-case error. V is the vocabulary
size; an upper bound on V keeps the bound valid (slightly looser), hence the default.
"""

from __future__ import annotations

import numpy as np

from rollout_gateway.errors import EngineError

#: Upper bound on any current model's vocabulary (Gemma-3: 262,208); used when V is unknown.
DEFAULT_VOCAB_UPPER = 1 << 20
_F32_REL = 2.0 ** -23
_SUM_TOLERANCE = 1e-3  # top-k probabilities summing to more than 1 + this is garbage


def topk_entropy(top_logprobs: np.ndarray, vocab_size: int = DEFAULT_VOCAB_UPPER
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Estimate per-token entropy (nats) from a [T, k] array of top-k logprobs.

    ``-inf`` entries are tokens of probability 0. Returns (estimate, error_bound), both
    float32 [T], with ``|estimate - H_exact| <= error_bound`` for every row. Raises
    EngineError if a row is NaN/positive or its probabilities sum above 1.

    Masked steps take an unmasked branch when the mask is all true (the usual case):
    the same element-wise operations on the same values, without the fancy-indexing
    copies that dominate small (streamed) inputs.
    """
    checked = _checked(top_logprobs, vocab_size)
    if checked is None:
        return np.zeros(0, np.float32), np.zeros(0, np.float32)
    lp, p, total = checked
    t, k = lp.shape
    p_pos = p > 0
    nlogp = -lp if p_pos.all() else np.where(p_pos, -lp, 0.0)  # -log p, with 0 log 0 = 0
    h_top = (p * nlogp).sum(axis=1)
    r = np.clip(1.0 - total, 0.0, 1.0)
    c = p.min(axis=1)
    m = float(vocab_size - k)

    pos = (r > 0) & (m > 0)
    ok = pos & (c > 0)
    if ok.all():
        upper = r * np.log(m / r)
        n = np.minimum(np.floor(r / c), m)
        s = np.clip(r - n * c, 0.0, None)
        lo = n * c * -np.log(c)
        s_pos = s > 0
        if s_pos.all():
            lo += s * -np.log(s)
        else:
            lo[s_pos] += s[s_pos] * -np.log(s[s_pos])
        lower = np.minimum(lo, upper)
    else:
        upper = np.zeros(t)
        upper[pos] = r[pos] * np.log(m / r[pos])
        lower = np.zeros(t)
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
    d_pos = d_r > 0
    if d_pos.all():
        d_log = -np.log(d_r)
    else:
        d_log = np.where(d_pos, -np.log(np.where(d_pos, d_r, 1.0)), 0.0)
    d_rest = d_r * (np.log(max(m, 1.0)) + nlogp.max(axis=1) + 2.0 + d_log)
    estimate = h_top + 0.5 * (lower + upper)
    bound = 0.5 * (upper - lower) + d_top + d_rest + 1e-7 * (1.0 + np.abs(estimate))
    # the float32 cast of the outputs must not break the bound
    est32 = estimate.astype(np.float32)
    bound = bound + np.abs(est32.astype(np.float64) - estimate)
    return est32, np.nextafter(bound.astype(np.float32), np.float32(np.inf))


def check_top_logprobs(top_logprobs: np.ndarray, vocab_size: int = DEFAULT_VOCAB_UPPER
                       ) -> None:
    """Raise EngineError exactly where :func:`topk_entropy` would, without estimating:
    a streamed answer's rows are checked as each chunk arrives and their entropy computed
    once for the whole output (``DecodeOptions.defer_entropy``). The estimate is row by
    row, so computing it over the concatenated rows gives the same bits."""
    _checked(top_logprobs, vocab_size)


def _checked(top_logprobs: np.ndarray, vocab_size: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(logprobs clipped at 0, their probabilities, each row's sum), or None when there
    are no rows; raises EngineError on rows no distribution can have."""
    lp = np.asarray(top_logprobs, dtype=np.float64)
    if lp.ndim != 2:
        raise EngineError(f"top logprobs must be [T, k], got shape {lp.shape}")
    t, k = lp.shape
    if t == 0:
        return None
    if k == 0:
        raise EngineError("top logprobs rows are empty")
    if not (lp <= 1e-6).all():  # NaN compares false
        raise EngineError("top logprobs contain NaN or positive values")
    if vocab_size < k:
        raise EngineError(f"vocab_size {vocab_size} is smaller than top-k {k}")
    lp = np.minimum(lp, 0.0)
    p = np.exp(lp)
    total = p.sum(axis=1)
    if (total > 1.0 + _SUM_TOLERANCE).any():
        raise EngineError(f"top logprobs sum to {float(total.max()):.4f} > 1")
    return lp, p, total
