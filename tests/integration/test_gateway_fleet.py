"""The fleet control plane beyond one refit (docs/fleet.md) against three reference engines
as processes: stale samples dropped on purpose during a refit's pause (published as they
are, or requeued from the prompt), KV provenance under a version policy (an in_place swap
never serves a request KV older than its policy admits: it is re-prefilled instead), and
an engine whose weights changed behind the gateway's back re-verified against the
checkpoint's manifest and loaded again."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from _gateway_support import GatewayProcess, Streams, wait_for

from rollout_gateway.rollouts.sample import STALE_DROPPED
from rollout_gateway.swap.manifest import MANIFEST_FILE, checksum, write_manifest

pytestmark = pytest.mark.integration

SAMPLED = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
           "lm_head.weight")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Checkpoints v1..v3, each with its manifest, and ``odd``: other weights."""
    from reference_engine.checkpoint import init_checkpoint
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("fleet")
    out = {}
    for v in (1, 2, 3):
        out[v] = init_checkpoint(root / f"v{v}", seed=40 + v)
        tensors = load_file(str(out[v] / "model.safetensors"))
        write_manifest(out[v], {n: t for n, t in tensors.items() if n in SAMPLED})
    out["odd"] = init_checkpoint(root / "odd", seed=49)
    return out


def refit(gw, ckpt, version: int, **extra) -> dict:
    r = httpx.post(gw.url + "/v1/weights", timeout=120, json={
        "version": version, "source": {"kind": "disk", "path": str(ckpt)}, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def counters(gw) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(gw.url + "/metrics", timeout=10).text
    return {s.name + json.dumps(s.labels, sort_keys=True) if s.labels else s.name: s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def trajs(futs) -> list[dict]:
    return [t for f in futs for t in f.result()["trajectories"]]


def test_drop_stale_publishes_or_requeues_stale_samples_during_the_pause(make_engine, ckpts):
    engines = {k: make_engine(checkpoint=ckpts[1], weight_version="0", step_delay_ms=10,
                              incremental_streaming_output=True) for k in "abc"}
    with GatewayProcess({k: e.url for k, e in engines.items()}) as gw, Streams(gw.url) as st, \
            ThreadPoolExecutor(1) as ex:
        # samples that start at v0, long enough to outlive two refits
        old = [st.start([3 + i, 4, 5], n=1, max_new_tokens=3000) for i in range(3)]
        st.wait_tokens(2)
        # a default refit (abort_resume): every sample resumes on v1, none is lost
        body = refit(gw, ckpts[1], 1)
        assert {r["stale_dropped"] for r in body["results"].values()} == {0}
        # samples that start at v1
        new = [st.start([6 + i, 4, 5], n=1, max_new_tokens=60) for i in range(3)]
        st.wait_tokens(4)
        # drop what started below v1 during the pause, published as it is
        body = refit(gw, ckpts[2], 2, mode="retract",
                     drop_stale={"below_version": 1, "then": "publish"})
        dropped = sum(r["stale_dropped"] for r in body["results"].values())
        assert dropped == 3, body
        for t in trajs(old):
            assert t["finish_reason"] == {"type": "abort", "message": STALE_DROPPED}, t
            assert 0 < t["num_tokens"] < 3000 and t["policy_version"][0] == 0, t
            assert set(t["policy_version"]) <= {0, 1}, t
            assert t["segments"][-1]["ended"] == "aborted"
        for t in trajs(new):  # started at v1: not stale, resumed and ran to their length
            assert t["finish_reason"]["type"] == "length" and t["num_tokens"] == 60, t
            assert min(t["policy_version"]) == 1
        # a buffered sample that starts at v2 is requeued by a refit dropping below v3: it
        # starts again from the prompt, every token of its answer is v3
        fut = ex.submit(httpx.post, gw.url + "/v1/rollouts", timeout=120, json={
            "input_ids": [9, 9, 4], "n": 1, "sampling_params": {
                "max_new_tokens": 100, "temperature": 1.0, "ignore_eos": True}})
        wait_for(lambda: httpx.get(gw.url + "/v1/lag").json()["in_flight"]["tokens"] >= 3,
                 60, "the buffered sample's first tokens")
        body = refit(gw, ckpts[3], 3, mode="in_place",
                     drop_stale={"below_version": 3, "then": "requeue"})
        assert sum(r["stale_dropped"] for r in body["results"].values()) == 1, body
        r = fut.result()
        assert r.status_code == 200, r.text
        (t,) = r.json()["trajectories"]
        assert t["num_tokens"] == 100 and set(t["policy_version"]) == {3}, t
        assert t["segments"][0]["began"] == "start" and t["finish_reason"]["type"] == "length"
        c = counters(gw)
        assert c["rollout_gateway_refit_stale_published_total"] == 3
        assert c["rollout_gateway_refit_stale_requeued_total"] == 1
        assert c["rollout_gateway_refit_requests_broken_off_stale_total"] == 4
        assert c['rollout_gateway_refits_total{"kind": "refit", "status": "succeeded"}'] == 3
        for k in "abc":
            assert c['rollout_gateway_refit_engine_results_total{"engine": "%s", '
                     '"result": "verified"}' % k] == 3
        fleet = httpx.get(gw.url + "/v1/lag").json()["fleet"]
        assert (fleet["stale_published"], fleet["stale_requeued"]) == (3, 1)
        assert [(x["version"], x["stale_dropped"]) for x in fleet["refits"]] == [
            (3, 1), (2, 3), (1, 0)]
        assert fleet["refits"][0]["results"] == {k: "verified v3" for k in "abc"}


def test_in_place_never_serves_kv_older_than_the_policy_admits(make_engine, ckpts):
    engines = {k: make_engine(checkpoint=ckpts[1], weight_version="0", step_delay_ms=10,
                              incremental_streaming_output=True) for k in "abc"}
    with GatewayProcess({k: e.url for k, e in engines.items()}) as gw, Streams(gw.url) as st:
        futs = {p: st.start([5, 6, 7 + i], n=1, max_new_tokens=160, version_policy=p)
                for i, p in enumerate(("any", "max_staleness:1", "latest"))}
        st.wait_tokens(2)
        one = refit(gw, ckpts[1], 1, mode="in_place")
        # every sample streams on at v1 before the next swap
        st.wait_tokens(max(st.tokens.values()) + 3)
        two = refit(gw, ckpts[2], 2, mode="in_place")
        refused = [sum(r["kv_refused"] for r in b["results"].values()) for b in (one, two)]
        # refit 1: latest refuses KV one version old; refit 2: latest again (its re-prefill
        # was v1) and max_staleness:1 (its KV, v0, is now two behind)
        assert refused == [1, 2], (one, two)
        out = {p: f.result()["trajectories"] for p, f in futs.items()}
        for p, ts in out.items():
            for t in ts:
                assert t["num_tokens"] == 160 and set(t["policy_version"]) == {0, 1, 2}, t
                lv = t["policy_version"]
                # lag of the KV each token attended to, against the version that sampled it
                worst = max(pv - kv for pv, kv in zip(lv, t["kv_version"], strict=True))
                began = [s["began"] for s in t["segments"]]
                if p == "any":  # in_place kept the v0 KV through both swaps
                    assert worst == 2 and "abort_resume" not in began, t["segments"]
                elif p == "max_staleness:1":  # kept once, re-prefilled at the second
                    assert worst == 1 and began.count("abort_resume") == 1, t["segments"]
                else:  # latest: never a token on KV of another version
                    assert worst == 0 and began.count("abort_resume") == 2, t["segments"]
        c = counters(gw)
        assert c["rollout_gateway_version_policy_kv_reprefills_total"] == 3
        assert c["rollout_gateway_refit_requests_broken_off_kv_policy_total"] == 3
        assert httpx.get(gw.url + "/v1/lag").json()["fleet"]["kv_policy_reprefills"] == 3


def test_weights_changed_behind_the_gateway_are_reverified_and_loaded_again(make_engine,
                                                                          ckpts):
    a = make_engine(checkpoint=ckpts[1], weight_version="0")
    b = make_engine(checkpoint=ckpts[1], weight_version="0")
    manifest = json.loads((ckpts[1] / MANIFEST_FILE).read_text())

    def matches(url: str) -> bool:
        for name, want in manifest["tensors"].items():
            got = httpx.post(url + "/get_weights_by_name", timeout=10, json={
                "name": name, "truncate_size": manifest["truncate_size"]}).json()
            if checksum(got) != want:
                return False
        return True

    with GatewayProcess({"a": a.url, "b": b.url}) as gw:
        refit(gw, ckpts[1], 1)
        assert matches(a.url) and matches(b.url)
        # someone loads other weights into a under the same label, behind the gateway
        r = httpx.post(a.url + "/update_weights_from_disk", timeout=60, json={
            "model_path": str(ckpts["odd"]), "weight_version": "1"})
        assert r.status_code == 200 and not matches(a.url), r.text
        # the health probe sees it (model_path moved), registers it again, re-verifies it
        # against v1's manifest, finds the tensors differ and loads v1's checkpoint again
        rec = wait_for(lambda: next((s for s in httpx.get(gw.url + "/v1/versions").json()[
            "recent_swaps"] if s["message"].startswith("re-verification of a failed")), None),
            60, "a's re-verification")
        assert "differs from the checkpoint's manifest" in rec["message"], rec
        assert rec["status"] == "succeeded" and rec["version"] == 1
        assert rec["engines"]["a"]["verification"] == f"version and {len(SAMPLED)} " \
                                                      "sampled tensor(s)"
        assert matches(a.url)
        eng = wait_for(lambda: (lambda e: e["state"] == "healthy" and e)(
            httpx.get(gw.url + "/v1/engines/a").json()), 30, "a back in rotation")
        assert eng["weight_version"] == 1 and eng["epoch"] == 1
