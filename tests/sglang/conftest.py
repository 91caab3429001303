"""Fixtures: the real SGLang 0.5.23 server on toy checkpoints (see _sglang_support.py).

Every test here carries the ``sglang`` marker (added below). The first use builds SGLang's
virtualenv with ``scripts/sglang-cpu.sh`` (cached under ~/.cache; ~1.5-3 min once). A server
takes 21-35 s to start and ~2.4 GB of memory, so servers are shared per session.

Stable names:

``sglang_checkpoints`` (session)
    :class:`Checkpoints`: ``path(v)`` / ``seed(v)`` for weight versions "0", "1", "2"
    (seeds 100, 101, 102), each a ``reference_engine`` checkpoint with the byte tokenizer.
``sglang_server`` (session)
    One server, SGLang's defaults (overlap scheduler, its tokenizer), serving version "0",
    pinned in the pool (never stopped before the session ends). Tests that update its weights,
    pause it etc. use it through ``sglang``, which puts it back afterwards.
``sglang`` (function)
    ``sglang_server``, restored after the test to v0 / version "0", running and with a flushed
    cache (restarted if the test killed it). The cheap way to a known state.
``sglang_pool`` (session)
    ``sglang_pool.get(**options)`` -> a started server for those :class:`SGLangServer` options
    (``overlap_schedule``, ``skip_tokenizer_init``, ``incremental_streaming_output``,
    ``weight_version``, ``model_path``, ``extra_args``), shared by every test asking the same
    options. At most ``SGLANG_TEST_MAX_LIVE`` (default 2) unpinned pooled servers live at
    once: asking for another stops the least recently used (``get(..., pin=True)`` for a
    session-long fixture: never stopped early). Leave it as you found it (``restore``), or use
    ``make_sglang``.
``make_sglang`` (function)
    ``make_sglang(**options)`` -> a dedicated started server, stopped at the end of the test
    (for tests that restart, kill or otherwise spoil a server).
``sglang_inc`` (function)
    A pooled server with ``--incremental-streaming-output`` (overlap scheduler), put back to
    v0 with an empty cache before and after the test (``restore``).
``serve`` (function)
    ``serve(e0=server, ..., env={...})`` -> a started ``rollout-gateway serve`` in front of
    those servers (:class:`_stamp_truth.GatewayServe`), stopped after the test.
``truth`` (session)
    :class:`_stamp_truth.GroundTruth` over ``sglang_reference``.
``sglang_reference`` (session)
    ``sglang_reference(version)`` -> the reference engine's model (``Qwen3MoeLM``, float32)
    with that version's checkpoint weights: the ground truth to score what SGLang returned
    (``reference_engine.reference.score``).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import httpx
import pytest
from _sglang_support import LIVE, Checkpoints, SGLangServer, sglang_python
from _stamp_truth import LIVE_GATEWAYS, GatewayServe, GroundTruth

SEEDS = {"0": 100, "1": 101, "2": 102, "3": 103, "4": 104}  # 3, 4: retried swap rounds
MAX_LIVE = int(os.environ.get("SGLANG_TEST_MAX_LIVE", "2"))
TEST_TIMEOUT_S = 900


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.sglang)
            # a server start is 21-35 s on a quiet machine, up to ~2 min under other jobs'
            # load, and the first test also pays the venv build if test.sh did not run
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(TEST_TIMEOUT_S))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for srv in list(LIVE):
            report.sections.append((f"{srv.name} log tail ({srv.log_path})", srv.log_tail(80)))
            starts = srv.test_notes()
            if starts:
                report.sections.append((f"{srv.name} starts and stops", starts))
        for gw in list(LIVE_GATEWAYS):
            report.sections.append((f"gateway log tail ({gw.log_path})", gw.log_tail(6000)))


@pytest.fixture(scope="session")
def sglang_venv_python() -> str:
    return sglang_python()


@pytest.fixture(scope="session")
def sglang_checkpoints(tmp_path_factory) -> Checkpoints:
    return Checkpoints.build(tmp_path_factory.mktemp("sglang-ckpt"), SEEDS)


@pytest.fixture(scope="session")
def sglang_logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sglang-logs")


class SGLangPool:
    """Session-shared servers keyed by their options (see the module docstring)."""

    def __init__(self, checkpoints: Checkpoints, logs: Path, max_live: int) -> None:
        self.checkpoints = checkpoints
        self.logs = logs
        self.max_live = max_live
        self.servers: OrderedDict[tuple, SGLangServer] = OrderedDict()
        self.pinned: set[tuple] = set()

    def options(self, **options) -> dict:
        options.setdefault("weight_version", "0")
        options.setdefault("model_path", self.checkpoints.path(options["weight_version"]))
        options["extra_args"] = list(options.get("extra_args", ()))
        return options

    def get(self, *, pin: bool = False, **options) -> SGLangServer:
        options = self.options(**options)
        key = tuple(sorted((k, str(v)) for k, v in options.items()))
        if pin:
            self.pinned.add(key)
        srv = self.servers.get(key)
        if srv is not None:
            self.servers.move_to_end(key)
            if not srv.running():  # a test stopped or killed it: the same server again
                srv.restart(**{k: options[k] for k in ("model_path", "weight_version")})
            return srv
        while len([k for k in self.servers if k not in self.pinned]) >= self.max_live:
            old_key = next(k for k in self.servers if k not in self.pinned)
            self.servers.pop(old_key).stop()
        name = f"sglang-pool{len(self.servers)}-" + "-".join(
            k for k in ("overlap_schedule", "skip_tokenizer_init", "incremental_streaming_output")
            if k in options and options[k] != SGLangServer.__dataclass_fields__[k].default)
        srv = SGLangServer(name=name.rstrip("-"), log_path=self.logs / f"{name.rstrip('-')}.log",
                           **options)
        srv.start()
        self.servers[key] = srv
        return srv

    def close(self) -> None:
        while self.servers:
            self.servers.popitem()[1].stop()


@pytest.fixture(scope="session")
def sglang_pool(sglang_venv_python, sglang_checkpoints, sglang_logs):
    pool = SGLangPool(sglang_checkpoints, sglang_logs, MAX_LIVE)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def sglang_server(sglang_pool) -> SGLangServer:
    return sglang_pool.get(pin=True)


def restore(srv: SGLangServer, checkpoints: Checkpoints) -> None:
    """Put a server back to serving v0 as version "0", unpaused, with an empty radix cache
    (restarted when it is not running or will not go back; each restart noted in its log)."""
    def restart(why: str) -> None:
        srv.note(f"restarted by restore(): {why}")
        srv.restart(model_path=checkpoints.path("0"), weight_version="0")

    if not srv.running():
        restart("not running")
        return
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        c.post("/continue_generation", json={})
        info = c.get("/model_info").json()
        if info["weight_version"] != "0" or info["model_path"] != str(checkpoints.path("0")):
            r = c.post("/update_weights_from_disk",
                       json={"model_path": str(checkpoints.path("0")), "weight_version": "0"})
            if r.status_code != 200 or not r.json().get("success"):
                restart(f"update_weights_from_disk v0 answered {r.status_code}: {r.text[:300]}")
                return
            srv.model_path, srv.weight_version = checkpoints.path("0"), "0"
        r = c.post("/flush_cache")
        if r.status_code != 200:
            restart(f"flush_cache answered {r.status_code}: {r.text[:300]}")


@pytest.fixture
def sglang(sglang_server, sglang_checkpoints):
    if not sglang_server.running():  # a test before killed it and did not restore
        restore(sglang_server, sglang_checkpoints)
    yield sglang_server
    restore(sglang_server, sglang_checkpoints)


@pytest.fixture
def make_sglang(sglang_venv_python, sglang_checkpoints, sglang_logs, request):
    started: list[SGLangServer] = []

    def factory(**options) -> SGLangServer:
        options.setdefault("weight_version", "0")
        options.setdefault("model_path", sglang_checkpoints.path(options["weight_version"]))
        name = f"sglang-{request.node.name}-{len(started)}"
        srv = SGLangServer(name=name, log_path=sglang_logs / f"{name}.log", **options)
        started.append(srv)
        return srv.start()

    yield factory
    for srv in started:
        srv.stop()


@pytest.fixture(scope="session")
def sglang_reference(sglang_checkpoints):
    import torch

    from reference_engine.checkpoint import load_model

    torch.set_num_threads(1)
    cache: dict = {}

    def get(version):
        v = str(version)
        if v not in cache:
            cache[v] = load_model(sglang_checkpoints.path(v))
        return cache[v]

    return get


@pytest.fixture(scope="session")
def truth(sglang_reference) -> GroundTruth:
    return GroundTruth(sglang_reference)


@pytest.fixture
def sglang_inc(sglang_pool, sglang_checkpoints):
    """A shared server with ``--incremental-streaming-output`` (overlap scheduler), put back
    to v0 with an empty cache after the test."""
    srv = sglang_pool.get(incremental_streaming_output=True)
    restore(srv, sglang_checkpoints)
    yield srv
    restore(srv, sglang_checkpoints)


@pytest.fixture
def serve(sglang_logs):
    started: list[GatewayServe] = []

    def factory(env: dict[str, str] | None = None, **engines) -> GatewayServe:
        gw = GatewayServe({k: v.url for k, v in engines.items()}, env=env, log_dir=sglang_logs)
        started.append(gw)
        return gw.start()

    yield factory
    for gw in started:
        gw.stop()
