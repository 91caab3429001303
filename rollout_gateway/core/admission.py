"""Admission control that bounds off-policyness, and the finish-time staleness policy.

Pure: no I/O. The gateway feeds in the learner version and the store backlog it read.

AReaL's StalenessManager admits a new rollout only while

    accepted + running < (max_staleness + learner_version + 1) * batch_size

where ``accepted`` counts every finished rollout since version 0 and the learner consumes
``batch_size`` of them per version. A sample admitted now is consumed at the latest
``max_staleness`` versions later. Since accepted = consumed + backlog and
consumed = learner_version * batch_size under that schedule, the same bound reads

    backlog + running < (max_staleness + 1) * batch_size

which is what we use by default: it needs no counter that survives restarts, is the same
on every replica (the backlog lives in the shared store), and does not over-admit when a
learner resumes at version 120 against a fresh store. Pass ``consumed`` (trajectories the
learner acknowledged since version 0) to get AReaL's exact form instead.

At finish time a trajectory older than the bound (learner_version - min policy_version >
max_staleness) follows ``StalePolicy``: drop it, keep it with its stale tokens masked, or
recycle its prompt. Every outcome is counted; nothing disappears silently.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from rollout_gateway.core.staleness import StalePolicy, is_stale, stale_mask, trajectory_staleness
from rollout_gateway.errors import InvalidArgument, ResourceExhausted


class AdmissionConfig(BaseModel):
    """Admission control and stale-trajectory policy (embedded in the gateway settings)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid", frozen=True)

    enabled: bool = True
    """Refuse new rollouts past the off-policyness bound (HTTP 429). Off: admit everything
    (the finish-time policy still applies)."""
    max_staleness: int = Field(2, ge=0, le=1_000_000)
    """Largest allowed lag, in versions, between the learner and the oldest token of a
    trajectory (AReaL's max_head_offpolicyness). 0 means strictly on-policy."""
    batch_size: int = Field(256, ge=1, le=10_000_000)
    """Trajectories the learner consumes per version step (samples, not prompts)."""
    max_concurrent: int = Field(4096, ge=1, le=10_000_000)
    """Most rollouts (samples) in flight at once on this gateway replica."""
    stale_policy: StalePolicy = StalePolicy.DROP
    """What happens to a trajectory that finishes past the bound: drop (counted), mask
    (keep, stale tokens masked out of the loss) or recycle (re-generate its prompt)."""
    max_recycles: int = Field(3, ge=0, le=100)
    """How often one prompt may be recycled; past this it is dropped (and counted)."""
    recycle_wait_s: float = Field(60.0, ge=0, le=3600)
    """How long a recycled prompt waits (bounded backoff inside its rollout) for an
    admission slot to free up before it is regenerated; past this its request fails with
    429 (the sample is counted under ``recycle_refused``), never silently lost."""
    replica_id: str | None = Field(None, min_length=1, max_length=200,
                                   pattern=r"^[A-Za-z0-9_.:@/-]+$")
    """This gateway replica's name in the shared registry's in-flight counts (replicas
    sharing a Redis registry must differ). Default: ``hostname:pid``."""
    running_report_ttl_s: float = Field(15.0, gt=0, le=3600)
    """Shared registry: how long this replica's reported in-flight count stands unless
    reported again (it is re-reported every third of this, and after admits/releases);
    a crashed replica stops counting against the bound after this."""


class Verdict(StrEnum):
    """The outcome of :meth:`AdmissionController.judge` for a finished trajectory."""

    ACCEPT = "accept"  # within the bound: publish as is
    MASK = "mask"  # past the bound: publish with ``mask`` applied
    DROP = "drop"  # past the bound: discard
    RECYCLE = "recycle"  # past the bound: discard the response, re-queue the prompt


@dataclass(frozen=True, slots=True)
class Judgement:
    verdict: Verdict
    max_lag: int  # learner_version - min policy_version (0 for an empty trajectory)
    mask: np.ndarray | None = None  # bool [T], True = usable token (only for MASK)


@dataclass(slots=True)
class AdmissionStats:
    """Counters (monotonic except ``running``) for /metrics and dashboards."""

    admitted: int = 0  # samples admitted
    refused: int = 0  # samples refused by admission control
    running: int = 0  # samples in flight now
    finished: int = 0  # samples released (any outcome)
    accepted: int = 0  # finished within the bound
    stale_masked: int = 0
    stale_dropped: int = 0
    stale_recycled: int = 0
    recycle_exhausted: int = 0  # would be recycled but hit max_recycles: dropped
    recycle_waiting: int = 0  # recycled samples waiting for an admission slot now
    recycle_refused: int = 0  # recycled, no slot within recycle_wait_s: request failed (429)
    failed: int = 0  # released without a trajectory (engine failure, client abort)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Capacity:
    """How many more samples may start, and which limit binds."""

    available: int  # may be negative when over the bound
    staleness_limit: int  # (max_staleness + 1) * batch_size (or AReaL's form)
    staleness_used: int  # backlog + running (or accepted + running)
    concurrency_limit: int
    running: int

    @property
    def binding(self) -> str:
        st = self.staleness_limit - self.staleness_used
        return "staleness" if st <= self.concurrency_limit - self.running else "concurrency"


