"""Group advantage estimators and DAPO's data-side rules vs numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner_client.corrections.advantages import (dapo_dynamic_sampling_keep,
                                                    dr_grpo_advantages, grpo_advantages,
                                                    overlong_penalty)


def test_grpo_advantages_grid_and_group_ids_agree_with_numpy():
    r = np.array([[1.0, 0.0, 1.0, 1.0], [0.2, 0.5, 0.9, 0.1]])
    expect = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)
    got = grpo_advantages(torch.tensor(r)).numpy()
    assert np.allclose(got, expect)
    flat = torch.tensor(r.reshape(-1)[[0, 4, 1, 5, 2, 6, 3, 7]])
    gid = torch.tensor([10, 20, 10, 20, 10, 20, 10, 20])
    got2 = grpo_advantages(flat, gid).numpy()
    assert np.allclose(got2, expect.reshape(-1)[[0, 4, 1, 5, 2, 6, 3, 7]])


def test_dr_grpo_has_no_std_division():
    r = torch.tensor([[3.0, 1.0, 2.0]])
    assert dr_grpo_advantages(r).tolist() == [[1.0, -1.0, 0.0]]


def test_constant_group_gives_zero_and_is_filtered():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    assert torch.all(grpo_advantages(r)[0] == 0)
    assert dapo_dynamic_sampling_keep(r).tolist() == [[False] * 3, [True] * 3]


def test_overlong_penalty_piecewise():
    L = torch.tensor([100, 800, 900, 1000, 1001])
    got = overlong_penalty(L, max_len=1000, cache_len=200).tolist()
    assert got == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])
    with pytest.raises(ValueError):
        overlong_penalty(L, 100, 0)
