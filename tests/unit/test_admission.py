"""Admission control (AReaL-style off-policyness bound) and the finish-time stale policy."""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest
from pydantic import ValidationError

from rollout_gateway.core.admission import (
    AdmissionConfig,
    AdmissionController,
    Verdict,
    capacity,
)
from rollout_gateway.core.staleness import StalePolicy, stale_mask
from rollout_gateway.errors import InvalidArgument, ResourceExhausted


def areal_capacity(max_staleness, batch, version, accepted, running, max_concurrent):
    """AReaL StalenessManager.get_capacity, restated."""
    return min(max_concurrent - running, (max_staleness + version + 1) * batch
               - (accepted + running))


@pytest.mark.parametrize("s, b, v, consumed_batches, backlog, running", [
    (0, 4, 0, 0, 0, 0), (2, 8, 5, 5, 3, 7), (1, 16, 10, 10, 20, 0), (4, 2, 3, 3, 0, 9)])
def test_backlog_form_equals_areal_when_learner_consumes_a_batch_per_version(
        s, b, v, consumed_batches, backlog, running):
    cfg = AdmissionConfig(max_staleness=s, batch_size=b, max_concurrent=100)
    accepted = consumed_batches * b + backlog
    want = areal_capacity(s, b, v, accepted, running, 100)
    assert capacity(cfg, learner_version=v, running=running, backlog=backlog).available == want
    exact = capacity(cfg, learner_version=v, running=running, backlog=backlog,
                     consumed=consumed_batches * b)
    assert exact.available == want


def test_resumed_learner_is_not_over_admitted():
    cfg = AdmissionConfig(max_staleness=1, batch_size=8, max_concurrent=10_000)
    cap = capacity(cfg, learner_version=120, running=0, backlog=0)
    assert cap.available == 16 and cap.binding == "staleness"


def test_admit_all_or_nothing_and_refusals_are_counted():
    ctl = AdmissionController(AdmissionConfig(max_staleness=1, batch_size=4, max_concurrent=6))
    ctl.admit(5, learner_version=0, backlog=2)  # (1+1)*4 = 8 >= 2 + 5
    with pytest.raises(ResourceExhausted, match="staleness bound") as ei:
        ctl.admit(2, learner_version=0, backlog=2)  # 2 + 5 + 2 > 8
    assert ei.value.details["available"] == 1 and ei.value.http_status == 429
    assert ctl.stats.refused == 2 and ctl.stats.running == 5
    ctl.admit(1, learner_version=0, backlog=0)
    with pytest.raises(ResourceExhausted, match="concurrency bound"):
        ctl.admit(1, learner_version=0, backlog=0)  # 6 running = max_concurrent
    assert ctl.stats.admitted == 6


def test_disabled_admits_everything_but_still_counts():
    ctl = AdmissionController(AdmissionConfig(enabled=False, max_staleness=0, batch_size=1,
                                              max_concurrent=1))
    ctl.admit(50, learner_version=0, backlog=100)
    assert ctl.running == 50


def test_fifo_schedule_never_consumes_past_the_bound():
    """Simulate engines and a learner: with in-order completion, every consumed sample
    was generated at most max_staleness versions before the learner trains on it."""
    rng = random.Random(7)
    s, b = 2, 8
    ctl = AdmissionController(AdmissionConfig(max_staleness=s, batch_size=b,
                                              max_concurrent=64))
    version = 0
    running: deque[int] = deque()  # version each in-flight sample was generated at
    backlog: deque[int] = deque()
    max_seen = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.4:
            n = rng.randint(1, 6)
            try:
                ctl.admit(n, learner_version=version, backlog=len(backlog))
                running.extend([version] * n)
            except ResourceExhausted:
                pass
        elif op < 0.8 and running:
            for _ in range(min(len(running), rng.randint(1, 5))):
                v = running.popleft()
                j = ctl.judge(np.array([v], np.int32), learner_version=version)
                assert j.verdict == Verdict.ACCEPT
                backlog.append(v)
        elif len(backlog) >= b:
            for _ in range(b):
                max_seen = max(max_seen, version - backlog.popleft())
            version += 1
    assert version > 20  # the schedule made progress
    assert max_seen <= s
    assert ctl.stats.refused > 0  # the bound was actually hit
    assert ctl.stats.admitted == ctl.stats.finished + ctl.running


@pytest.mark.parametrize("policy, verdict, counter", [
    (StalePolicy.DROP, Verdict.DROP, "stale_dropped"),
    (StalePolicy.MASK, Verdict.MASK, "stale_masked"),
    (StalePolicy.RECYCLE, Verdict.RECYCLE, "stale_recycled")])
