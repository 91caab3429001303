"""Admission slots come back on every exit path after admission (property test).

The rollout service admits n samples, then anything may fail: the prompt conversion, a
sample's engine run, judging (registry down), recycling, publishing, the whole request
being cancelled, a sample task cancelled before it ever ran. Whatever is thrown, once the
request has ended every slot is released: ``running`` returns to 0, and every admitted
sample is counted finished exactly once. The engines are replaced by a scripted runner
(pure code: no I/O); the store and registry are the embedded ones.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from pydantic import ValidationError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_gateway.core.admission import AdmissionConfig
from rollout_gateway.core.trajectory import FinishReason, Segment, TokenColumns, Trajectory
from rollout_gateway.errors import (
    EngineError,
    GatewayError,
    InvalidArgument,
    ResourceExhausted,
    StoreError,
    Timeout,
    Unavailable,
)
from rollout_gateway.registry import InMemoryRegistry
from rollout_gateway.rollouts.gatekeeper import Gatekeeper
from rollout_gateway.rollouts.models import RolloutRequest
from rollout_gateway.rollouts.rollout import RolloutService
from rollout_gateway.settings import GatewaySettings
from rollout_gateway.store.memory import MemoryStore

ERRORS = [InvalidArgument("bad"), EngineError("engine died"), Timeout("hung"),
          Unavailable("none"), StoreError("redis down"), ResourceExhausted("full"),
          GatewayError("internal"), OverflowError("int too big"), ValueError("bad value"),
          RuntimeError("bug"), KeyError("k"), asyncio.CancelledError()]
STAGES = ["ok", "run", "run_late", "judge", "publish", "recycle", "recycle_fail", "never"]


class FlakyRegistry(InMemoryRegistry):
    """learner_version() raises the queued errors (one per call), else answers."""

    def __init__(self) -> None:
        super().__init__()
        self.fail: list[BaseException] = []

    async def learner_version(self) -> int:
        if self.fail:
            raise self.fail.pop()
        return await super().learner_version()


class FlakyStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.fail: list[BaseException] = []

    async def publish(self, trajectory: Trajectory) -> bool:
        if self.fail:
            raise self.fail.pop()
        return await super().publish(trajectory)


def traj(tid: str, version: int) -> Trajectory:
    n = 3
    cols = TokenColumns(token_ids=np.arange(n), logprobs=-np.ones(n), entropy=np.ones(n),
                        policy_version=np.full(n, version), kv_version=np.full(n, version))
    return Trajectory(tid, np.array([1, 2]), cols, FinishReason("stop"),
                      [Segment(0, n, version, "e0")])


class ScriptedRunner:
    """Plays one plan per sample index: where to fail and with what."""

    def __init__(self, plans, registry: FlakyRegistry, store: FlakyStore) -> None:
        self.plans = plans
        self.registry = registry
        self.store = store
        self.calls: dict[int, int] = {}

    async def run(self, req, tid, group, index, *, sticky_key, prompt_ids, on_chunk=None,
                  passthrough=None):
        stage, err = self.plans[index]
        k = self.calls[index] = self.calls.get(index, 0) + 1
        await asyncio.sleep(0)
        if stage == "run":
            raise err
        if on_chunk is not None:
            await on_chunk({"offset": 0})
        await asyncio.sleep(0)
        if stage == "run_late":
            raise err
        if stage == "judge":
            self.registry.fail.append(err)
        if stage == "publish":
            self.store.fail.append(err)
        # recycle: the first run is stale (version 0 against learner version 10)
        stale = stage in ("recycle", "recycle_fail") and k == 1
        if stage == "recycle_fail" and k == 1:
            self.registry.fail.append(err)  # readmission cannot read the learner version
        return traj(tid, 0 if stale else 10), "text"


def build(plans, n_slots: int):
    registry, store = FlakyRegistry(), FlakyStore()
    cfg = AdmissionConfig(max_staleness=2, batch_size=64, stale_policy="recycle",
                          max_recycles=1, recycle_wait_s=0.0)
    gk = Gatekeeper(cfg, store, registry, "r")
    svc = RolloutService(pool=None, store=store, settings=GatewaySettings(), gatekeeper=gk)
    svc.runner = ScriptedRunner(plans, registry, store)
    return svc, gk, registry, store


async def settle(svc: RolloutService) -> None:
    for _ in range(200):
        if not svc._background:
            return
        await asyncio.sleep(0)
    await asyncio.gather(*svc._background, return_exceptions=True)


plan = st.tuples(st.sampled_from(STAGES), st.sampled_from(range(len(ERRORS))))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans=st.lists(plan, min_size=1, max_size=4), stream=st.booleans(),
       bad_prompt=st.booleans(), cancel_after=st.one_of(st.none(), st.integers(0, 6)),
       read_events=st.integers(0, 3), retried=st.booleans())
def test_every_admitted_slot_is_released_whatever_fails(plans, stream, bad_prompt,
                                                        cancel_after, read_events, retried):
    async def main() -> None:
        resolved = [(s, ERRORS[e]) for s, e in plans]
        svc, gk, registry, store = build(resolved, len(plans))
        await registry.set_learner_version(10)
        # retried: the same request_id runs twice (the second answers what the first stored)
        req = RolloutRequest(input_ids=[1, 2, 3], n=len(plans), stream=stream,
                             request_id="rid" if retried else None)
        if bad_prompt:  # the HTTP schema refuses it; past that, a failure must not leak
            req.input_ids = [2147483648]

        async def client() -> None:
            if not stream:
                await svc.run_with_text(req)
                return
            events = await svc.open_stream(req)
            got = 0
            async for _ in events:  # a client may stop reading at any point
                got += 1
                if got >= read_events:
                    break
            await events.aclose()

        if retried:
            try:
                await client()
            except BaseException:  # noqa: BLE001
                pass
        task = asyncio.create_task(client())
        if cancel_after is not None:
            for _ in range(cancel_after):
                await asyncio.sleep(0)
            task.cancel()
        try:
            await task
        except BaseException:  # noqa: BLE001 - any outcome; slots are what we check
            pass
        await settle(svc)
        stats = gk.ctl.stats
        assert gk.running == 0, (plans, stream, stats)
        assert stats.running == 0
        assert stats.admitted == stats.finished, stats
        assert not svc._running_ids  # no request_id left claimed

    asyncio.run(main())


def test_a_prompt_id_past_int32_is_a_client_error_and_leaks_nothing():
    async def main() -> None:
        svc, gk, registry, _ = build([("ok", 0)], 1)
        with pytest.raises(ValidationError):  # the request schema refuses it (HTTP 422)
            RolloutRequest(input_ids=[2147483648], n=3)
        req = RolloutRequest(input_ids=[1], n=3)
        req.input_ids = [2147483648]  # and should one get past the schema, nothing leaks
        for _ in range(5):
            try:
                await svc.run_with_text(req)
            except InvalidArgument as exc:
                assert "2**31" in exc.message
            else:
                raise AssertionError("accepted a token id past int32")
        assert gk.running == 0 and gk.ctl.stats.failed == 15
        # a drain (SIGTERM) has nothing to wait for
        assert await svc.wait_idle(0.1)

    asyncio.run(main())
