"""The version registry: who runs which weights, and the history of every swap.

Holds the learner's current version (it never goes backwards), each engine's version, the
history of hot-swaps (mode, rolling, timestamps, pause windows, per-engine outcome, tokens
re-prefilled) and a swap-leadership lease so that one gateway replica at a time leads a
swap. Two implementations with one semantics: in-process (one gateway) and Redis
(several replicas agree). ``snapshot()`` is the body of ``GET /v1/versions``.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

from rollout_gateway.core.swap_mode import SwapMode
from rollout_gateway.core.wire_enum import WireEnum
from rollout_gateway.errors import Aborted, FailedPrecondition, GatewayError, InvalidArgument

log = logging.getLogger(__name__)

#: ``SwapRecord.source`` of a distributed broadcast begins so: ``distributed:group@host:port``
DISTRIBUTED_SOURCE = "distributed:"


class SwapStatus(WireEnum):
    """Where a swap stands."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"  # every target engine took the version
    PARTIAL = "partial"  # some did; the others kept their version or left rotation
    FAILED = "failed"  # none did


@dataclass(slots=True)
class EngineSwapOutcome:
    """What one engine did during a swap."""

    engine_id: str
    ok: bool = False
    version_before: int | None = None
    version_after: int | None = None  # what the engine reported after the update
    paused_at: float | None = None  # this engine's pause window (rolling swaps differ per engine)
    resumed_at: float | None = None
    tokens_reprefilled: int = 0
    error: str | None = None  # why it failed
    #: it failed but still runs version_before: it stays in rotation at that version
    kept_version: bool = False
    #: the engine swapped the weights but refused the cache flush (requests were resident):
    #: its label was repaired with /update_weight_version and the old KV counts as kept
    cache_kept: bool = False
    #: how the new weights were verified: "version and N sampled tensors" or "version only:
    #: <why>" (no manifest beside the checkpoint, the engine cannot read parameters back)
    verification: str = ""
    #: requests broken off during its pause because their sample was stale (``drop_stale``)
    stale_dropped: int = 0
    #: requests broken off before an in_place pause because their version policy does not
    #: admit the KV they would keep (re-prefilled under the new weights instead)
    kv_refused: int = 0


@dataclass(slots=True)
class SwapRecord:
    """One hot-swap to ``version``. Upserted by ``swap_id`` as it progresses."""

    version: int
    mode: SwapMode  # a stored record's strings (mode, status) are parsed on construction
    rolling: bool = False
    swap_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    source: str = ""  # where the weights came from: a path, or DISTRIBUTED_SOURCE + group
    leader: str = ""  # the replica that led it
    status: SwapStatus = SwapStatus.RUNNING
    started_at: float = field(default_factory=time.time)
    paused_at: float | None = None  # pool-wide pause window (non-rolling)
    resumed_at: float | None = None
    finished_at: float | None = None
    engines: dict[str, EngineSwapOutcome] = field(default_factory=dict)
    message: str = ""

    def __post_init__(self) -> None:
        self.mode = SwapMode.parse(self.mode)
        self.status = SwapStatus.parse(self.status)
        if self.version < 0:
            raise InvalidArgument(f"version must be >= 0, got {self.version}")

    @property
    def checkpoint(self) -> str | None:
        """The checkpoint directory this swap installed on at least one engine (what a
        late engine or the old-logit scorer can load again); None when it took nowhere,
        only announced, or came by a distributed broadcast."""
        took = self.status in (SwapStatus.SUCCEEDED, SwapStatus.PARTIAL)
        if took and self.source and not self.source.startswith(DISTRIBUTED_SOURCE):
            return self.source
        return None

    @property
    def tokens_reprefilled(self) -> int:
        return sum(e.tokens_reprefilled for e in self.engines.values())

    def pause_windows(self) -> list[tuple[str, float, float | None]]:
        """(engine_id or "*", paused_at, resumed_at) for every recorded pause."""
        out: list[tuple[str, float, float | None]] = []
        if self.paused_at is not None:
            out.append(("*", self.paused_at, self.resumed_at))
        for e in self.engines.values():
            if e.paused_at is not None:
                out.append((e.engine_id, e.paused_at, e.resumed_at))
        return out

    def results(self) -> dict[str, dict[str, Any]]:
        """Each engine's result in one word, with the version it serves now and why:
        ``verified`` (runs the new version), ``kept_version`` (the load failed, it serves
        its old version) or ``failed`` (out of rotation)."""
        return {k: {"result": "verified" if o.ok else "kept_version" if o.kept_version
                    else "failed",
                    "serving_version": o.version_after if o.ok or o.kept_version
                    else None,
                    "why": o.error, "verification": o.verification or None,
                    "stale_dropped": o.stale_dropped, "kv_refused": o.kv_refused}
                for k, o in self.engines.items()}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["engines"] = {k: asdict(v) for k, v in self.engines.items()}
        d["tokens_reprefilled"] = self.tokens_reprefilled
        d["pause_windows"] = [{"engine": e, "paused_at": a, "resumed_at": b}
                              for e, a, b in self.pause_windows()]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SwapRecord:
        d = dict(d)
        d.pop("tokens_reprefilled", None)
        d.pop("pause_windows", None)
        known = set(EngineSwapOutcome.__dataclass_fields__)
        engines = {k: EngineSwapOutcome(**{f: x for f, x in v.items() if f in known})
                   for k, v in (d.pop("engines", None) or {}).items()}
        return cls(**d, engines=engines)


