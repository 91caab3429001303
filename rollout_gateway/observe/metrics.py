"""``/metrics``: Prometheus exposition built on ``prometheus_client``, read from a
:class:`~rollout_gateway.observe.view.GatewayView` at scrape time.

Per replica (each replica exposes its own; sum them across replicas):
histograms of HTTP request latency, time to first token, swap pause window per engine,
admission wait and the lag of delivered tokens; counters of rollouts, samples, tokens,
failovers, re-prefills, admission verdicts; gauges of in-flight work and engine versions.

Shared (read from the store / registry that every replica shares, e.g. Redis): learner
version, store backlog and counters, per-group backlog, unconsumed tokens by lag. Every
replica exports them with the label ``shared="true"``; aggregate them with ``max``, never
``sum`` (the Grafana dashboard in deploy/ does), so nothing is double counted.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from rollout_gateway.core.staleness import lag
from rollout_gateway.errors import GatewayError
from rollout_gateway.observe.tracker import in_flight_tokens
from rollout_gateway.observe.view import GatewayView

disable_created_metrics()  # no *_created series: they double the exposition for nothing

PREFIX = "rollout_gateway_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: lag buckets (versions) of the token-lag histograms
LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
            300.0)

#: rollout service counters -> (metric name without _total, help)
ROLLOUT_COUNTERS = {
    "rollouts": ("rollout_gateway_rollouts", "Rollout requests started"),
    "samples": ("rollout_gateway_samples", "Samples finished"),
    "tokens": ("rollout_gateway_tokens", "Output tokens stamped"),
    "published": ("rollout_gateway_published", "Trajectories published to the store"),
    "duplicates": ("rollout_gateway_duplicates", "Publishes ignored as duplicates"),
    "publish_failed": ("rollout_gateway_publish_failed", "Trajectories the store refused or "
                       "failed to take (returned to the caller with metadata.publish_error)"),
    "failed_samples": ("rollout_gateway_failed_samples", "Samples that failed"),
    "failovers": ("rollout_gateway_failovers", "Segments resumed on another engine after a "
                  "failure"),
    "abort_resumes": ("rollout_gateway_abort_resumes", "Segments resumed after an abort_resume "
                      "swap"),
    "tokens_reprefilled": ("rollout_gateway_tokens_reprefilled", "Prompt + output tokens "
                           "re-prefilled by retract, abort_resume and failover"),
    "replayed": ("rollout_gateway_replayed", "Samples of a retried request_id answered from "
                 "the store"),
    "policy_filtered": ("rollout_gateway_version_policy_filtered", "Engine requests whose "
                        "version policy kept them from an engine in rotation"),
    "policy_unroutable": ("rollout_gateway_version_policy_unroutable", "Requests and samples "
                          "answered 503 because no engine runs a version their policy "
                          "admits"),
    "stale_published": ("rollout_gateway_refit_stale_published", "Samples a refit's "
                        "drop_stale broke off and published with their output so far"),
    "stale_requeued": ("rollout_gateway_refit_stale_requeued", "Samples a refit's drop_stale "
                       "broke off and started again from the prompt"),
    "kv_policy_reprefills": ("rollout_gateway_version_policy_kv_reprefills", "Engine "
                             "requests broken off before an in_place swap because their "
                             "version policy refuses the KV they would keep (re-prefilled "
                             "under the new weights)"),
    "cut_short": ("rollout_gateway_cut_short", "Samples cut short by shutdown past "
                  "drain_grace_s (published with their output so far)"),
    "engine_chunks": ("rollout_gateway_engine_chunks", "Streamed chunks read from engines "
                      "(each costs engine and gateway CPU; engine_stream_interval sets how "
                      "many tokens one carries)"),
}
_ADMISSION_GAUGES = ("running", "recycle_waiting")


class GatewayMetrics:
    """The histograms one replica observes; counters and gauges are read at scrape time."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.http_latency = Histogram(
            "rollout_gateway_http_request_duration_seconds",
            "HTTP request latency until the last byte of the response (streams included)",
            ["method", "route", "status"], registry=r, buckets=_SECONDS)
        self.ttft = Histogram(
            "rollout_gateway_time_to_first_token_seconds",
            "From a sample's start to the first streamed chunk of its engine response",
            registry=r, buckets=_SECONDS)
        self.swap_pause = Histogram(
            "rollout_gateway_swap_pause_seconds",
            "Time an engine was paused (fenced) for a weight swap",
            ["engine"], registry=r, buckets=_SECONDS)
        self.admission_wait = Histogram(
            "rollout_gateway_admission_wait_seconds",
            "Time a rollout (kind=new) or a recycled sample (kind=recycled) spent in "
            "admission control", ["kind", "outcome"], registry=r, buckets=_SECONDS)

    def observe_admission(self, kind: str, admitted: bool, seconds: float) -> None:
        self.admission_wait.labels(kind, "admitted" if admitted else "refused").observe(seconds)

    def observe_pause(self, engine_id: str, seconds: float) -> None:
        self.swap_pause.labels(engine_id).observe(seconds)


