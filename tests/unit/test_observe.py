"""Pure parts of the observability code: lag distributions, the token-lag histogram
family, the tracker's intra-trajectory figures and the status table."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rollout_gateway.observe.metrics import LAG_BUCKETS, lag_histogram
from rollout_gateway.observe.lag import LagDistribution
from rollout_gateway.observe.tracker import LagTracker
from rollout_gateway.store.base import StoredEntry
from doubles.trajectories import make_trajectory


def test_distribution_from_counts():
    d = LagDistribution.from_counts({2: 3, 0: 5, 1: 0, -1: 2})
    assert [(b.lag, b.tokens) for b in d.buckets] == [(-1, 2), (0, 5), (2, 3)]
    assert d.tokens == 10 and d.max_lag == 2 and d.mean_lag == (-2 + 0 + 6) / 10
    e = LagDistribution.from_counts({})
    assert e.tokens == 0 and e.max_lag is None and e.mean_lag is None


def test_lag_histogram_is_cumulative_and_parses():
    by_lag = {0: 4, 1: 2, 5: 1, 40: 3}

    class C:
        def collect(self):
            yield lag_histogram("rollout_gateway_x_token_lag", "x", by_lag, {"shared": "true"})

    reg = CollectorRegistry()
    reg.register(C())
    [fam] = list(text_string_to_metric_families(generate_latest(reg).decode()))
    assert fam.type == "histogram"
    got = {s.labels["le"]: s.value for s in fam.samples if s.name.endswith("_bucket")}
    want = {str(float(b)): sum(c for k, c in by_lag.items() if k <= b) for b in LAG_BUCKETS}
    want["+Inf"] = 10
    assert got == want and got["0.0"] == 4 and got["6.0"] == 7 and got["32.0"] == 7
    other = {s.name: s.value for s in fam.samples if not s.name.endswith("_bucket")}
    assert other == {"rollout_gateway_x_token_lag_count": 10,
                     "rollout_gateway_x_token_lag_sum": 0 + 2 + 5 + 120}


def test_tracker_counts_delivered_and_intra_trajectory():
    tr = LagTracker()
    t = make_trajectory("a", versions=(2, 3), num_tokens=10)  # 5 tokens at v2, 5 at v3
    t.tokens.kv_version[5:] = 2  # in_place: v3 tokens on v2 KV
    tr.on_finished(t)
    tr.on_finished(make_trajectory("b", versions=(3,), num_tokens=4))
    f = tr.finished
    assert (f.trajectories, f.tokens, f.spanning_versions, f.max_intra_lag) == (2, 14, 1, 1)
    assert f.tokens_after_switch == 5 and f.tokens_on_stale_kv == 5
    e = StoredEntry("1", "a", b"", 18, 2, 3, version_tokens="2:5;3:5")
    old = StoredEntry("2", "b", b"", 12, 3, 3)  # no per-version facts: counted at min_version
    tr.on_delivered([e, old], learner_version=4)
    assert tr.delivered == {2: 5, 1: 5 + 12} and tr.delivered_trajectories == 2


def test_status_table_renders_a_report():
    from rollout_gateway.observe.lag import (
        Delivered,
        EngineLag,
        Fleet,
        InFlight,
        IntraTrajectory,
        LagReport,
        Refit,
        StaleHandling,
        Unconsumed,
        version_cut,
    )
    from rollout_gateway.commands.status import render

    fleet = [SimpleNamespace(id=i, version=v, routable=r)
             for i, v, r in (("e0", 2, True), ("e1", 3, True), ("e2", 2, False),
                             ("e3", None, True))]
    rep = LagReport(
        at=0, replica="r", learner_version=3, max_engine_lag=1,
        version_cut=version_cut(fleet, 3),
        engines=[EngineLag(id="e0", state="healthy", version=2, lag=1, outstanding_requests=0,
                           fenced=False)],
        in_flight=InFlight.from_counts({}, samples=0),
        unconsumed=Unconsumed.from_counts({0: 7, 1: 3}, entries=2),
        delivered=Delivered.from_counts({}, trajectories=0),
        intra_trajectory=IntraTrajectory(trajectories=1, tokens=10, spanning_versions=1,
                                         max_intra_lag=1, tokens_after_switch=3,
                                         tokens_on_stale_kv=3),
        pause_windows=[], staleness=StaleHandling(
            tokens_reprefilled=0, at_finish_dropped=0, at_finish_masked=0, at_finish_recycled=0,
            at_delivery_dropped=1, at_delivery_masked=0, at_delivery_recycled=0,
            dead_lettered=0),
        fleet=Fleet(policy_filtered=4, policy_unroutable=1, kv_policy_reprefills=2,
                    stale_published=3, stale_requeued=0, refits=[Refit(
                        swap_id="ab12", version=3, mode="retract", status="partial",
                        message="", results={"e1": "verified v3", "e0": "kept_version v2"},
                        stale_dropped=3, kv_refused=0)]),
        store_backlog=2, groups=[])
    out = render(rep.model_dump())
    assert "last refit: ab12 v3 retract partial: e1 verified v3, e0 kept_version v2" in out
    assert ("version policy: 4 filtered, 1 unroutable, 2 re-prefilled (kept KV refused); "
            "stale dropped by refits: 3 published, 0 requeued") in out
    assert "learner version 3" in out
    assert ["e0", "healthy", "2", "1", "0"] in [ln.split() for ln in out.splitlines()]
    assert "10 tokens, mean lag 0.30, max 1  [lag:tokens 0:7 1:3]" in out
    assert "version cut: v3 (lag 0): e1  |  v2 (lag 1): e0, e2 (out)  |  v? (lag ?): e3" in out
    assert np.isfinite(rep.unconsumed.mean_lag)
    assert rep.data_plane in ("native", "python") and f"data plane {rep.data_plane}" in out


async def test_get_status_reports_lag_or_says_why_not():
    from rollout_gateway.errors import StoreError
    from rollout_gateway.observe.lag import (
        Delivered,
        Fleet,
        InFlight,
        IntraTrajectory,
        LagReport,
        StaleHandling,
        Unconsumed,
    )
    from rollout_gateway.store.memory import MemoryStore
    from doubles.control_plane import InProcessControlPlane
    from rollout_gateway.transport.servicer import TrajectoryServicer
    from rollout_proto.rollout.v1 import service_pb2 as spb

    svc = TrajectoryServicer(MemoryStore(), InProcessControlPlane(["e0"]))
    st = await svc.GetStatus(spb.StatusRequest(), None)
    assert not st.HasField("lag")  # no gateway behind this server: no lag figures

    async def report():
        return LagReport(
            at=0, replica="r1", learner_version=2, max_engine_lag=0, engines=[],
            in_flight=InFlight.from_counts({0: 3}, samples=1),
            unconsumed=Unconsumed.from_counts({1: 4}, entries=1),
            delivered=Delivered.from_counts({}, trajectories=0),
            intra_trajectory=IntraTrajectory(trajectories=0, tokens=0, spanning_versions=0,
                                             max_intra_lag=0, tokens_after_switch=0,
                                             tokens_on_stale_kv=0),
            pause_windows=[], staleness=StaleHandling(
                tokens_reprefilled=5, at_finish_dropped=0, at_finish_masked=0,
                at_finish_recycled=0, at_delivery_dropped=0, at_delivery_masked=0,
                at_delivery_recycled=0, dead_lettered=0),
            fleet=Fleet(policy_filtered=0, policy_unroutable=0, kv_policy_reprefills=0,
                        stale_published=0, stale_requeued=0, refits=[]),
            store_backlog=1, groups=[])

    svc.lag_report = report
    st = await svc.GetStatus(spb.StatusRequest(), None)
    assert st.lag.replica == "r1" and not st.lag.error
    assert [(b.lag, b.tokens) for b in st.lag.in_flight.buckets] == [(0, 3)]
    assert [(b.lag, b.tokens) for b in st.lag.unconsumed.buckets] == [(1, 4)]
    assert st.lag.tokens_reprefilled == 5 and st.lag.in_flight_samples == 1

    async def broken():
        raise StoreError("redis lag scan failed: connection reset")

    svc.lag_report = broken
    st = await svc.GetStatus(spb.StatusRequest(), None)
    assert st.learner_version == 0 and st.store.max_backlog > 0  # the rest stays valid
    assert st.lag.error.startswith("UNAVAILABLE") and "connection reset" in st.lag.error
    assert not st.lag.in_flight.buckets
