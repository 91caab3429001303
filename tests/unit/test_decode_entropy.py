"""The top-k entropy estimate against exact entropies of real distributions."""

from __future__ import annotations

import numpy as np
import pytest

from rollout_gateway.engines.decode_entropy import topk_entropy
from rollout_gateway.errors import EngineError


def _exact(p: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return -np.where(p > 0, p * np.log(p), 0.0).sum(axis=-1)


def _topk_f32(p: np.ndarray, k: int) -> np.ndarray:
    top = -np.sort(-p, axis=-1)[:, :k]
    with np.errstate(divide="ignore"):
        return np.log(top).astype(np.float32)  # what an engine puts on the wire


@pytest.mark.parametrize("vocab, k, temp", [(1000, 1, 1.0), (1000, 5, 0.7), (32000, 20, 1.0),
                                            (32000, 5, 2.0), (50, 10, 1.0), (151936, 8, 1.2)])
def test_bound_holds_for_softmax_distributions(vocab, k, temp):
    rng = np.random.default_rng(vocab + k)
    rows = 64 if vocab < 100_000 else 8
    logits = rng.standard_normal((rows, vocab)) * rng.uniform(0.5, 8.0, (rows, 1)) / temp
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    est, bound = topk_entropy(_topk_f32(p, k), vocab)
    h = _exact(p)
    assert est.dtype == np.float32 and bound.dtype == np.float32
    assert (np.abs(est.astype(np.float64) - h) <= bound).all()
    # the bound is tight enough to be useful on peaked rows
    peaked = p.max(axis=1) > 0.99
    if peaked.any() and k >= 5:
        assert bound[peaked].max() < 0.2


def test_bound_is_attained_by_extreme_tails_and_still_holds():
    """Both ends of the interval are real distributions: uniform tail and packed tail."""
    vocab, k = 100, 3
    top = np.array([0.5, 0.2, 0.1])
    r = 1 - top.sum()  # 0.2 left over, every other token <= 0.1
    uniform = np.concatenate([top, np.full(vocab - k, r / (vocab - k))])
    packed = np.concatenate([top, [0.1, 0.1], np.zeros(vocab - k - 2)])
    lps = np.log(np.stack([top, top])).astype(np.float32)
    est, bound = topk_entropy(lps, vocab)
    h = _exact(np.stack([uniform, packed]))
    assert np.all(np.abs(est - h) <= bound)
    # and the bound is (almost) the half-width: not looser than needed
    assert bound[0] == pytest.approx((h[0] - h[1]) / 2, rel=1e-4)


def test_exact_when_top_k_covers_all_mass():
    p = np.array([[0.5, 0.25, 0.25]])
    est, bound = topk_entropy(np.log(p), vocab_size=3)
    assert est[0] == pytest.approx(1.5 * np.log(2), abs=1e-6)
    assert bound[0] < 1e-5


def test_larger_vocab_upper_bound_stays_valid():
    rng = np.random.default_rng(3)
    p = rng.dirichlet(np.full(500, 0.1), size=16)
    est, bound = topk_entropy(_topk_f32(p, 10), vocab_size=1 << 20)  # V unknown: upper bound
    assert (np.abs(est - _exact(p)) <= bound).all()


def test_neg_inf_entries_are_zero_probability():
    est, bound = topk_entropy(np.array([[0.0, -np.inf]]), vocab_size=10)
    assert est[0] == pytest.approx(0.0, abs=1e-6) and bound[0] < 1e-5


@pytest.mark.parametrize("lps, match", [
    (np.array([[-0.1, -0.2]]), "sum to"),
    (np.array([[np.nan, -1.0]]), "NaN"),
    (np.array([[0.5, -1.0]]), "positive"),
    (np.zeros((2, 0)), "empty"),
    (np.zeros(3), "shape"),
])
def test_garbage_is_rejected(lps, match):
    with pytest.raises(EngineError, match=match):
        topk_entropy(lps, vocab_size=100)