def capacity(cfg: AdmissionConfig, *, learner_version: int, running: int, backlog: int,
             consumed: int | None = None, others_running: int = 0) -> Capacity:
    """Free sample slots under both limits (pure). See the module docstring.

    ``running`` is this replica's in-flight samples (bounded by max_concurrent);
    ``others_running`` the other replicas' (they count against the shared staleness
    bound, e.g. from ``VersionRegistry.running_elsewhere``)."""
    if learner_version < 0 or running < 0 or backlog < 0 or others_running < 0:
        raise InvalidArgument("learner_version, running, backlog and others_running "
                              "must be >= 0")
    if consumed is None:
        limit = (cfg.max_staleness + 1) * cfg.batch_size
        used = backlog + running + others_running
    else:
        limit = (cfg.max_staleness + learner_version + 1) * cfg.batch_size
        used = consumed + backlog + running + others_running
    st = limit - used
    cc = cfg.max_concurrent - running
    return Capacity(available=min(st, cc), staleness_limit=limit, staleness_used=used,
                    concurrency_limit=cfg.max_concurrent, running=running)


class AdmissionController:
    """Per-replica admission state: in-flight samples and outcome counters.

    Not thread-safe; call from the gateway's event loop. Each admitted sample must be
    released exactly once, by :meth:`judge` (it finished) or :meth:`release_failed`.
    """

    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config or AdmissionConfig()
        self.stats = AdmissionStats()

    @property
    def running(self) -> int:
        return self.stats.running

    def capacity(self, *, learner_version: int, backlog: int, consumed: int | None = None,
                 others_running: int = 0) -> Capacity:
        return capacity(self.config, learner_version=learner_version,
                        running=self.stats.running, backlog=backlog, consumed=consumed,
                        others_running=others_running)

    def admit(self, n: int, *, learner_version: int, backlog: int,
              consumed: int | None = None, others_running: int = 0) -> Capacity:
        """Admit ``n`` samples (all or none) or raise ResourceExhausted (HTTP 429).

        With several gateway replicas pass ``others_running`` (their in-flight samples),
        or each replica would admit up to the whole bound."""
        if n < 1:
            raise InvalidArgument(f"n must be at least 1, got {n}")
        cap = self.capacity(learner_version=learner_version, backlog=backlog,
                            consumed=consumed, others_running=others_running)
        # recycled samples waiting for a slot go first: new rollouts leave them room
        reserved = self.stats.recycle_waiting
        if self.config.enabled and n > cap.available - reserved:
            self.stats.refused += n
            raise ResourceExhausted(
                f"admission control: {n} sample(s) requested, {max(cap.available - reserved, 0)} "
                f"available ({cap.binding} bound: in flight {cap.running}, "
                f"unconsumed + in flight (all replicas) {cap.staleness_used} of "
                f"{cap.staleness_limit}"
                + (f"; {reserved} slot(s) reserved for recycled prompts" if reserved else "")
                + "); retry after the learner consumes more",
                details={"requested": n, "available": max(cap.available - reserved, 0),
                         "reserved_for_recycled": reserved,
                         "binding": cap.binding, "running": cap.running,
                         "staleness_used": cap.staleness_used,
                         "staleness_limit": cap.staleness_limit})
        self.stats.admitted += n
        self.stats.running += n
        return cap

    def try_admit(self, n: int, *, learner_version: int, backlog: int,
                  consumed: int | None = None, others_running: int = 0) -> bool:
        """Admit ``n`` samples if they fit now (True); otherwise change nothing, count
        nothing (False). For re-admitting recycled samples while they wait for a slot
        (they may use the slots :meth:`admit` keeps free for them)."""
        if n < 1:
            raise InvalidArgument(f"n must be at least 1, got {n}")
        cap = self.capacity(learner_version=learner_version, backlog=backlog,
                            consumed=consumed, others_running=others_running)
        if self.config.enabled and n > cap.available:
            return False
        self.stats.admitted += n
        self.stats.running += n
        return True

    def _release(self, n: int) -> None:
        if n < 0 or n > self.stats.running:
            raise InvalidArgument(f"releasing {n} samples but only {self.stats.running} run")
        self.stats.running -= n
        self.stats.finished += n

    def release_failed(self, n: int = 1) -> None:
        """Samples that ended without a trajectory (engine failure, client gone)."""
        self._release(n)
        self.stats.failed += n

    def judge(self, policy_version: np.ndarray, *, learner_version: int,
              recycles: int = 0) -> Judgement:
        """Release one finished sample and decide what happens to its trajectory.

        ``policy_version`` is the trajectory's per-token column; ``recycles`` how many
        times its prompt was already recycled.
        """
        self._release(1)
        cfg = self.config
        lag = trajectory_staleness(int(learner_version), policy_version).max_lag
        if not is_stale(lag, cfg.max_staleness):
            self.stats.accepted += 1
            return Judgement(Verdict.ACCEPT, lag)
        if cfg.stale_policy == StalePolicy.MASK:
            self.stats.stale_masked += 1
            return Judgement(Verdict.MASK, lag,
                             ~stale_mask(learner_version, policy_version, cfg.max_staleness))
        if cfg.stale_policy == StalePolicy.RECYCLE:
            if recycles < cfg.max_recycles:
                self.stats.stale_recycled += 1
                return Judgement(Verdict.RECYCLE, lag)
            self.stats.recycle_exhausted += 1
        self.stats.stale_dropped += 1
        return Judgement(Verdict.DROP, lag)
