"""The trajectory store interface.

The gateway core only ever calls :meth:`TrajectoryStore.publish` and
:meth:`TrajectoryStore.backlog` (admission control). The learner-facing gRPC
service uses the rest. Implementations: Redis Streams (production) and an
embedded in-process store (one machine). Both have the same semantics:

* idempotent by trajectory_id: publishing an id twice stores it once;
* consumer groups (one per learner job), at-least-once delivery with leases
  that expire and are re-claimed by another consumer;
* nothing is evicted unacknowledged; depth is bounded by configuration and
  publish raises ResourceExhausted past the bound.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, Field

from rollout_gateway.core.staleness import StalePolicy, is_stale, lag
from rollout_gateway.core.trajectory import Trajectory
from rollout_gateway.errors import ResourceExhausted


@dataclass(slots=True)
class StoreStats:
    published: int  # distinct trajectories accepted since start (or ever, for Redis)
    duplicates: int  # publishes ignored because the id was already stored
    backlog: int  # stored but not yet acknowledged by every group (max over groups)
    max_backlog: int  # configured bound on backlog
    stale_dropped: int = 0  # deliveries dropped (acked unseen) by the staleness filter
    stale_masked: int = 0  # deliveries flagged masked by the staleness filter
    stale_recycled: int = 0  # deliveries whose prompt was queued for re-generation
    dead_lettered: int = 0  # entries nacked max_deliveries times (acked, kept for audit)
    redelivered: int = 0  # deliveries with delivery_count > 1 (lease expiry or nack)
    overflow_dropped: int = 0  # entries a full consumer group lost (max_backlog per group)

    @classmethod
    def of(cls, counters: Mapping[str, int], backlog: int, max_backlog: int) -> StoreStats:
        """From a store's counters by name (one not counted yet is 0)."""
        c = {k: counters.get(k, 0) for k in ("published", "duplicates", "stale_dropped",
                                              "stale_masked", "stale_recycled",
                                              "dead_lettered", "redelivered",
                                              "overflow_dropped")}
        return cls(backlog=backlog, max_backlog=max_backlog, **c)


class StoreConfig(BaseModel):
    """Semantics shared by every store implementation."""

    max_backlog: int = Field(100_000, ge=1, description="bound on each consumer group's "
                             "backlog: a publish that finds a group full drops that group's "
                             "oldest entry for it (it is acked unseen in that group and counted "
                             "overflow_dropped; other groups keep it), so one job's unread group "
                             "never stops the others. With no group at all, publish raises "
                             "ResourceExhausted once this many entries are stored")
    lease_seconds: float = Field(300.0, gt=0, le=86_400, description="a delivered, unacked "
                                 "entry is re-claimable by another consumer after this long")
    max_deliveries: int = Field(5, ge=1, le=1000, description="a nack of an entry already "
                                "delivered this many times dead-letters it instead of requeueing")
    retention_seconds: float = Field(3600.0, ge=0, description="acked entries (by every group) "
                                     "are kept this long for audit/replay, then trimmed")
    dedup_seconds: float = Field(86_400.0, gt=0, description="how long a trajectory_id is "
                                 "remembered for idempotent publish (at least retention)")


@dataclass(slots=True)
class StoredEntry:
    """One delivery of a stored trajectory: the serialized rollout.v1.Trajectory plus the
    few facts the store needs without decoding it."""

    entry_id: str  # the ack/nack handle
    trajectory_id: str
    data: bytes  # serialized rollout.v1.Trajectory, exactly as published
    num_tokens: int  # prompt + output tokens (the unit of token credit)
    min_version: int  # min policy_version over output tokens (-1 when empty)
    max_version: int
    delivery_count: int = 1
    masked: bool = False  # outside the staleness bound, delivered under StalePolicy.MASK
    #: output tokens per policy version, "v:count;v:count" (see version_tokens); "" when
    #: the entry predates the field (then its tokens count at min_version)
    version_tokens: str = ""
    #: bytes of the stored trajectory once ``data`` was dropped (a by-reference Pull
    #: stream sends only a reference); -1: ``data`` holds them
    nbytes: int = -1

    @property
    def size(self) -> int:
        """Bytes of the serialized trajectory (read or not)."""
        return self.nbytes if self.nbytes >= 0 else len(self.data)

    def tokens_by_version(self) -> dict[int, int]:
        """Output tokens per policy version (dashboards: lag of delivered tokens)."""
        return tokens_by_version(self.version_tokens, self.min_version, self.num_tokens)


