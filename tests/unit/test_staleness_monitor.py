"""Staleness monitor: S, S*eta, cumulative drift, eta bound, 1/S-scaled learning rate."""

from __future__ import annotations

import pytest
import torch

from learner_client.staleness_monitor import StalenessMonitor, StalenessMonitorConfig, batch_lags


def test_max_lag_over_active_tokens_only():
    v = torch.tensor([[7, 8, 2], [9, 9, 9]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    s, mean = batch_lags(v, 10, mask)
    assert s == 3 and mean == pytest.approx((3 + 2 + 1 + 1 + 1) / 5)
    assert batch_lags(v, 10)[0] == 8
    assert batch_lags(v, 10, torch.zeros(2, 3))[0] == 0


def test_reports_s_eta_drift_and_bound():
    cfg = StalenessMonitorConfig(g_upd=2.0, r_batch=0.5, r_crit=4.0)
    mon = StalenessMonitor(cfg)
    lr = 1e-2
    reps = [mon.step(lr, torch.tensor([5, 6, 7]), 8) for _ in range(3)]
    last = reps[-1]
    assert last.step == 3 and last.max_lag == 3
    assert last.s_eta == pytest.approx(3 * lr)
    assert last.cumulative_drift == pytest.approx(3 * lr * 2.0)  # T * eta * G
    expect_bound = min(0.5 / (3 * 2.0), 4.0 / (3 * 2.0))
    assert last.eta_bound == pytest.approx(expect_bound)
    assert last.lr_over_bound == pytest.approx(lr / expect_bound)
    assert set(last.as_dict()) >= {"max_lag", "s_eta", "cumulative_drift", "eta_bound"}


def test_drift_uses_measured_update_norms_when_given():
    mon = StalenessMonitor()
    mon.step(0.1, torch.tensor([1]), 2, update_norm=3.0)
    r = mon.step(0.05, torch.tensor([1]), 3, update_norm=4.0)
    assert r.cumulative_drift == pytest.approx(0.1 * 3.0 + 0.05 * 4.0)
    assert r.eta_bound is None  # no constants configured


def test_scaled_lr_is_inverse_in_s():
    mon = StalenessMonitor(StalenessMonitorConfig(s_ref=1))
    assert mon.scaled_lr(1e-3, 0) == pytest.approx(1e-3)
    assert mon.scaled_lr(1e-3, 4) == pytest.approx(2.5e-4)
    assert mon.scaled_lr(1e-3, 8) * 8 == pytest.approx(1e-3)
    with pytest.raises(ValueError):
        mon.step(-1.0, torch.tensor([0]), 0)
