"""A rollout: n samples of one prompt, run concurrently, stamped, published."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from rollout_gateway.core.trajectory import Trajectory
from rollout_gateway.engines.pool import EnginePool
from rollout_gateway.errors import GatewayError, InvalidArgument, ResourceExhausted
from rollout_gateway.rollouts.models import RolloutRequest
from rollout_gateway.rollouts.sample import Piece, SampleRunner, SampleState
from rollout_gateway.settings import GatewaySettings
from rollout_gateway.store.base import TrajectoryStore

log = logging.getLogger(__name__)


class RolloutService:
    """Validates, admits, runs and publishes rollouts."""

    def __init__(self, pool: EnginePool, store: TrajectoryStore | None, settings: GatewaySettings,
                 gatekeeper: Any = None) -> None:
        self.pool = pool
        self.store = store
        self.settings = settings
        self.gatekeeper = gatekeeper  # optional: .admit(n) / .release(n) / .on_finished(traj)
        self.runner = SampleRunner(pool, settings)
        self.inflight_samples = 0
        self.counters = {"rollouts": 0, "samples": 0, "tokens": 0, "published": 0,
                         "duplicates": 0, "failed_samples": 0, "failovers": 0,
                         "abort_resumes": 0}
        self._idle = asyncio.Event()
        self._idle.set()

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

    async def _admit(self, n: int) -> None:
        if self.inflight_samples + n > self.settings.max_inflight_samples:
            raise ResourceExhausted(f"{self.inflight_samples} samples in flight; admitting {n} more "
                                    f"would exceed {self.settings.max_inflight_samples}")
        if self.gatekeeper is not None:
            await self.gatekeeper.admit(n, self.inflight_samples)
        self.inflight_samples += n
        self._idle.clear()

    def _release(self, n: int) -> None:
        self.inflight_samples -= n
        if self.inflight_samples == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def _ids(self, req: RolloutRequest) -> tuple[str, list[str], str | None]:
        group = req.group_id or uuid.uuid4().hex
        base = req.request_id or uuid.uuid4().hex
        ids = [f"{base}:{i}" for i in range(req.n)]
        sticky = req.session_id or req.group_id
        return group, ids, sticky

    async def _publish(self, traj: Trajectory, req: RolloutRequest) -> None:
        self.counters["samples"] += 1
        self.counters["tokens"] += traj.num_tokens
        self.counters["failovers"] += sum(1 for s in traj.segments if s.began == "failover")
        self.counters["abort_resumes"] += sum(1 for s in traj.segments if s.began == "abort_resume")
        if self.gatekeeper is not None:
            keep = await self.gatekeeper.on_finished(traj)
            if not keep:
                return
        if req.publish and self.store is not None:
            if await self.store.publish(traj):
                self.counters["published"] += 1
            else:
                self.counters["duplicates"] += 1

    async def _one(self, req: RolloutRequest, tid: str, group: str, i: int, sticky: str | None,
                   prompt: np.ndarray | None, on_piece=None, on_chunk=None) -> Trajectory:
        traj, _text = await self.one_with_text(req, tid, group, i, sticky, prompt, on_piece, on_chunk)
        return traj

    async def one_with_text(self, req: RolloutRequest, tid: str, group: str, i: int,
                            sticky: str | None, prompt: np.ndarray | None, on_piece=None,
                            on_chunk=None) -> tuple[Trajectory, str]:
        try:
            traj, text = await self.runner.run(req, tid, group, i, sticky_key=sticky, prompt_ids=prompt,
                                         on_piece=on_piece, on_chunk=on_chunk)
        except GatewayError:
            self.counters["failed_samples"] += 1
            raise
        await self._publish(traj, req)
        return traj, text

    async def run(self, req: RolloutRequest) -> list[Trajectory]:
        """Run every sample; returns trajectories in sample order. Finished samples are
        published even when a sibling fails (then the first error is raised)."""
        return [t for t, _ in await self.run_with_text(req)]

    async def run_with_text(self, req: RolloutRequest) -> list[tuple[Trajectory, str]]:
        self.validate(req)
        await self._admit(req.n)
        self.counters["rollouts"] += 1
        try:
            group, ids, sticky = self._ids(req)
            prompt = np.asarray(req.input_ids, np.int32) if req.input_ids is not None else None
            results = await asyncio.gather(
                *(self.one_with_text(req, tid, group, i, sticky, prompt)
                  for i, tid in enumerate(ids)),
                return_exceptions=True)
        finally:
            self._release(req.n)
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
        await self._admit(req.n)
        self.counters["rollouts"] += 1
        return self._stream(req)

    async def _stream(self, req: RolloutRequest) -> AsyncIterator[dict[str, Any]]:
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        group, ids, sticky = self._ids(req)
        prompt = np.asarray(req.input_ids, np.int32) if req.input_ids is not None else None
        from rollout_gateway.api.serialize import piece_event

        async def one(i: int, tid: str) -> None:
            async def on_piece(state: SampleState, piece: Piece) -> None:
                await queue.put(piece_event(i, tid, piece, state.generated - len(piece.cols)))
            try:
                traj, text = await self.one_with_text(req, tid, group, i, sticky, prompt,
                                                      on_piece=on_piece)
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
        try:
            while (ev := await queue.get()) is not None:
                yield ev
        finally:
            if not closing.done():
                # the client went away: let the samples finish and publish in the background
                closing.add_done_callback(lambda _t: self._release(req.n))
            else:
                self._release(req.n)
