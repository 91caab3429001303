"""The pure parts of engine re-registration (issue 19, findings 5 and 6): who an engine is
(engines.identity), the KV namespace per version and epoch, the labels an answer may carry
(core.stamping.foreign_label), KV kept by a refused flush (stamp_request kv_kept), and the
pool's reaction to a changed identity (a stub client: no I/O)."""

from __future__ import annotations

from rollout_gateway.core.stamping import (
    Span,
    foreign_label,
    kv_namespace,
    normalize_spans,
    stamp_request,
)
from rollout_gateway.core.trajectory import Transition
from rollout_gateway.engines.client import EngineInfo, Health
from rollout_gateway.engines.identity import EngineIdentity, process_marker
from rollout_gateway.engines.pool import Engine, EnginePool, EngineState
from rollout_gateway.settings import GatewaySettings

#: the fields SGLang 0.5.23's /server_info answers (http_server.py server_info)
SERVER_A = {"version": "0.5.23", "random_seed": 812734, "model_path": "/ckpt/v0",
            "startup_time": {"load_weight": 3.1, "kv_cache_allocation": 0.2,
                             "scheduler_e2e": 9.7, "tokenizer_e2e": 12.5}}


def test_a_new_process_has_another_marker_and_the_same_process_the_same():
    again = dict(SERVER_A, internal_states=[{"num_running_reqs": 3}])  # live state ignored
    assert process_marker(SERVER_A) == process_marker(again) is not None
    assert process_marker(dict(SERVER_A, random_seed=5)) != process_marker(SERVER_A)
    other_start = dict(SERVER_A, startup_time=dict(SERVER_A["startup_time"], load_weight=3.2))
    assert process_marker(other_start) != process_marker(SERVER_A)
    assert process_marker({"version": "0.5.23"}) is None  # an engine that says neither


def test_identity_changes_name_what_moved_and_ignore_what_is_not_reported():
    a = EngineIdentity("p1", "/ckpt/v0", 0)
    assert a.changes(EngineIdentity("p1", "/ckpt/v0", 0)) == []
    assert a.changes(EngineIdentity(None, None, 0)) == []  # not reported: not compared
    moved = a.changes(EngineIdentity("p2", "/ckpt/v1", 3))
    assert len(moved) == 3 and "new process" in moved[0] and "'/ckpt/v1'" in moved[1]
    assert moved[2] == "weight_version 0 -> 3"


def test_the_kv_namespace_differs_per_version_and_per_epoch():
    names = {kv_namespace(v, e) for v in (0, 1) for e in (0, 1)}
    assert len(names) == 4
    assert kv_namespace(3) == kv_namespace(3, 0) == "v3e0"


def test_foreign_labels_are_older_or_newer_without_a_swap():
    installed = {2: Transition.IN_PLACE}
    assert foreign_label([1, 1], 1, installed) is None
    assert foreign_label([1, 2], 1, installed) is None  # a swap installed 2 under it
    assert foreign_label([1, 3], 1, installed) == 3  # newer, but no swap installed it
    assert foreign_label([0], 1, installed) == 0  # older: other weights
    assert foreign_label([5], None, installed) is None  # sent without a known version


def test_a_refused_flush_keeps_the_older_kv_across_a_retract_boundary():
    spans = normalize_spans([Span(1, 0, 2), Span(2, 2, 4)], 4, None)
    installed = {2: Transition.RETRACT}
    rebuilt = stamp_request(spans, offset=0, engine_id="e0", began=Transition.START,
                            installed_by=installed)
    kept = stamp_request(spans, offset=0, engine_id="e0", began=Transition.START,
                         installed_by=installed, kv_kept={2})
    assert rebuilt.kv_version.tolist() == [1, 1, 2, 2]
    assert kept.kv_version.tolist() == [1, 1, 1, 1]
    assert kept.policy_version.tolist() == rebuilt.policy_version.tolist() == [1, 1, 2, 2]
    assert kept.segments[1].began == Transition.RETRACT  # the swap mode is still recorded