@dataclass(frozen=True, slots=True)
class VersionEvent:
    """A change seen by ``watch()``: kind is "learner", "engine" or "engine_removed"."""

    kind: str
    version: int | None
    engine_id: str | None = None
    at: float = 0.0


@dataclass(slots=True)
class Lease:
    """A held swap-leadership lease. ``lost`` turns True if a renewal failed."""

    owner: str
    token: str
    ttl: float
    expires_at: float
    lost: bool = False

    def check(self) -> None:
        """Raise Aborted if the lease was lost (another replica may now lead)."""
        if self.lost:
            raise Aborted(f"swap lease of {self.owner!r} was lost; stop leading this swap")


def check_version(v: Any, what: str = "version") -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise InvalidArgument(f"{what} must be a non-negative integer, got {v!r}")
    return v


class Watch(abc.ABC):
    """Async context manager and iterator of VersionEvents; subscribed once entered."""

    async def __aenter__(self) -> Watch:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> VersionEvent:
        return await self.next()

    @abc.abstractmethod
    async def start(self) -> None:
        """Subscribe; events from now on are delivered."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Unsubscribe. Idempotent."""

    @abc.abstractmethod
    async def next(self, timeout: float | None = None) -> VersionEvent:
        """The next event; raises TimeoutError after ``timeout`` seconds."""


