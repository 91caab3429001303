"""The SGLang pass-through's output_token_logprobs fragment is byte-identical to orjson
writing the nested lists it replaces."""

from __future__ import annotations

import math

import numpy as np
import orjson
import pytest

from rollout_gateway.api.generate import logprob_pairs


def plain(lps: np.ndarray, ids: np.ndarray) -> bytes:
    rows = [[lp if math.isfinite(lp) else None, tok, None]
            for lp, tok in zip(lps.tolist(), ids.tolist())]
    return orjson.dumps(rows)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [0, 1, 2, 7, 1000])
def test_fragment_equals_the_nested_lists(dtype, n):
    rng = np.random.default_rng(n)
    lps = (-rng.exponential(2.0, n) * rng.choice([1e-9, 1e-3, 1.0, 1e3], n)).astype(dtype)
    if n > 3:
        lps[[0, 2, n - 1]] = [np.nan, -np.inf, 0.0]
    ids = rng.integers(0, 2**31 - 1, n).astype(np.int32)
    got = orjson.dumps({"x": logprob_pairs(lps, ids)})
    assert got == b'{"x":' + plain(lps, ids) + b"}"
