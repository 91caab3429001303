"""A retried request_id answers what its earlier run stored and generates only the rest
(embedded store and registry; the engines replaced by a counting runner)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from rollout_gateway.core.admission import AdmissionConfig
from rollout_gateway.core.trajectory import FinishReason, Segment, TokenColumns, Trajectory
from rollout_gateway.errors import AlreadyExists, EngineError
from rollout_gateway.registry import InMemoryRegistry
from rollout_gateway.rollouts.gatekeeper import Gatekeeper
from rollout_gateway.rollouts.models import RolloutRequest
from rollout_gateway.rollouts.rollout import RolloutService
from rollout_gateway.settings import GatewaySettings
from rollout_gateway.store.base import StoreConfig
from rollout_gateway.store.memory import MemoryStore


class CountingRunner:
    """Each run draws fresh random tokens, so a regenerated sample differs."""

    def __init__(self) -> None:
        self.runs: list[str] = []
        self.fail: set[str] = set()
        self.gate: asyncio.Event | None = None
        self.rng = np.random.default_rng(0)

    async def run(self, req, tid, group, index, *, sticky_key, prompt_ids, on_chunk=None,
                  passthrough=None):
        self.runs.append(tid)
        if self.gate is not None:
            await self.gate.wait()
        if tid in self.fail:
            raise EngineError("engine died")
        n = 4
        cols = TokenColumns(token_ids=self.rng.integers(0, 1000, n), logprobs=-np.ones(n),
                            entropy=np.ones(n), policy_version=np.zeros(n, int),
                            kv_version=np.zeros(n, int))
        return Trajectory(tid, np.array([1, 2]), cols, FinishReason("stop"),
                          [Segment(0, n, 0, "e0")], group_id=group, sample_index=index), "x"


def service(store=None):
    store = store or MemoryStore()
    gk = Gatekeeper(AdmissionConfig(), store, InMemoryRegistry(), "r")
    svc = RolloutService(pool=None, store=store, settings=GatewaySettings(), gatekeeper=gk)
    svc.runner = CountingRunner()
    return svc


def ids(results):
    return [t.tokens.token_ids.tolist() for t, _ in results]


async def test_a_retried_request_id_answers_the_stored_trajectories():
    svc = service()
    req = RolloutRequest(input_ids=[1, 2], n=3, request_id="job-7")
    first = await svc.run_with_text(req)
    again = await svc.run_with_text(req)
    assert ids(again) == ids(first) and len(svc.runner.runs) == 3
    assert [t.group_id for t, _ in again] == [first[0][0].group_id] * 3
    assert svc.counters["replayed"] == 3 and svc.gatekeeper.running == 0


async def test_only_samples_never_stored_are_generated_again():
    svc = service()
    req = RolloutRequest(input_ids=[1, 2], n=3, request_id="job-8")
    svc.runner.fail = {"job-8:1"}
    with pytest.raises(EngineError) as ei:
        await svc.run_with_text(req)
    assert ei.value.details["finished_ids"] == ["job-8:0", "job-8:2"]
    stored = await svc.store.lookup(["job-8:0", "job-8:1", "job-8:2"])
    assert set(stored) == {"job-8:0", "job-8:2"}
    svc.runner.fail = set()
    svc.runner.runs.clear()
    again = await svc.run_with_text(req)
    assert svc.runner.runs == ["job-8:1"]  # only the one never stored
    assert [t.trajectory_id for t, _ in again] == ["job-8:0", "job-8:1", "job-8:2"]


async def test_a_retry_while_the_original_runs_waits_for_it():
    svc = service()
    svc.runner.gate = asyncio.Event()
    req = RolloutRequest(input_ids=[1, 2], n=2, request_id="job-9")
    original = asyncio.create_task(svc.run_with_text(req))
    retry = asyncio.create_task(svc.run_with_text(req))
    await asyncio.sleep(0.05)
    assert len(svc.runner.runs) == 2  # the retry did not start its own samples
    svc.runner.gate.set()
    a, b = await original, await retry
    assert ids(a) == ids(b) and len(svc.runner.runs) == 2


async def test_a_stream_retry_replays_stored_samples_first():
    svc = service()
    req = RolloutRequest(input_ids=[1, 2], n=2, request_id="job-10", stream=True)
    first = [ev async for ev in await svc.open_stream(req)]
    again = [ev async for ev in await svc.open_stream(req)]
    tok = lambda evs: sorted(e["trajectory"].tokens.token_ids.tolist() for e in evs  # noqa: E731
                             if e["type"] == "trajectory")
    assert tok(again) == tok(first) and len(svc.runner.runs) == 2


async def test_consumed_and_trimmed_trajectories_are_reported_not_regenerated():
    store = MemoryStore(StoreConfig(retention_seconds=0))
    svc = service(store)
    req = RolloutRequest(input_ids=[1, 2], n=1, request_id="job-11")
    await svc.run_with_text(req)
    await store.create_group("g")
    got = await store.read("g", "c", 10)
    await store.ack("g", [e.entry_id for e in got])
    store._trim()
    with pytest.raises(AlreadyExists, match="no longer retained"):
        await svc.run_with_text(req)
    assert len(svc.runner.runs) == 1 and svc.gatekeeper.running == 0


async def test_a_concurrent_run_elsewhere_answers_the_copy_the_store_kept():
    store = MemoryStore()
    a, b = service(store), service(store)  # two replicas sharing one store
    b.runner.rng = np.random.default_rng(99)
    req = RolloutRequest(input_ids=[1, 2], n=1, request_id="job-12")
    first = await a.run_with_text(req)
    b._plan = _no_lookup(b._plan)  # b started before a stored anything
    second = await b.run_with_text(req)
    assert b.runner.runs == ["job-12:0"]  # b generated its own...
    assert ids(second) == ids(first)  # ...but answers the stored copy
    assert b.counters["duplicates"] == 1


def _no_lookup(plan):
    async def wrapped(req, tenant, stamp):
        group, tids, sticky, _ = await plan(req.model_copy(update={"request_id": None}),
                                            tenant, stamp)
        return group, [f"{req.request_id}:{i}" for i in range(req.n)], sticky, {}
    return wrapped