class ChangingClient:
    """What the pool's probe and re-registration call; ``now`` is who the engine is."""

    def __init__(self, now: EngineIdentity) -> None:
        self.url = "http://stub"
        self.now = now
        self.info = EngineInfo(weight_version=now.weight_version, identity=now)
        self.detects = 0
        self.aborted: list[str] = []

    async def health(self) -> Health:
        return Health.OK

    async def identity(self, read=None) -> EngineIdentity:
        return self.now

    async def detect(self) -> EngineInfo:
        self.detects += 1
        self.info = EngineInfo(weight_version=self.now.weight_version, identity=self.now)
        return self.info

    def abort_inflight(self, why: str) -> int:
        self.aborted.append(why)
        return 1


async def test_a_changed_engine_is_registered_again_with_a_new_epoch():
    pool = EnginePool(GatewaySettings())
    first = EngineIdentity("p1", "/ckpt/v0", 0)
    client = ChangingClient(first)
    eng = Engine(id="a", client=client, version=0, identity=first)  # type: ignore[arg-type]
    eng.installed_by[1] = Transition.IN_PLACE
    pool._engines["a"] = eng
    assert await pool.probe(eng) is EngineState.HEALTHY and eng.epoch == 0
    assert client.detects == 0  # nothing changed: not detected again
    caught_up: list[int] = []

    async def on_recovered(e: Engine) -> None:
        caught_up.append(e.epoch)

    pool.on_recovered = on_recovered
    client.now = EngineIdentity("p2", "/ckpt/v3", 3)  # restarted with other weights
    assert await pool.probe(eng) is EngineState.HEALTHY
    assert (eng.epoch, eng.version, eng.identity) == (1, 3, client.now)
    assert client.detects == 1 and caught_up == [1]
    assert eng.installed_by == {}  # the previous incarnation's swaps say nothing now
    assert eng.failures == 0 and not client.aborted  # no failure: answers are vetted


async def test_a_fenced_engine_is_not_checked_and_a_swap_elsewhere_is_adopted():
    pool = EnginePool(GatewaySettings())
    first = EngineIdentity("p1", "/ckpt/v0", 0)
    client = ChangingClient(first)
    eng = Engine(id="a", client=client, version=0, identity=first)  # type: ignore[arg-type]
    pool._engines["a"] = eng
    client.now = EngineIdentity("p1", "/ckpt/v1", 1)
    pool.close_gate(eng)  # our own swap: its label moves on purpose
    await pool.probe(eng)
    assert eng.epoch == 0 and client.detects == 0
    await pool.open_gate(eng)

    async def swapped_elsewhere(e: Engine, now: EngineIdentity) -> bool:
        return now.weight_version == 1

    pool.swapped_elsewhere = swapped_elsewhere  # another replica's swap explains it
    await pool.probe(eng)
    assert (eng.epoch, eng.version, eng.identity) == (0, 1, client.now)
    assert client.detects == 0 and not client.aborted


def test_a_refused_flush_is_a_load_and_other_failures_are_not():
    import orjson
    import pytest

    from rollout_gateway.engines.client import FLUSH_REFUSED, weight_load
    from rollout_gateway.errors import EngineError

    refused = orjson.dumps({"success": False, "num_paused_requests": 0, "message": (
        FLUSH_REFUSED + " because requests are still running or queued. Retract or finish "
        "them, then call /flush_cache.")})  # SGLang 0.5.23, HTTP 400
    got = weight_load("e0", "/update_weights_from_disk", 400, refused)
    assert got.cache_flushed is False and got.message.startswith(FLUSH_REFUSED)
    ok = orjson.dumps({"success": True, "message": "Succeeded to update model weights."})
    assert weight_load("e0", "/update_weights_from_disk", 200, ok).cache_flushed is True
    failed = orjson.dumps({"success": False, "message": "Failed to update weights: no file"})
    for status, body in ((400, failed), (200, failed), (500, b"boom"), (200, b"<html>")):
        with pytest.raises(EngineError):
            weight_load("e0", "/update_weights_from_disk", status, body)
