"""The staleness rule, one set of cases run against the gateway's ``core/staleness.py`` and
the learner's ``learner_client/staleness.py`` (which may not import the gateway; both re-export
``rollout_proto/staleness.py``, the one copy):
lag = learner_version - version; stale when lag > max_lag (inclusive bound, None: no bound);
a trajectory is as stale as its oldest token."""

from __future__ import annotations

import numpy as np
import pytest

import learner_client.staleness as learner_side
import rollout_gateway.core.staleness as gateway_side
from rollout_gateway.core.admission import AdmissionConfig, AdmissionController, Verdict

SIDES = pytest.mark.parametrize("rules", [gateway_side, learner_side], ids=["gateway", "learner"])

#: (learner_version, version, lag)
LAGS = [(10, 7, 3), (5, 5, 0), (3, 5, -2), (2**31 - 1, 0, 2**31 - 1)]
#: (lag, max_lag, stale)
BOUNDS = [(3, 2, True), (2, 2, False), (0, 0, False), (1, 0, True), (-2, 0, False),
          (10**6, None, False)]


@SIDES
def test_lag_is_learner_version_minus_version(rules):
    for lv, v, want in LAGS:
        got = rules.lag(lv, v)
        assert got == want and type(got) is int
    col = rules.lag(2**31 - 1, np.array([0, 5, 2**31 - 1], np.int32))  # no int32 overflow
    assert col.dtype == np.int64 and col.tolist() == [2**31 - 1, 2**31 - 6, 0]


@SIDES
def test_stale_past_the_bound_inclusive_and_never_without_one(rules):
    for lag, bound, want in BOUNDS:
        assert rules.is_stale(lag, bound) is want
    lags = np.array([lag for lag, _b, _w in BOUNDS[:-1]])
    assert rules.is_stale(lags, 0).tolist() == [True, True, False, True, False]
    assert rules.is_stale(lags, None).tolist() == [False] * len(lags)


@SIDES
def test_stale_mask_names_the_tokens_past_the_bound(rules):
    pv = np.array([7, 8, 9, 10], np.int32)
    assert rules.stale_mask(10, pv, 2).tolist() == [True, False, False, False]
    assert rules.stale_mask(10, pv, 0).tolist() == [True, True, True, False]
    assert rules.stale_mask(10, pv, None).tolist() == [False] * 4
    assert rules.stale_mask(10, np.zeros(0, np.int32), 1).shape == (0,)


def test_both_sides_agree_on_random_cases():
    rng = np.random.default_rng(0)
    for _ in range(200):
        lv = int(rng.integers(0, 20))
        pv = rng.integers(0, 20, size=int(rng.integers(0, 6))).astype(np.int32)
        bound = None if rng.random() < 0.2 else int(rng.integers(0, 5))
        g, k = gateway_side.stale_mask(lv, pv, bound), learner_side.stale_mask(lv, pv, bound)
        assert g.tolist() == k.tolist()
        # a trajectory is as stale as its oldest token: stale iff any token is
        oldest = gateway_side.trajectory_staleness(lv, pv).max_lag
        assert bool(gateway_side.is_stale(oldest, bound)) == bool(g.any())


def test_admission_judges_by_the_same_rule():
    rng = np.random.default_rng(1)
    for _ in range(100):
        bound = int(rng.integers(0, 4))
        ctl = AdmissionController(AdmissionConfig(max_staleness=bound, stale_policy="mask"))
        ctl.stats.running = 1
        lv = int(rng.integers(0, 10))
        pv = rng.integers(0, 10, size=int(rng.integers(0, 6))).astype(np.int32)
        j = ctl.judge(pv, learner_version=lv)
        stale = gateway_side.stale_mask(lv, pv, bound)
        assert (j.verdict is Verdict.MASK) == bool(stale.any())
        if j.mask is not None:
            assert j.mask.tolist() == (~stale).tolist()
