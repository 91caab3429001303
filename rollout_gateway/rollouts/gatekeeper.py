"""Admission control and the staleness policy, wired to the store and the registry.

The rules are pure (:mod:`rollout_gateway.core.admission`); this adapter feeds them the
live numbers (store backlog, learner version) and applies verdicts to trajectories.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket

import numpy as np

from rollout_gateway.aio import cancel_and_wait
from rollout_gateway.core.admission import AdmissionConfig, AdmissionController, Judgement, Verdict
from rollout_gateway.core.trajectory import Trajectory
from rollout_gateway.errors import GatewayError, ResourceExhausted
from rollout_gateway.registry.base import VersionRegistry
from rollout_gateway.store.base import TrajectoryStore

log = logging.getLogger(__name__)

#: backoff of a recycled sample waiting for a slot: first wait, cap (seconds)
RECYCLE_BACKOFF = (0.05, 1.0)


def default_replica_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class Gatekeeper:
    """Every admitted sample is released exactly once: by :meth:`judge` or
    :meth:`release_failed`.

    With a shared registry the staleness bound spans replicas: each admission counts the
    other replicas' in-flight samples (``registry.running_elsewhere``), and this replica
    reports its own (``registry.report_running``) right after admitting, in the background
    after releases, and every ``running_report_ttl_s / 3`` (:meth:`start`). Reports cost a
    registry call per admission or release burst, never per token."""

    def __init__(self, config: AdmissionConfig, store: TrajectoryStore,
                 registry: VersionRegistry, replica_id: str | None = None) -> None:
        self.ctl = AdmissionController(config)
        self.store = store
        self.registry = registry
        self.replica_id = replica_id or config.replica_id or default_replica_id()
        #: finished trajectories by max lag (learner version - oldest token version) at finish;
        #: lags above 8 are counted under 8
        self.lag_counts: dict[int, int] = {}
        self._reported: int | None = None  # last count the registry holds for us
        self._changed: asyncio.Event | None = None
        self._reporter: asyncio.Task[None] | None = None

    @property
    def running(self) -> int:
        return self.ctl.running

    # ---- reporting this replica's in-flight samples ----

    def start(self) -> None:
        """Start the background reporter (call from the event loop)."""
        if self._reporter is None:
            self._changed = asyncio.Event()
            self._reporter = asyncio.get_running_loop().create_task(self._report_loop())

    async def stop(self) -> None:
        """Stop reporting and withdraw this replica's count (called at shutdown, after
        the drain: whatever still runs here ends with the process)."""
        task, self._reporter = self._reporter, None
        await cancel_and_wait(task)
        with contextlib.suppress(GatewayError):
            await self.registry.report_running(self.replica_id, 0,
                                               ttl=self.ctl.config.running_report_ttl_s)

    async def _report(self) -> None:
        n = self.ctl.running
        await self.registry.report_running(self.replica_id, n,
                                           ttl=self.ctl.config.running_report_ttl_s)
        self._reported = n

    async def _report_loop(self) -> None:
        assert self._changed is not None
        period = self.ctl.config.running_report_ttl_s / 3
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), period)
            self._changed.clear()
            try:
                await self._report()
            except GatewayError as exc:  # keep reporting after a registry blip
                log.warning("registry: reporting in-flight samples failed: %s", exc.message)
                await asyncio.sleep(min(1.0, period))

    def _released(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def _live(self) -> tuple[int, int, int]:
        """(learner version, store backlog, other replicas' in-flight samples)."""
        lv, backlog, others = await asyncio.gather(
            self.registry.learner_version(), self.store.backlog(),
            self.registry.running_elsewhere(self.replica_id))
        return lv, backlog, others

    async def _admitted(self) -> None:
        # visible to the other replicas before the samples start
        try:
            await self._report()
        except GatewayError as exc:
            log.warning("registry: reporting in-flight samples failed: %s", exc.message)
            self._released()  # the reporter retries

    # ---- admission ----

    async def admit(self, n: int) -> None:
        """All n samples or ResourceExhausted (429)."""
        lv, backlog, others = await self._live()
        self.ctl.admit(n, learner_version=lv, backlog=backlog, others_running=others)
        try:
            await self._admitted()
        except BaseException:  # cancelled while reporting: the caller never got the slots
            self.release_failed(n)
            raise

    async def readmit_recycled(self, trajectory_id: str) -> None:
        """A slot for one recycled sample: waits (bounded backoff, up to
        ``recycle_wait_s``) while the bound is full; new rollouts leave waiting recycled
        samples room meanwhile. Past the wait: ResourceExhausted (429) naming the sample,
        counted under ``recycle_refused``; never a silent loss."""
        cfg = self.ctl.config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.recycle_wait_s
        delay, cap = RECYCLE_BACKOFF
        stats = self.ctl.stats
        stats.recycle_waiting += 1
        try:
            while True:
                lv, backlog, others = await self._live()
                if self.ctl.try_admit(1, learner_version=lv, backlog=backlog,
                                      others_running=others):
                    break
                left = deadline - loop.time()
                if left <= 0:
                    stats.recycle_refused += 1
                    c = self.ctl.capacity(learner_version=lv, backlog=backlog,
                                          others_running=others)
                    raise ResourceExhausted(
                        f"admission control: recycled sample {trajectory_id} found no slot "
                        f"within {cfg.recycle_wait_s:g} s to be regenerated (unconsumed + in "
                        f"flight (all replicas) {c.staleness_used} of {c.staleness_limit}, "
                        f"in flight here {c.running} of {c.concurrency_limit}); "
                        "retry its prompt after the learner consumes more",
                        details={"recycled": True, "trajectory_id": trajectory_id,
                                 "binding": c.binding, "staleness_used": c.staleness_used,
                                 "staleness_limit": c.staleness_limit})
                await asyncio.sleep(min(delay, left))
                delay = min(delay * 2, cap)
        finally:
            stats.recycle_waiting -= 1
        try:
            await self._admitted()
        except BaseException:
            self.release_failed(1)
            raise

    async def judge(self, traj: Trajectory, recycles: int) -> Judgement:
        """Release one finished sample; record the verdict on the trajectory's metadata.
        When the learner version cannot be read, the sample is released as failed and the
        error raised (the caller sees it; the slot does not leak)."""
        try:
            lv = await self.registry.learner_version()
        except BaseException:
            self.release_failed(1)  # its slot is released whatever happens
            raise
        j = self.ctl.judge(traj.tokens.policy_version, learner_version=lv, recycles=recycles)
        self._released()
        lag = min(max(j.max_lag, 0), 8)
        self.lag_counts[lag] = self.lag_counts.get(lag, 0) + 1
        if j.verdict is not Verdict.ACCEPT:
            traj.metadata["stale_verdict"] = j.verdict.value
            traj.metadata["stale_max_lag"] = str(j.max_lag)
        if j.verdict is Verdict.MASK and j.mask is not None:
            # token indices to leave out of the loss, as ranges "a-b,c-d" (end exclusive)
            bad = np.flatnonzero(~j.mask)
            traj.metadata["stale_masked_tokens"] = _ranges(bad)
        return j

    def release_failed(self, n: int = 1) -> None:
        self.ctl.release_failed(n)
        self._released()

    def counters(self) -> dict[str, int]:
        return self.ctl.stats.to_dict()


def _ranges(idx: np.ndarray) -> str:
    if idx.size == 0:
        return ""
    breaks = np.flatnonzero(np.diff(idx) != 1)
    starts = np.concatenate([[idx[0]], idx[breaks + 1]])
    ends = np.concatenate([idx[breaks], [idx[-1]]]) + 1
    return ",".join(f"{a}-{b}" for a, b in zip(starts.tolist(), ends.tolist()))