@dataclass(slots=True)
class GroupStats:
    """One consumer group, for dashboards."""

    group: str
    backlog: int  # not acknowledged (pending + never delivered)
    pending: int  # delivered and not yet acknowledged
    redelivered: int  # deliveries to this group with delivery_count > 1, ever
    overflow_dropped: int = 0  # entries this group lost at its max_backlog, ever


@dataclass(slots=True)
class UnconsumedTokens:
    """Output tokens of stored entries some consumer group has not acknowledged."""

    tokens_by_version: dict[int, int]
    entries: int
    truncated: bool  # more entries than the scan limit: the oldest ``entries`` counted


def version_tokens(traj: Trajectory) -> str:
    """Output tokens per policy version of a trajectory, compact: "3:120;4:8"."""
    pv = traj.tokens.policy_version
    if not len(pv):
        return ""
    lo = int(pv.min())
    counts = np.bincount(pv - lo)
    return ";".join(f"{lo + i}:{c}" for i, c in enumerate(counts.tolist()) if c)


def parse_version_tokens(s: str) -> dict[int, int]:
    out: dict[int, int] = {}
    for part in s.split(";"):
        if part:
            v, _, c = part.partition(":")
            out[int(v)] = out.get(int(v), 0) + int(c)
    return out


def tokens_by_version(vt: str, min_version: int, num_tokens: int) -> dict[int, int]:
    """Output tokens per policy version of a stored entry: its ``vt`` (see version_tokens),
    or, for an entry that predates the field, all its tokens at ``min_version``."""
    if vt:
        return parse_version_tokens(vt)
    return {min_version: num_tokens} if min_version >= 0 else {}


def count_unconsumed(facts: Iterable[tuple[str, int, int]], limit: int) -> UnconsumedTokens:
    """The tokens per version of the first ``limit`` unconsumed entries, oldest first, each
    given as (vt, min_version, num_tokens); truncated when there were more."""
    out: dict[int, int] = {}
    n = 0
    for vt, lo, ntok in facts:
        if n >= limit:
            return UnconsumedTokens(out, n, True)
        n += 1
        for v, c in tokens_by_version(vt, lo, ntok).items():
            out[v] = out.get(v, 0) + c
    return UnconsumedTokens(out, n, False)


def backlog_full(max_backlog: int) -> ResourceExhausted:
    """What publish raises when ``max_backlog`` entries are stored and no consumer group
    exists (a group bounds itself: its oldest entry goes)."""
    return ResourceExhausted(f"trajectory store holds max_backlog={max_backlog} entries and "
                             "no consumer group exists; create one and pull")


def entry_facts(traj: Trajectory) -> tuple[int, int, int]:
    """(num_tokens, min_version, max_version) recorded next to the bytes."""
    return (int(traj.prompt_token_ids.shape[0]) + traj.num_tokens,
            traj.min_version, traj.max_version)