def lag_histogram(name: str, help_: str, by_lag: dict[int, int],
                  labels: dict[str, str] | None = None) -> HistogramMetricFamily:
    """Tokens by lag as a Prometheus histogram (each token one observation)."""
    labels = labels or {}
    h = HistogramMetricFamily(name, help_, labels=list(labels))
    total = sum(by_lag.values())
    buckets = [(str(float(b)), sum(c for k, c in by_lag.items() if k <= b)) for b in LAG_BUCKETS]
    buckets.append(("+Inf", total))
    h.add_metric(list(labels.values()), buckets, sum(k * c for k, c in by_lag.items()))
    return h


async def _snapshot(view: GatewayView) -> dict[str, Any]:
    """The figures that need I/O (registry, store), read once per scrape."""
    snap: dict[str, Any] = {"errors": 0}
    try:
        snap["learner_version"] = await view.registry.learner_version()
    except GatewayError:
        snap["errors"] += 1
    try:
        snap["stats"] = await view.store.stats()
        snap["groups"] = await view.store.group_stats()
        snap["unconsumed"] = await view.store.unconsumed_tokens()
    except GatewayError:
        snap["errors"] += 1
    return snap


class _Live:
    """Counters and gauges read from the gateway's live state at scrape time."""

    def __init__(self, view: GatewayView, snap: dict[str, Any]) -> None:
        self.view, self.snap = view, snap

    def collect(self):  # noqa: C901 - one flat list of families
        view, snap = self.view, self.snap
        c = view.rollouts.counters
        for key, (name, help_) in ROLLOUT_COUNTERS.items():
            yield CounterMetricFamily(name, help_, value=c[key])
        yield GaugeMetricFamily("rollout_gateway_inflight_samples", "Samples generating now",
                                value=view.rollouts.inflight_samples)
        engines = view.engines()
        for name, help_, fn in (
                ("engine_outstanding_requests", "Requests in flight per engine",
                 lambda e: e.outstanding_requests),
                ("engine_outstanding_tokens", "Max new tokens of requests in flight per engine",
                 lambda e: e.outstanding_tokens),
                ("engine_weight_version", "Weight version each engine runs (-1: unknown)",
                 lambda e: e.version if e.version is not None else -1)):
            g = GaugeMetricFamily(PREFIX + name, help_, labels=["engine"])
            for e in engines:
                g.add_metric([e.id], fn(e))
            yield g
        refits = CounterMetricFamily(PREFIX + "refits", "Refit transactions this replica "
                                     "led, by kind (refit, catch_up) and status "
                                     "(succeeded, partial, failed)", labels=["kind", "status"])
        for (kind, status), n in sorted(view.refits.transactions.items()):
            refits.add_metric([kind, status], n)
        yield refits
        per = CounterMetricFamily(PREFIX + "refit_engine_results", "Per-engine outcomes of "
                                  "the refits this replica led (verified, kept_version, "
                                  "failed)", labels=["engine", "result"])
        for (eid, result), n in sorted(view.refits.engine_results.items()):
            per.add_metric([eid, result], n)
        yield per
        for name, help_, v in (
                ("refit_requests_broken_off_stale", "Requests a refit's drop_stale broke off "
                 "during its pause", view.refits.stale_dropped),
                ("refit_requests_broken_off_kv_policy", "Requests an in_place refit broke "
                 "off because their version policy refuses the KV they would keep",
                 view.refits.kv_refused)):
            yield CounterMetricFamily(PREFIX + name, help_, value=v)
        g = GaugeMetricFamily("rollout_gateway_engine_up", "1 when the engine is in rotation",
                              labels=["engine", "state"])
        for e in engines:
            g.add_metric([e.id, e.state.value], int(e.routable))
        yield g
        lv = snap.get("learner_version")
        shared = {"shared": "true"}
        yield _gauge("rollout_gateway_learner_version",
                     "Current learner weight version (-1: registry unreachable)",
                     lv if lv is not None else -1, shared)
        g = GaugeMetricFamily("rollout_gateway_engine_version_lag",
                              "learner version - engine version", labels=["engine"])
        if lv is not None:
            for e in engines:
                if e.version is not None:
                    g.add_metric([e.id], lag(lv, e.version))
        yield g
        lags = view.gatekeeper.lag_counts
        fam = CounterMetricFamily("rollout_gateway_trajectory_lag",
                                  "Finished trajectories by max lag in versions at finish "
                                  "(8+ = 8 or more)", labels=["lag"])
        for k, v in sorted(lags.items()):
            fam.add_metric([str(k) + ("+" if k == 8 else "")], v)
        yield fam
        for k, v in view.gatekeeper.counters().items():
            if k in _ADMISSION_GAUGES:
                yield GaugeMetricFamily(f"rollout_gateway_admission_{k}",
                                        f"Admission control: {k.replace('_', ' ')} samples",
                                        value=v)
            else:
                yield CounterMetricFamily(f"rollout_gateway_admission_{k}",
                                          f"Admission control: {k.replace('_', ' ')} samples",
                                          value=v)
        for k, v in view.sessions.counters.items():  # agent sessions (docs/agents.md)
            yield CounterMetricFamily(PREFIX + k, f"Agent sessions: {k.replace('_', ' ')}",
                                      value=v)
        yield GaugeMetricFamily(PREFIX + "sessions_open", "Agent sessions open now",
                                value=sum(view.sessions.open_by_tenant.values()))
        by = GaugeMetricFamily(PREFIX + "tenant_sessions_open", "Agent sessions open now, "
                               "per tenant (client_tenants)", labels=["tenant"])
        for tenant, n in sorted(view.sessions.open_by_tenant.items()):
            if n <= 0:
                continue
            by.add_metric([tenant], n)
        yield by
        f = view.tracker.finished
        for name, help_, v in (
                ("trajectories_spanning_versions", "Finished trajectories whose tokens come "
                 "from more than one weight version", f.spanning_versions),
                ("tokens_on_stale_kv", "Finished tokens whose KV came from an older version "
                 "(kv_version < policy_version)", f.tokens_on_stale_kv),
                ("delivered_trajectories", "Trajectories sent to learners over gRPC",
                 view.tracker.delivered_trajectories)):
            yield CounterMetricFamily(PREFIX + name, help_, value=v)
        yield lag_histogram("rollout_gateway_delivered_token_lag",
                            "Tokens sent to learners by lag (learner version the learner "
                            "reported - the token's policy version)", view.tracker.delivered)
        by_version, _n = in_flight_tokens(list(view.running()))
        if lv is not None:
            yield lag_histogram("rollout_gateway_inflight_token_lag",
                                "Tokens generated so far by running samples, by lag",
                                {lag(lv, v): n for v, n in by_version.items()})
        if view.old_logits is not None:  # exact old logits (old_logits.mode)
            for k, v in view.old_logits.metrics().items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    fam = GaugeMetricFamily if k == "scorer_version" else CounterMetricFamily
                    yield fam(PREFIX + "old_logits_" + k, f"Exact old logits "
                              f"({view.old_logits.mode}): {k.replace('_', ' ')}", value=v)
        yield _gauge("rollout_gateway_scrape_errors", "Shared figures that could not be read "
                     "for this scrape (registry or store unreachable)", snap["errors"])
        # ---- shared figures (store / registry): aggregate with max across replicas ----
        st = snap.get("stats")
        if st is not None:
            yield _gauge("rollout_gateway_store_backlog", "Published, not yet acknowledged "
                         "(max over consumer groups)", st.backlog, shared)
            for name, help_, v in (
                    ("store_published", "Trajectories stored", st.published),
                    ("store_duplicates", "Publishes ignored as duplicates", st.duplicates),
                    ("store_stale_dropped", "Deliveries dropped by a learner's staleness bound",
                     st.stale_dropped),
                    ("store_stale_masked", "Deliveries masked by a learner's staleness bound",
                     st.stale_masked),
                    ("store_stale_recycled", "Deliveries whose prompt was recycled",
                     st.stale_recycled),
                    ("store_dead_lettered", "Entries dead-lettered after max deliveries",
                     st.dead_lettered),
                    ("store_redelivered", "Redeliveries (lease expiry or nack)", st.redelivered),
                    ("store_overflow_dropped", "Entries full consumer groups lost "
                     "(max_backlog per group: oldest dropped)", st.overflow_dropped),
                    ("store_unreplicated", "Publishes fewer Redis replicas acknowledged in "
                     "time than replica_acks", st.unreplicated)):
                yield _counter(PREFIX + name, help_, v, shared)
            gb = GaugeMetricFamily("rollout_gateway_group_backlog",
                                   "Entries a consumer group has not acknowledged",
                                   labels=["group", "shared"])
            gr = CounterMetricFamily("rollout_gateway_group_redelivered",
                                     "Redeliveries to a consumer group", labels=["group", "shared"])
            go = CounterMetricFamily("rollout_gateway_group_overflow_dropped",
                                     "Entries a consumer group lost at its max_backlog "
                                     "(oldest dropped)", labels=["group", "shared"])
            for grp in snap.get("groups", []):
                gb.add_metric([grp.group, "true"], grp.backlog)
                gr.add_metric([grp.group, "true"], grp.redelivered)
                go.add_metric([grp.group, "true"], grp.overflow_dropped)
            yield gb
            yield gr
            yield go
            un = snap.get("unconsumed")
            if un is not None and lv is not None:
                yield lag_histogram("rollout_gateway_unconsumed_token_lag",
                                    "Output tokens finished but not yet acknowledged, by lag",
                                    {lag(lv, v): n for v, n in un.tokens_by_version.items()},
                                    shared)


def _gauge(name: str, help_: str, value: float, labels: dict[str, str] | None = None):
    g = GaugeMetricFamily(name, help_, labels=list(labels or {}))
    g.add_metric(list((labels or {}).values()), value)
    return g


def _counter(name: str, help_: str, value: float, labels: dict[str, str] | None = None):
    g = CounterMetricFamily(name, help_, labels=list(labels or {}))
    g.add_metric(list((labels or {}).values()), value)
    return g


async def render(view: GatewayView, metrics: GatewayMetrics) -> bytes:
    snap = await _snapshot(view)
    live = CollectorRegistry(auto_describe=False)
    live.register(_Live(view, snap))
    return generate_latest(metrics.registry) + generate_latest(live)