def test_stale_policy_at_finish(policy, verdict, counter):
    ctl = AdmissionController(AdmissionConfig(max_staleness=2, stale_policy=policy))
    ctl.admit(3, learner_version=5, backlog=0)
    fresh = ctl.judge(np.array([3, 4, 5], np.int32), learner_version=5)
    assert fresh.verdict == Verdict.ACCEPT and fresh.max_lag == 2
    stale = ctl.judge(np.array([2, 3, 5], np.int32), learner_version=5)
    assert stale.verdict == verdict and stale.max_lag == 3
    assert getattr(ctl.stats, counter) == 1 and ctl.stats.accepted == 1
    if policy == StalePolicy.MASK:
        assert stale.mask.tolist() == [False, True, True]
    empty = ctl.judge(np.zeros(0, np.int32), learner_version=5)
    assert empty.verdict == Verdict.ACCEPT
    assert ctl.running == 0 and ctl.stats.finished == 3


def test_recycle_limit_drops_and_counts():
    ctl = AdmissionController(AdmissionConfig(max_staleness=0, stale_policy="recycle",
                                              max_recycles=1))
    ctl.admit(2, learner_version=1, backlog=0)
    assert ctl.judge(np.array([0]), learner_version=1, recycles=0).verdict == Verdict.RECYCLE
    assert ctl.judge(np.array([0]), learner_version=1, recycles=1).verdict == Verdict.DROP
    assert ctl.stats.recycle_exhausted == 1 and ctl.stats.stale_dropped == 1


def test_release_accounting_is_checked():
    ctl = AdmissionController()
    ctl.admit(1, learner_version=0, backlog=0)
    ctl.release_failed(1)
    assert ctl.stats.failed == 1 and ctl.running == 0
    with pytest.raises(InvalidArgument):
        ctl.release_failed(1)
    with pytest.raises(InvalidArgument):
        ctl.admit(0, learner_version=0, backlog=0)


def test_config_bounds_and_docs():
    with pytest.raises(ValidationError):
        AdmissionConfig(max_staleness=-1)
    with pytest.raises(ValidationError):
        AdmissionConfig(batch_size=0)
    with pytest.raises(ValidationError):
        AdmissionConfig(unknown=1)
    for name, f in AdmissionConfig.model_fields.items():
        assert f.description, f"{name} has no docstring"


def test_token_mask():
    m = ~stale_mask(10, np.array([7, 8, 9, 10], np.int32), max_lag=2)  # usable tokens
    assert m.tolist() == [False, True, True, True]


def test_other_replicas_in_flight_count_against_the_shared_bound():
    cfg = AdmissionConfig(max_staleness=0, batch_size=10, max_concurrent=100)
    a, b = AdmissionController(cfg), AdmissionController(cfg)
    a.admit(6, learner_version=0, backlog=0)
    with pytest.raises(ResourceExhausted):
        b.admit(6, learner_version=0, backlog=0, others_running=a.running)
    b.admit(4, learner_version=0, backlog=0, others_running=a.running)
    assert capacity(cfg, learner_version=0, running=b.running, backlog=0,
                    others_running=a.running).available == 0


def test_try_admit_counts_nothing_when_full_and_admit_leaves_room_for_recycled():
    ctl = AdmissionController(AdmissionConfig(max_staleness=0, batch_size=2, max_concurrent=10))
    assert ctl.try_admit(2, learner_version=0, backlog=0)
    assert not ctl.try_admit(1, learner_version=0, backlog=0)
    assert (ctl.stats.admitted, ctl.stats.refused, ctl.running) == (2, 0, 2)
    ctl.release_failed(1)
    ctl.stats.recycle_waiting = 1  # one recycled sample waits for the freed slot
    with pytest.raises(ResourceExhausted) as ei:
        ctl.admit(1, learner_version=0, backlog=0)
    assert ei.value.details["reserved_for_recycled"] == 1
    assert "reserved for recycled" in ei.value.message
    assert ctl.try_admit(1, learner_version=0, backlog=0)  # the waiter takes it
    assert ctl.running == 2


def test_other_replicas_count_against_the_shared_bound_not_the_local_limit():
    ctl = AdmissionController(AdmissionConfig(max_staleness=0, batch_size=4, max_concurrent=3))
    with pytest.raises(ResourceExhausted):
        ctl.admit(2, learner_version=0, backlog=1, others_running=2)  # 1 + 2 + 2 > 4
    assert ctl.try_admit(1, learner_version=0, backlog=1, others_running=2)
    assert not ctl.try_admit(1, learner_version=0, backlog=0, others_running=3)
    # max_concurrent counts this replica only
    assert ctl.try_admit(2, learner_version=0, backlog=0, others_running=0)
    assert not ctl.try_admit(1, learner_version=0, backlog=0, others_running=0)


def test_replica_id_and_recycle_wait_are_validated():
    with pytest.raises(ValidationError):
        AdmissionConfig(replica_id="has space")
    with pytest.raises(ValidationError):
        AdmissionConfig(recycle_wait_s=-1)
    assert AdmissionConfig(replica_id="gw-1:42").replica_id == "gw-1:42"
