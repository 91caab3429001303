"""Ops surface against a real gateway process in front of two real reference engines that
run rollouts through an in_place hot-swap, with a learner pulling over gRPC:
``GET /v1/lag``, gRPC ``GetStatus.lag``, ``/metrics`` (parsed by prometheus_client),
``rollout-gateway status`` as a process, and ``/dashboard`` in headless Chromium."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from _gateway_support import GatewayProcess

pytestmark = pytest.mark.integration

CHROMIUM = "/usr/bin/chromium"
OUT = Path(os.environ.get("ROLLOUT_GATEWAY_TEST_OUTPUT",
                          Path(__file__).resolve().parents[2] / "test-output"))


def _post_rollout(url: str, prompt: list[int], n: int, tokens: int, group: str) -> dict:
    body = {"input_ids": prompt, "n": n, "group_id": group,
            "sampling_params": {"max_new_tokens": tokens, "temperature": 1.0, "ignore_eos": True}}
    r = httpx.post(url + "/v1/rollouts", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def ops(checkpoint_v1, checkpoint_v2):
    """Two engines (slowed so a swap lands mid-sequence), a gateway, rollouts through an
    in_place swap 0 -> 1, a learner that pulls (and acks) half of what was published."""
    from learner_client import TrajectoryClient
    from rollout_gateway.commands.engine_process import EngineProcess

    # incremental streams (as deploy/ runs SGLang): in-flight tokens are counted as they arrive
    kw = {"checkpoint": checkpoint_v1, "weight_version": "0", "step_delay_ms": 25,
          "incremental_streaming_output": True}
    with EngineProcess(**kw) as e0, EngineProcess(**kw) as e1, \
            GatewayProcess({"e0": e0.url, "e1": e1.url},
                           env={"ROLLOUT_GATEWAY_LAG_HISTORY_INTERVAL_S": "0.2"}) as gw:
        results: list[dict] = []
        threads = [threading.Thread(target=lambda i=i: results.append(
            _post_rollout(gw.url, [1 + i, 2, 3, 4], 2, 48, f"g{i}"))) for i in range(3)]
        for t in threads:
            t.start()
        # swap while tokens are in flight
        first = _wait(lambda: (lambda r: r["in_flight"]["tokens"] and r)(
            httpx.get(gw.url + "/v1/lag").json()), 60, "tokens in flight")
        assert {b["lag"] for b in first["in_flight"]["buckets"]} == {0}
        assert first["in_flight"]["requests_by_engine_lag"][0]["lag"] == 0
        r = httpx.post(gw.url + "/v1/weights", timeout=120,
                       json={"version": 1, "source": {"kind": "disk", "path": str(checkpoint_v2)},
                             "mode": "in_place"})
        assert r.status_code == 200 and r.json()["ok"], r.text
        for t in threads:
            t.join(180)
        assert len(results) == 3
        client = TrajectoryClient(f"127.0.0.1:{gw.grpc_port}", group="ops-learner",
                                  learner_version=1)
        try:
            assert client.create_group()
            got = client.pull(3, timeout=30)
            assert got
            client.ack(got)
            # GetStatus while nothing else moves
            status = client.status()
        finally:
            client.close()
        yield {"gw": gw, "results": results, "pulled": got, "status": status}


def test_lag_report_and_grpc_status(ops):
    gw = ops["gw"]
    rep = httpx.get(gw.url + "/v1/lag").json()
    assert rep["learner_version"] == 1
    assert {e["id"]: (e["version"], e["lag"], e["state"]) for e in rep["engines"]} == {
        "e0": (1, 0, "healthy"), "e1": (1, 0, "healthy")}
    trajs = [t for r in ops["results"] for t in r["trajectories"]]
    tokens = sum(t["num_tokens"] for t in trajs)
    spanning = sum(1 for t in trajs if len(set(t["policy_version"])) > 1)
    stale_kv = sum(sum(1 for p, k in zip(t["policy_version"], t["kv_version"]) if k < p)
                   for t in trajs)
    it = rep["intra_trajectory"]
    assert it["trajectories"] == len(trajs) == 6 and it["tokens"] == tokens
    assert it["spanning_versions"] == spanning >= 1  # the swap landed mid-sequence
    assert it["tokens_on_stale_kv"] == stale_kv > 0  # in_place: old KV under new weights
    # pause windows of the swap, one per engine, closed
    wins = [w for w in rep["pause_windows"] if w["version"] == 1 and w["engine"] != "*"]
    assert {w["engine"] for w in wins} == {"e0", "e1"}
    assert all(w["seconds"] is not None and w["seconds"] >= 0 for w in wins)
    # delivered: exactly the pulled trajectories' tokens, at lag 1 - policy_version
    want: dict[int, int] = {}
    for ro in ops["pulled"]:
        for v in ro.policy_version.tolist():
            want[1 - v] = want.get(1 - v, 0) + 1
    assert {b["lag"]: b["tokens"] for b in rep["delivered"]["buckets"]} == want
    assert rep["delivered"]["trajectories"] == len(ops["pulled"])
    # unconsumed: the rest (acked ones gone), per token
    rest = [t for t in trajs if t["trajectory_id"] not in {r.trajectory_id for r in ops["pulled"]}]
    want_un: dict[int, int] = {}
    for t in rest:
        for v in t["policy_version"]:
            want_un[1 - v] = want_un.get(1 - v, 0) + 1
    assert {b["lag"]: b["tokens"] for b in rep["unconsumed"]["buckets"]} == want_un
    assert rep["unconsumed"]["entries"] == len(rest) == rep["store_backlog"]
    assert rep["groups"] == [{"group": "ops-learner", "backlog": len(rest), "pending": 0,
                              "redelivered": 0}]
    assert rep["in_flight"]["tokens"] == 0 and rep["in_flight"]["samples"] == 0
    # the same figures over gRPC GetStatus
    lag = ops["status"].lag
    assert rep["replica"] is None and lag.replica  # HTTP: admin only; gRPC: learners
    assert {e.engine_id: (e.version, e.lag) for e in lag.engines} == {"e0": (1, 0), "e1": (1, 0)}
    assert {b.lag: b.tokens for b in lag.delivered.buckets} == want
    assert {b.lag: b.tokens for b in lag.unconsumed.buckets} == want_un
    assert lag.trajectories_spanning_versions == spanning
    assert lag.tokens_on_stale_kv == stale_kv
    assert {w.engine_id for w in lag.pause_windows if w.version == 1} >= {"e0", "e1"}
    assert [(g.group, g.backlog) for g in lag.groups] == [("ops-learner", len(rest))]
    # bad query: 4xx with a message
    r = httpx.get(gw.url + "/v1/lag?recent_swaps=0")
    assert 400 <= r.status_code < 500


def test_metrics_parse_and_carry_histograms(ops):
    from prometheus_client.parser import text_string_to_metric_families

    gw = ops["gw"]
    r = httpx.get(gw.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}

    def hist_count(name: str, **labels) -> float:
        f = fams[name]
        assert f.type == "histogram", (name, f.type)
        return sum(s.value for s in f.samples if s.name == name + "_count"
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    assert hist_count("rollout_gateway_http_request_duration_seconds",
                      route="/v1/rollouts", method="POST", status="200") == 3
    assert hist_count("rollout_gateway_time_to_first_token_seconds") == 6
    assert hist_count("rollout_gateway_swap_pause_seconds", engine="e0") == 1
    assert hist_count("rollout_gateway_swap_pause_seconds", engine="e1") == 1
    assert hist_count("rollout_gateway_admission_wait_seconds", kind="new",
                      outcome="admitted") == 3
    delivered = sum(len(p.token_ids) for p in ops["pulled"])
    assert hist_count("rollout_gateway_delivered_token_lag") == delivered
    assert hist_count("rollout_gateway_unconsumed_token_lag", shared="true") > 0
    samples = {s.name: s for f in fams.values() for s in f.samples}
    refits = {(s.labels["kind"], s.labels["status"]): s.value
              for s in fams["rollout_gateway_refits"].samples}
    assert refits == {("refit", "succeeded"): 1}
    assert {(s.labels["engine"], s.labels["result"]): s.value
            for s in fams["rollout_gateway_refit_engine_results"].samples} == {
                ("e0", "verified"): 1, ("e1", "verified"): 1}
    assert samples["rollout_gateway_samples_total"].value == 6
    assert samples["rollout_gateway_learner_version"].value == 1
    assert samples["rollout_gateway_learner_version"].labels == {"shared": "true"}


def test_status_command_prints_the_lag_table(ops):
    gw = ops["gw"]
    p = subprocess.run([sys.executable, "-m", "rollout_gateway", "status", "--url", gw.url],
                       capture_output=True, text=True, timeout=60, env=gw.env)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "learner version 1" in out
    lines = out.splitlines()
    engines = [ln.split() for ln in lines if ln.startswith(("e0 ", "e1 "))]
    assert sorted(engines) == [["e0", "healthy", "1", "0", "0"], ["e1", "healthy", "1", "0", "0"]]
    rep = httpx.get(gw.url + "/v1/lag").json()
    assert f"{rep['delivered']['tokens']} tokens" in next(
        ln for ln in lines if ln.startswith("delivered"))
    assert "ops-learner" in out
    assert rep["data_plane"] in ("native", "python") and f"data plane {rep['data_plane']}" in out
    # an unreachable gateway: exit 1 and a message, no traceback
    p = subprocess.run([sys.executable, "-m", "rollout_gateway", "status", "--url",
                        "http://127.0.0.1:9"], capture_output=True, text=True, timeout=60,
                       env=gw.env)
    assert p.returncode == 1 and "cannot reach" in p.stdout and "Traceback" not in p.stderr


def test_dashboard_renders_in_chromium(ops, tmp_path):
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), "Debian chromium is missing: run scripts/ensure-chromium.sh"
    gw = ops["gw"]
    # keep a rollout in flight while the page polls, so the in-flight charts have data
    # (started once the page polls: Chromium's start under load must not outlast it)
    bg = threading.Thread(target=lambda: _post_rollout(gw.url, [9, 9, 9], 1, 160, "bg"))
    OUT.mkdir(parents=True, exist_ok=True)
    shot = OUT / "dashboard.png"
    try:
        with sync_playwright() as pw:
            ctx = pw.chromium.launch_persistent_context(
                str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True,
                viewport={"width": 1400, "height": 1050},
                args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                      "--disable-component-update", "--disable-sync", "--no-first-run",
                      "--disable-quic"])
            try:
                page = ctx.new_page()
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                offsite: list[str] = []
                page.on("request", lambda r: None if r.url.startswith(gw.url)
                        else offsite.append(r.url))
                page.goto(gw.url + "/dashboard")
                page.wait_for_function("Number(document.body.dataset.updates || 0) >= 1",
                                       timeout=30_000)
                bg.start()
                page.wait_for_function(
                    "Number(document.getElementById('chart-inflight').dataset.marks) > 0 && "
                    "Number(document.getElementById('chart-inflight-requests').dataset.marks) > 0",
                    timeout=60_000)
                marks = page.evaluate(
                    "() => Object.fromEntries([...document.querySelectorAll('svg.chart')]"
                    ".map(s => [s.id, Number(s.dataset.marks)]))")
                for chart in ("chart-lag", "chart-versions", "chart-states", "chart-inflight",
                              "chart-inflight-requests",
                              "chart-unconsumed", "chart-delivered", "chart-pauses",
                              "chart-throughput"):
                    assert marks[chart] > 0, (chart, marks)
                rep = httpx.get(gw.url + "/v1/lag").json()
                assert page.inner_text("#learner-version") == str(rep["learner_version"]) == "1"
                assert page.inner_text("#version-cut") == "  |  ".join(
                    f"v{c['version']}: {', '.join(c['engines'])}" for c in rep["version_cut"])
                rows = page.eval_on_selector_all(
                    "#engines tbody tr", "rs => rs.map(r => [...r.cells].map(c => c.innerText))")
                assert sorted((r[0], r[2], r[3]) for r in rows) == sorted(
                    (e["id"], str(e["version"]), str(e["lag"])) for e in rep["engines"])
                # the fleet: the refit transaction with each engine's result, policy facts
                refits = page.eval_on_selector_all(
                    "#refits tbody tr", "rs => rs.map(r => [...r.cells].map(c => c.innerText))")
                assert refits == [[x["swap_id"], f"v{x['version']} {x['mode']}", x["status"],
                                   ", ".join(f"{k}: {v}" for k, v in x["results"].items()),
                                   f"{x['stale_dropped']} / {x['kv_refused']}"]
                                  for x in rep["fleet"]["refits"]]
                assert refits[0][1:4] == ["v1 in_place", "succeeded",
                                          "e0: verified v1, e1: verified v1"]
                fleet = page.eval_on_selector_all(
                    "#fleet dt, #fleet dd", "es => es.map(e => e.innerText)")
                assert dict(zip(fleet[::2], fleet[1::2], strict=True))[
                    "trajectories spanning versions"] == str(
                        rep["intra_trajectory"]["spanning_versions"])
                # the delivered chart draws exactly the API's buckets
                bars = page.eval_on_selector_all(
                    "#chart-delivered rect", "rs => rs.map(r => Number(r.dataset.value))")
                assert sorted(bars) == sorted(b["tokens"] for b in rep["delivered"]["buckets"])
                page.screenshot(path=str(shot), full_page=True)
                assert not errors, errors
                assert not offsite, offsite  # everything is served by the gateway
            finally:
                ctx.close()
    finally:
        if bg.is_alive():
            bg.join(180)
    assert shot.stat().st_size > 10_000