class VersionRegistry(abc.ABC):
    """Abstract registry. All methods are coroutines; backends raise StoreError on failure."""

    # ---- versions ----
    @abc.abstractmethod
    async def learner_version(self) -> int:
        """The learner's current version (0 until first set)."""

    @abc.abstractmethod
    async def set_learner_version(self, version: int) -> int:
        """Advance the learner's version; returns the previous one. Setting the current
        version again is a no-op; a lower one raises FailedPrecondition."""

    @abc.abstractmethod
    async def engine_versions(self) -> dict[str, int]:
        """Each registered engine's current weight version."""

    @abc.abstractmethod
    async def set_engine_version(self, engine_id: str, version: int) -> None:
        """Record the version an engine reports (verified after each update)."""

    @abc.abstractmethod
    async def remove_engine(self, engine_id: str) -> bool:
        """Forget an engine (deregistered). Returns False if it was unknown."""

    # ---- swap history ----
    @abc.abstractmethod
    async def record_swap(self, record: SwapRecord) -> None:
        """Insert or update (by swap_id) a swap record."""

    @abc.abstractmethod
    async def get_swap(self, swap_id: str) -> SwapRecord | None:
        """One swap record, or None."""

    @abc.abstractmethod
    async def swaps(self, limit: int = 20) -> list[SwapRecord]:
        """The most recent swaps, newest first."""

    # ---- leadership lease ----
    @abc.abstractmethod
    async def acquire_lease(self, owner: str, ttl: float) -> Lease:
        """Take the swap lease for ttl seconds or raise FailedPrecondition naming the holder."""

    @abc.abstractmethod
    async def renew_lease(self, lease: Lease) -> bool:
        """Extend a held lease by its ttl. False (and lease.lost) if it expired or moved."""

    @abc.abstractmethod
    async def release_lease(self, lease: Lease) -> bool:
        """Give the lease up if still held by this token. False if it was not."""

    @abc.abstractmethod
    async def lease_holder(self) -> str | None:
        """Owner of the current unexpired lease, if any."""

    # ---- in-flight work across replicas (admission control) ----
    @abc.abstractmethod
    async def report_running(self, replica: str, running: int, ttl: float = 15.0) -> None:
        """Publish how many samples this replica has in flight; the entry expires after
        ttl seconds unless reported again (a crashed replica stops counting)."""

    @abc.abstractmethod
    async def running_elsewhere(self, replica: str) -> int:
        """Sum of unexpired in-flight counts reported by every other replica."""

    # ---- change feed ----
    @abc.abstractmethod
    def watch(self) -> Watch:
        """A feed of version changes (from any replica) made after it is entered:
        ``async with registry.watch() as feed: async for ev in feed: ...``."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections. Idempotent."""

    # ---- shared logic ----
    @contextlib.asynccontextmanager
    async def swap_lease(self, owner: str, ttl: float = 30.0) -> AsyncIterator[Lease]:
        """Hold the swap lease for the block, renewing it every ttl/3 in the background.

        Raises FailedPrecondition if another owner holds it. If a renewal fails the lease
        is marked lost; call ``lease.check()`` between steps to stop leading.
        """
        if not owner:
            raise InvalidArgument("lease owner must be non-empty")
        if not 0 < ttl <= 3600:
            raise InvalidArgument(f"lease ttl must be in (0, 3600] seconds, got {ttl}")
        lease = await self.acquire_lease(owner, ttl)

        async def renew() -> None:
            while not lease.lost:
                await asyncio.sleep(ttl / 3)
                try:
                    if not await self.renew_lease(lease):
                        return
                except Exception:  # noqa: BLE001 - a backend blip: retry until expiry
                    if time.time() >= lease.expires_at:
                        lease.lost = True
                        return

        task = asyncio.create_task(renew())
        try:
            yield lease
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if not lease.lost:
                with contextlib.suppress(Exception):
                    await self.release_lease(lease)

    async def snapshot(self, recent: int = 10) -> dict[str, Any]:
        """The JSON body of ``GET /v1/versions``."""
        learner = await self.learner_version()
        engines = await self.engine_versions()
        lags = {e: learner - v for e, v in engines.items()}
        return {
            "learner_version": learner,
            "engines": {e: {"version": v, "lag": lags[e]} for e, v in sorted(engines.items())},
            "max_lag": max(lags.values(), default=0),
            "swap_leader": await self.lease_holder(),
            "recent_swaps": [s.to_dict() for s in await self.swaps(recent)],
        }


async def read_swaps(registry: VersionRegistry, limit: int, reader: str) -> list[SwapRecord]:
    """The ``limit`` most recent swaps, newest first; none (a warning naming ``reader``)
    when the registry cannot be read: what a reader learns from the history waits for its
    next read."""
    try:
        return await registry.swaps(limit)
    except GatewayError as exc:
        log.warning("%s: cannot read the swap history: %s", reader, exc.message)
        return []


def check_running(replica: str, running: int, ttl: float) -> None:
    if not replica:
        raise InvalidArgument("replica id must be non-empty")
    if isinstance(running, bool) or not isinstance(running, int) or running < 0:
        raise InvalidArgument(f"running must be a non-negative integer, got {running!r}")
    if not 0 < ttl <= 3600:
        raise InvalidArgument(f"ttl must be in (0, 3600] seconds, got {ttl}")


def refuse_backwards(current: int, new: int) -> None:
    if new < current:
        raise FailedPrecondition(
            f"learner version cannot go backwards: current is {current}, got {new}",
            details={"current_version": current, "requested_version": new})
