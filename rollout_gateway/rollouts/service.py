"""A rollout: n samples of one prompt, run concurrently, stamped, published."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from rollout_gateway.core.admission import Verdict
from rollout_gateway.core.trajectory import Trajectory, Transition
from rollout_gateway.engines.pool import EnginePool
from rollout_gateway.errors import GatewayError, InvalidArgument
from rollout_gateway.rollouts.gatekeeper import Gatekeeper
from rollout_gateway.rollouts.models import RolloutRequest
from rollout_gateway.rollouts.sample import SampleRunner
from rollout_gateway.settings import GatewaySettings
from rollout_gateway.store.base import TrajectoryStore

log = logging.getLogger(__name__)

REPREFILLS = frozenset({Transition.RETRACT, Transition.ABORT_RESUME, Transition.FAILOVER})


class RolloutService:
    """Validates, admits, runs, judges (staleness policy) and publishes rollouts."""

    def __init__(self, pool: EnginePool, store: TrajectoryStore, settings: GatewaySettings,
                 gatekeeper: Gatekeeper, oldlogits: Any = None) -> None:
        self.pool = pool
        self.store = store
        self.settings = settings
        self.gatekeeper = gatekeeper
        self.oldlogits = oldlogits  # oldlogits.OldLogitService: fills old_logprobs, or None
        self.runner = SampleRunner(pool, settings, gatekeeper.registry, oldlogits)
        self.counters = {"rollouts": 0, "samples": 0, "tokens": 0, "published": 0,
                         "duplicates": 0, "failed_samples": 0, "failovers": 0,
                         "abort_resumes": 0, "tokens_reprefilled": 0, "publish_failed": 0}

    @property
    def inflight_samples(self) -> int:
        return self.gatekeeper.running

    def validate(self, req: RolloutRequest) -> None:
        s = self.settings
        if req.n > s.max_samples_per_request:
            raise InvalidArgument(f"n={req.n} exceeds the limit of {s.max_samples_per_request} "
                                  "samples per request", details={"limit": s.max_samples_per_request})
        if req.sampling_params.max_new_tokens > s.max_new_tokens_limit:
            raise InvalidArgument(f"max_new_tokens={req.sampling_params.max_new_tokens} exceeds "
                                  f"the limit of {s.max_new_tokens_limit}")
        if req.input_ids is not None and len(req.input_ids) > s.max_prompt_tokens:
            raise InvalidArgument(f"prompt has {len(req.input_ids)} tokens; the limit is "
                                  f"{s.max_prompt_tokens}")

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no sample is in flight (graceful shutdown)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self.gatekeeper.running > 0:
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def _ids(self, req: RolloutRequest) -> tuple[str, list[str], str | None]:
        group = req.group_id or uuid.uuid4().hex
        base = req.request_id or uuid.uuid4().hex
        ids = [f"{base}:{i}" for i in range(req.n)]
        sticky = req.session_id or req.group_id
        return group, ids, sticky

    async def _publish(self, traj: Trajectory, req: RolloutRequest) -> None:
        """Publish; a store failure does not throw the generated tokens away: the caller
        still gets the trajectory, marked ``metadata["publish_error"]``, and it is counted."""
        if not req.publish:
            return
        try:
            stored = await self.store.publish(traj)
        except GatewayError as exc:
            self.counters["publish_failed"] += 1
            traj.metadata["publish_error"] = f"{exc.code.value}: {exc.message}"[:300]
            log.error("publishing %s failed: %s", traj.trajectory_id, exc.message)
            return
        self.counters["published" if stored else "duplicates"] += 1

    def _count(self, traj: Trajectory) -> None:
        self.counters["samples"] += 1
        self.counters["tokens"] += traj.num_tokens
        self.counters["failovers"] += sum(1 for s in traj.segments if s.began == "failover")
        self.counters["abort_resumes"] += sum(1 for s in traj.segments if s.began == "abort_resume")
        # a retract / resubmission re-prefills prompt + output so far (exact, from segments)
        p = int(traj.prompt_token_ids.shape[0])
        self.counters["tokens_reprefilled"] += sum(
            p + s.start for s in traj.segments if s.began in REPREFILLS)

    async def one_with_text(self, req: RolloutRequest, tid: str, group: str, i: int,
                            sticky: str | None, prompt: np.ndarray | None,
                            on_chunk=None) -> tuple[Trajectory, str]:
        """One admitted sample: run, judge against the staleness bound, publish.

        Releases its admission slot exactly once. A recycled sample is generated again
        (re-admitted, waiting up to ``admission.recycle_wait_s`` for a slot) up to
        ``admission.max_recycles`` times; with no slot in time its request fails with 429
        (counted as ``recycle_refused``)."""
        recycles = 0
        while True:
            try:
                traj, text = await self.runner.run(req, tid, group, i, sticky_key=sticky,
                                                   prompt_ids=prompt, on_chunk=on_chunk)
            except BaseException:
                self.gatekeeper.release_failed(1)
                self.counters["failed_samples"] += 1
                raise
            self._count(traj)
            if self.oldlogits is not None:  # exact old logits before delivery
                await self.oldlogits.fill(traj, req.sampling_params.temperature)
            try:
                verdict = (await self.gatekeeper.judge(traj, recycles)).verdict
            except BaseException:
                self.counters["failed_samples"] += 1
                raise
            if verdict is Verdict.RECYCLE:
                recycles += 1
                try:  # waits for a slot (bounded); never drops the prompt silently
                    await self.gatekeeper.readmit_recycled(tid)
                except BaseException:
                    self.counters["failed_samples"] += 1
                    raise
                continue
            if verdict is not Verdict.DROP:
                await self._publish(traj, req)
            return traj, text

    async def run(self, req: RolloutRequest) -> list[Trajectory]:
        """Run every sample; returns trajectories in sample order. Finished samples are
        published even when a sibling fails (then the first error is raised)."""
        return [t for t, _ in await self.run_with_text(req)]

    async def run_with_text(self, req: RolloutRequest) -> list[tuple[Trajectory, str]]:
        self.validate(req)
        await self.gatekeeper.admit(req.n)
        self.counters["rollouts"] += 1
        group, ids, sticky = self._ids(req)
        prompt = np.asarray(req.input_ids, np.int32) if req.input_ids is not None else None
        results = await asyncio.gather(
            *(self.one_with_text(req, tid, group, i, sticky, prompt) for i, tid in enumerate(ids)),
            return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            first = errors[0]
            if isinstance(first, GatewayError):
                first.details.setdefault("failed_samples", len(errors))
                first.details.setdefault("finished_ids", [r[0].trajectory_id for r in results
                                                          if isinstance(r, tuple)])
            raise first
        return list(results)  # type: ignore[arg-type]

    async def open_stream(self, req: RolloutRequest) -> AsyncIterator[dict[str, Any]]:
        """Validate and admit now (errors raise here); then stream events:
        {"type": "chunk", ...} per finished engine request (stamped tokens),
        {"type": "trajectory", ...} per finished sample, {"type": "error"} per failed one."""
        self.validate(req)
        await self.gatekeeper.admit(req.n)
        self.counters["rollouts"] += 1
        return self._stream(req)

    async def _stream(self, req: RolloutRequest) -> AsyncIterator[dict[str, Any]]:
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        group, ids, sticky = self._ids(req)
        prompt = np.asarray(req.input_ids, np.int32) if req.input_ids is not None else None

        async def one(i: int, tid: str) -> None:
            async def on_chunk(chunk: dict[str, Any]) -> None:
                await queue.put({"type": "chunk", "sample_index": i, "trajectory_id": tid,
                                 **chunk})
            try:
                traj, text = await self.one_with_text(req, tid, group, i, sticky, prompt,
                                                      on_chunk=on_chunk)
                # objects, not JSON: each HTTP route renders them its own way
                await queue.put({"type": "trajectory", "sample_index": i, "trajectory": traj,
                                 "text": text})
            except GatewayError as exc:
                await queue.put({"type": "error", "sample_index": i, "error": exc.to_dict()})

        tasks = [asyncio.create_task(one(i, tid)) for i, tid in enumerate(ids)]

        async def closer() -> None:
            await asyncio.gather(*tasks, return_exceptions=True)
            await queue.put(None)

        closing = asyncio.create_task(closer())
        # if the client goes away, the sample tasks still finish, judge and publish
        while (ev := await queue.get()) is not None:
            yield ev
        await closing