class TrajectoryStore(abc.ABC):
    """Abstract trajectory store. All methods are coroutines."""

    @abc.abstractmethod
    async def publish(self, trajectory: Trajectory) -> bool:
        """Store a finished trajectory. Returns False if the id was already stored
        (duplicate publish; nothing changes). A consumer group whose backlog is at
        ``max_backlog`` loses its oldest entry (counted ``overflow_dropped``, overall and for
        the group); with no group, raises ResourceExhausted when ``max_backlog`` entries are
        stored. Raises StoreError when the backend fails."""

    @abc.abstractmethod
    async def lookup(self, trajectory_ids: list[str]) -> dict[str, bytes | None]:
        """What was stored under these ids (idempotent retries): the serialized trajectory
        while it is retained, None when it was stored but has since been trimmed (consumed
        and past retention); ids never stored (or forgotten after dedup_seconds) are
        absent."""

    @abc.abstractmethod
    async def backlog(self) -> int:
        """Finished-but-unconsumed trajectories for admission control: the backlog of the
        most caught-up consumer group (every stored entry when there is no group), so a
        group nobody reads (a stopped job) never stalls generation for the others.
        :meth:`stats` reports the worst group's."""

    @abc.abstractmethod
    async def stats(self) -> StoreStats:
        """Counters for dashboards."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections. Idempotent."""

    @abc.abstractmethod
    async def group_stats(self) -> list[GroupStats]:
        """Backlog, pending and redeliveries of every consumer group (dashboards)."""

    @abc.abstractmethod
    async def unconsumed_tokens(self, limit: int = 10_000) -> UnconsumedTokens:
        """Output tokens per policy version of the entries some group has not acknowledged
        (every entry when there is no group), scanning at most ``limit`` entries."""

    # ---- learner side (used by the gRPC service) ----

    @abc.abstractmethod
    async def create_group(self, group: str, *, from_latest: bool = False) -> bool:
        """Create a consumer group (one per learner job). Returns False if it existed.
        A new group starts at the oldest retained entry unless from_latest."""

    @abc.abstractmethod
    async def has_group(self, group: str) -> bool:
        """Whether the consumer group exists."""

    @abc.abstractmethod
    async def read(self, group: str, consumer: str, count: int, *,
                   block_ms: int = 0, payload: bool = True) -> list[StoredEntry]:
        """Lease up to ``count`` entries to ``consumer``: first entries whose lease
        expired (or that were nacked), then new ones. Blocks up to block_ms when there
        is nothing. Raises NotFound for an unknown group. ``payload=False``: the caller
        sends only references, so the store may leave ``data`` empty (``nbytes`` set)."""

    def reference_key(self, entry_id: str | None = None) -> str | None:
        """Where learners can read stored trajectories themselves (by-reference Pull
        streams): the Redis stream key holding ``entry_id`` (``XRANGE key id id``, field
        ``d``, where ``id`` is the entry id without its ``<shard>/``, see
        ``rollout_proto.codec.stream_entry_id``); with no ``entry_id``, the key of the
        first shard. None when the store cannot serve references (embedded store)."""
        return None

    @abc.abstractmethod
    async def ack(self, group: str, entry_ids: list[str]) -> int:
        """Acknowledge; returns how many were pending (re-acks count 0)."""

    @abc.abstractmethod
    async def extend(self, group: str, consumer: str, entry_ids: list[str]) -> list[str]:
        """Renew the leases ``consumer`` holds on these entries for another
        ``lease_seconds`` from now (delivery counts unchanged). Returns the ids extended;
        entries acked, nacked or re-claimed by another consumer are not."""

    @abc.abstractmethod
    async def nack(self, group: str, entry_ids: list[str], *,
                   delivered: bool = True) -> tuple[int, int]:
        """Make entries available again now; an entry already delivered max_deliveries
        times is dead-lettered (acked, counted) instead. Returns (requeued, dead_lettered).
        ``delivered=False`` releases leased entries that never reached a learner: their
        delivery count is rolled back and they are never dead-lettered."""

    @abc.abstractmethod
    async def group_backlog(self, group: str) -> int:
        """Entries the group has not acknowledged (pending + not yet delivered)."""

    @abc.abstractmethod
    async def take_recycled(self, max_n: int) -> list[Trajectory]:
        """Pop up to max_n trajectories whose prompts the staleness filter recycled; the
        gateway re-generates their prompts (prompt_token_ids, group_id, metadata)."""

    @abc.abstractmethod
    async def _push_recycled(self, entries: list[StoredEntry]) -> None:
        """Queue recycled entries' bytes for take_recycled (an entry read without its
        payload: the store reads it now)."""

    @abc.abstractmethod
    async def _count(self, **counters: int) -> None:
        """Add to the named StoreStats counters."""

    async def pull(self, group: str, consumer: str, count: int, *, learner_version: int,
                   max_lag: int | None, policy: StalePolicy, block_ms: int = 0,
                   payload: bool = True) -> list[StoredEntry]:
        """read() (``payload`` passed on) plus the staleness filter. An entry is stale when
        its oldest token is (``core.staleness``: learner_version - min_version > max_lag;
        an empty entry never is). DROP: acked, counted, not returned;
        MASK: returned with masked=True, counted; RECYCLE: prompt queued for
        take_recycled, acked, counted. Returns at most ``count`` entries."""
        out: list[StoredEntry] = []
        first = True
        while len(out) < count:
            got = await self.read(group, consumer, count - len(out),
                                  block_ms=block_ms if first else 0, payload=payload)
            first = False
            if not got:
                break
            gone: list[StoredEntry] = []
            masked = 0
            for e in got:
                if e.min_version < 0 or not is_stale(lag(learner_version, e.min_version), max_lag):
                    out.append(e)
                elif policy == StalePolicy.MASK:
                    e.masked = True
                    masked += 1
                    out.append(e)
                else:
                    gone.append(e)
            redelivered = sum(1 for e in got if e.delivery_count > 1)
            if policy == StalePolicy.RECYCLE and gone:
                await self._push_recycled(gone)
            if gone:
                await self.ack(group, [e.entry_id for e in gone])
            counts = {"stale_masked": masked, "redelivered": redelivered,
                      f"redelivered:{group}": redelivered,
                      "stale_dropped": len(gone) if policy == StalePolicy.DROP else 0,
                      "stale_recycled": len(gone) if policy == StalePolicy.RECYCLE else 0}
            counts = {k: v for k, v in counts.items() if v}
            if counts:
                await self._count(**counts)
        return out


