"""Staleness monitor: S, S*eta, cumulative drift, the bound's two terms and regime, and a
learning rate scaled like 1/S only where the stale term binds."""

from __future__ import annotations

import math

import numpy as np
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


def _feed(mon, steps, *, kappa, floor, kappa_ref, lr=1e-2, norm=2.0, lags=(0, 1, 2, 3),
          seed=0):
    """Synthetic run: the batch's mean |log pi - log mu| is floor + kappa x (x = the drift
    behind its tokens) and mean |log pi - log pi_ref| is kappa_ref D_T."""
    rng = np.random.default_rng(seed)
    drift = [0.0]
    rep = None
    for t in range(1, steps + 1):
        v_learn = t + 10
        lag = rng.choice(lags, 40)
        x = float(np.mean([drift[-1] - drift[max(len(drift) - 1 - int(g), 0)] for g in lag]))
        sign = torch.tensor(rng.choice([-1.0, 1.0], 40))
        lr_ = torch.full((40,), floor + kappa * x, dtype=torch.float64) * sign
        ref = torch.full((40,), kappa_ref * drift[-1], dtype=torch.float64) * sign
        rep = mon.step(lr, torch.tensor(v_learn - lag), v_learn, update_norm=norm,
                       log_ratio=lr_, ref_log_ratio=ref)
        drift.append(drift[-1] + lr * norm)
    return rep


def test_kappa_is_fitted_with_the_mismatch_floor_as_intercept():
    """Mismatch is nonzero at zero drift: a fit through the origin would mix it into kappa;
    the monitor recovers slope and floor, and R_batch is the drift left to the clip edge."""
    rep = _feed(StalenessMonitor(), 30, kappa=0.5, floor=0.05, kappa_ref=0.2)
    assert rep.kappa == pytest.approx(0.5, rel=1e-9)
    assert rep.mismatch_floor == pytest.approx(0.05, abs=1e-12)
    assert rep.r_batch == pytest.approx((math.log(1.2) - 0.05) / 0.5, rel=1e-9)
    # a floor beyond the clip band: the batch is outside it at zero drift
    rep2 = _feed(StalenessMonitor(), 10, kappa=0.5, floor=0.3, kappa_ref=0.2)
    assert rep2.r_batch == 0.0 and rep2.eta_bound == 0.0 and rep2.lr_over_bound == math.inf


def test_the_fitted_floor_stays_between_zero_and_the_smallest_observation():
    """A saturating relation pulls an unconstrained intercept above every observation
    (or below 0): the floor is clamped and the slope refitted through it."""
    from learner_client.staleness_monitor import LineFit

    f = LineFit()
    for x, y in [(0.0, 0.02), (1.0, 0.8), (2.0, 0.9), (3.0, 0.95)]:
        f.add(x, y)
    k, c = f.fit()
    assert c == pytest.approx(0.02)
    assert k == pytest.approx((0.8 + 1.8 + 2.85 - 0.02 * 6) / 14)
    g = LineFit()
    for x, y in [(1.0, 0.1), (2.0, 0.5), (3.0, 0.9)]:  # unconstrained c = -0.3
        g.add(x, y)
    k, c = g.fit()
    assert c == 0.0 and k == pytest.approx((0.1 + 1.0 + 2.7) / 14)


def test_r_crit_comes_from_its_own_observable_so_the_switch_moves():
    """R_batch and R_crit no longer share kappa: two runs with the same lag relation but a
    different drift from the starting policy switch regimes at different T / S."""
    a = _feed(StalenessMonitor(), 30, kappa=0.5, floor=0.0, kappa_ref=0.5)
    b = _feed(StalenessMonitor(), 30, kappa=0.5, floor=0.0, kappa_ref=0.05)
    assert a.r_batch == pytest.approx(b.r_batch)
    assert a.kappa_ref == pytest.approx(0.5) and b.kappa_ref == pytest.approx(0.05)
    assert a.r_crit == pytest.approx(1.0 / 0.5) and b.r_crit == pytest.approx(1.0 / 0.05)
    assert a.r_crit / a.r_batch != pytest.approx(b.r_crit / b.r_batch)
    # at T = 30, S = 3 (R_batch = log 1.2 / 0.5 = 0.36): a (R_crit = 2) is horizon-limited,
    # b (R_crit = 20) stale-limited
    assert a.binding == "horizon" and b.binding == "stale"
    assert a.eta_bound == pytest.approx(a.horizon_term) and b.eta_bound == pytest.approx(
        b.stale_term)
    # without ref_log_ratio R_crit is unknown (it is not derived from kappa)
    mon = StalenessMonitor()
    rep = mon.step(1e-2, torch.tensor([3, 4]), 5, update_norm=1.0,
                   log_ratio=torch.tensor([0.1, -0.2]))
    assert rep.r_crit is None and rep.binding is None


def test_scaled_lr_scales_only_where_the_stale_term_binds():
    cfg = StalenessMonitorConfig(g_upd=1.0, r_batch=0.5, r_crit=10.0)
    mon = StalenessMonitor(cfg)
    # S_switch = T R_batch / R_crit = T / 20: at T = 100 lags up to 5 keep the base lr
    assert mon.scaled_lr(1e-3, 1, steps=100) == pytest.approx(1e-3)
    assert mon.scaled_lr(1e-3, 5, steps=100) == pytest.approx(1e-3)
    assert mon.scaled_lr(1e-3, 10, steps=100) == pytest.approx(5e-4)
    assert mon.scaled_lr(1e-3, 20, steps=100) * 20 == pytest.approx(5 * 1e-3)
    # stale-limited early (T = 20 -> S_switch = 1): 1/S from S = 1
    assert mon.scaled_lr(1e-3, 4, steps=20) == pytest.approx(2.5e-4)
    assert mon.binding(4, 20) == "stale" and mon.binding(4, 100) == "horizon"
    # constants unknown: no evidence that S limits eta, the base lr is kept
    assert StalenessMonitor().scaled_lr(1e-3, 8) == pytest.approx(1e-3)
    with pytest.raises(ValueError):
        mon.step(-1.0, torch.tensor([0]), 0)
