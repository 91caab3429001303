"""Prometheus text exposition of the gateway's counters and gauges (no client library)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollout_gateway.errors import GatewayError

if TYPE_CHECKING:
    from rollout_gateway.api.state import Gateway


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Out:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help_: str, samples: list[tuple[dict[str, str], float]]) -> None:
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lab = ",".join(f'{k}="{_esc(str(v))}"' for k, v in labels.items())
            self.lines.append(f"{name}{{{lab}}} {value}" if lab else f"{name} {value}")


async def render(gw: Gateway) -> str:
    o = _Out()
    c = gw.rollouts.counters
    for key, help_ in (("rollouts", "Rollout requests started"),
                       ("samples", "Samples finished"), ("tokens", "Output tokens stamped"),
                       ("published", "Trajectories published to the store"),
                       ("duplicates", "Publishes ignored as duplicates"),
                       ("publish_failed", "Trajectories the store refused or failed to take "
                        "(returned to the caller with metadata.publish_error)"),
                       ("failed_samples", "Samples that failed"),
                       ("failovers", "Segments resumed on another engine after a failure"),
                       ("abort_resumes", "Segments resumed after an abort_resume swap"),
                       ("tokens_reprefilled", "Prompt + output tokens re-prefilled by retract, "
                        "abort_resume and failover"),
                       ("replayed", "Samples of a retried request_id answered from the store")):
        o.metric(f"rollout_gateway_{key}_total", "counter", help_, [({}, c[key])])
    o.metric("rollout_gateway_inflight_samples", "gauge", "Samples generating now",
             [({}, gw.rollouts.inflight_samples)])
    engines = gw.pool.list()
    o.metric("rollout_gateway_engine_outstanding_requests", "gauge", "Requests in flight per engine",
             [({"engine": e.id}, e.outstanding_requests) for e in engines])
    o.metric("rollout_gateway_engine_outstanding_tokens", "gauge",
             "Max new tokens of requests in flight per engine",
             [({"engine": e.id}, e.outstanding_tokens) for e in engines])
    o.metric("rollout_gateway_engine_weight_version", "gauge", "Weight version each engine runs",
             [({"engine": e.id}, e.version if e.version is not None else -1) for e in engines])
    o.metric("rollout_gateway_engine_up", "gauge", "1 when the engine is in rotation",
             [({"engine": e.id, "state": e.state.value}, int(e.routable)) for e in engines])
    try:
        lv = await gw.registry.learner_version()
    except GatewayError:
        lv = None
    o.metric("rollout_gateway_learner_version", "gauge", "Current learner weight version",
             [({}, lv if lv is not None else -1)])
    if lv is not None:
        o.metric("rollout_gateway_engine_version_lag", "gauge", "learner version - engine version",
                 [({"engine": e.id}, lv - e.version) for e in engines if e.version is not None])
    try:
        st = await gw.store.stats()
        o.metric("rollout_gateway_store_backlog", "gauge", "Published, not yet acknowledged",
                 [({}, st.backlog)])
        o.metric("rollout_gateway_store_published_total", "counter", "Trajectories stored",
                 [({}, st.published)])
    except GatewayError:
        pass
    lags = gw.gatekeeper.lag_counts
    o.metric("rollout_gateway_trajectory_lag_total", "counter",
             "Finished trajectories by max lag in versions at finish (8 = 8 or more)",
             [({"lag": str(k) + ("+" if k == 8 else "")}, v) for k, v in sorted(lags.items())])
    for k, v in gw.gatekeeper.counters().items():
        kind = "gauge" if k in ("running", "recycle_waiting") else "counter"
        name = f"rollout_gateway_admission_{k}" + ("" if kind == "gauge" else "_total")
        o.metric(name, kind, f"Admission control: {k.replace('_', ' ')} samples", [({}, v)])
    return "\n".join(o.lines) + "\n"