def check_name(kind: str, value: str) -> str:
    """Group and consumer names: 1-128 chars of [A-Za-z0-9_.:@-]."""
    import re

    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9_.:@-]{1,128}", value):
        from rollout_gateway.errors import InvalidArgument

        raise InvalidArgument(f"{kind} must be 1-128 characters of [A-Za-z0-9_.:@-], got {value!r}")
    return value


#: entry ids as stores write them: ASCII digits (memory store: "12"; Redis streams: "<ms>-<seq>";
#: a Redis store of several shards: "<shard>/<ms>-<seq>")
_ENTRY_ID = r"(?:[0-9]{1,3}/)?[0-9]{1,20}(?:-[0-9]{1,20})?"


def entry_numbers(entry_id: str, *, dashed: bool) -> tuple[int, ...]:
    """The numbers of an entry id, parsed strictly: ASCII digits only (``"²"`` or ``"١٢"``
    are InvalidArgument, never a crash nor another entry), ``<n>`` for the memory store,
    ``<ms>-<seq>`` (``dashed``) for Redis streams."""
    import re

    pattern = r"([0-9]{1,20})-([0-9]{1,20})" if dashed else r"([0-9]{1,20})"
    m = re.fullmatch(pattern, entry_id, flags=re.ASCII) if isinstance(entry_id, str) else None
    if m is None:
        from rollout_gateway.errors import InvalidArgument

        shown = entry_id[:40] if isinstance(entry_id, str) else type(entry_id).__name__
        raise InvalidArgument(f"malformed entry id {shown!r} (expected "
                              f"{'<ms>-<seq>' if dashed else 'a sequence number'} in ASCII "
                              "digits)")
    return tuple(int(g) for g in m.groups())


def is_entry_id(entry_id: object) -> bool:
    """The shape every store's ids share (checked at the transport, before the store)."""
    import re

    return isinstance(entry_id, str) and re.fullmatch(_ENTRY_ID, entry_id, flags=re.ASCII) is not None
