"""Where agent sessions live: the session store.

Every replica of the gateway reads and writes a session through it, so any replica can
serve a session's next turn and a replica's death loses none. A session is a small
:class:`Head` plus its current branch as records (:mod:`rollout_gateway.sessions.records`);
a turn runs under the session's *lock*, a lease a replica takes with :meth:`claim` (or
:meth:`create`), renews while the call runs and gives up with :meth:`commit` (appending
the turn's records) or :meth:`release`. A lock whose holder died expires after its lease.

Also here: trajectories held for a reward, the markers of ended sessions and published
session trajectories (clear 409s on every replica), and the lease of the idle sweeper.

Two implementations with the same semantics: :class:`MemorySessionStore` (the embedded
store: one process, records kept as objects) and
``rollout_gateway.sessions.redis_store.RedisSessionStore`` (the Redis store: shared
by the replicas).
"""

from __future__ import annotations

import abc
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import numpy as np
import orjson

from rollout_gateway.core.trajectory import Trajectory
from rollout_gateway.sessions.records import Record, TurnRecord

#: a session's key: (tenant, session id)
Key = tuple[str, str]

#: ended session ids / published trajectory ids an embedded store remembers
REMEMBER = 100_000


@dataclass
class Head:
    """A session's small facts, stored next to its records."""

    tenant: str
    session_id: str
    group_id: str | None = None
    branches: int = 0  # branches started; the current one (if any) is branches - 1
    n: int = 0  # records of the current branch
    last_active: float = field(default_factory=time.time)  # wall clock (shared)

    def dumps(self) -> bytes:
        return orjson.dumps([self.tenant, self.session_id, self.group_id, self.branches,
                             self.n, self.last_active])

    @classmethod
    def loads(cls, raw: bytes | str) -> Head:
        t, s, g, b, n, a = orjson.loads(raw)
        return cls(t, s, g, int(b), int(n), float(a))


@dataclass
class Claim:
    """What :meth:`SessionStore.claim` found."""

    status: str  # "ok" (locked for the caller) | "absent" | "ended" | "busy"
    head: Head | None = None
    records: list[Record] = field(default_factory=list)  # the current branch's, from since
    since: int = 0
    ended_by: str = ""
    retry_after: float = 0.0  # busy: seconds left on the holder's lease
    #: finished branches committed for publishing but not yet cleared (a replica died
    #: between its commit and its publish): the claimer publishes them
    outbox: list[Trajectory] = field(default_factory=list)


class SessionStore(abc.ABC):
    """Sessions, their locks, held trajectories and markers. All methods are coroutines."""

    #: whether other replicas share it (then a replica's shutdown leaves sessions open)
    shared: bool = False

    @abc.abstractmethod
    async def claim(self, key: Key, owner: str, lease_s: float,
                    have: tuple[int, int] | None) -> Claim:
        """Lock session ``key`` for ``owner`` and read it: the records of its current
        branch from ``have``'s count when ``have`` = (branches, n) is still that branch
        (a replica's cached copy), else all of them."""

    @abc.abstractmethod
    async def create(self, head: Head, owner: str, lease_s: float, max_total: int,
                     max_per_tenant: int) -> str:
        """Register a new session, locked for ``owner``: "ok", or "busy" (it exists),
        "ended" (an ended id), "full" / "tenant_full" (past the bounds)."""

    @abc.abstractmethod
    async def commit(self, key: Key, owner: str, head: Head, records: list[Record],
                     reset: bool, outbox: Trajectory | None = None) -> bool:
        """Append ``records`` (after dropping the old branch's when ``reset``), store
        ``head``, put ``outbox`` (the finished branch a new branch replaces) in the
        session's outbox and unlock, all at once. False (nothing written) when ``owner``
        no longer holds the lock."""

    @abc.abstractmethod
    async def clear_outbox(self, key: Key, trajectory_id: str) -> None:
        """The outbox's ``trajectory_id`` is in the trajectory store."""

    @abc.abstractmethod
    async def release(self, key: Key, owner: str) -> None:
        """Unlock (a call that recorded nothing)."""

    @abc.abstractmethod
    async def renew(self, locks: dict[Key, str], lease_s: float) -> None:
        """Extend the leases of the locks held (key -> owner)."""

    @abc.abstractmethod
    async def finish(self, key: Key, owner: str, how: str, remember_s: float) -> bool:
        """The session ended ``how``: forget it, remember that it ended. False when
        ``owner`` no longer holds its lock."""

    @abc.abstractmethod
    async def drop(self, key: Key, owner: str) -> None:
        """Forget a session whose first call failed (as if never opened)."""

    @abc.abstractmethod
    async def idle(self, before: float, limit: int) -> list[Key]:
        """Open sessions last active before ``before`` (wall clock), oldest first."""

    async def prune(self, key: Key, before: float) -> None:
        """Drop ``key`` from the idle index if it is there and idle since before ``before``
        but the session is gone (a create that died half-way). Embedded store: nothing
        to do (no separate index)."""

    @abc.abstractmethod
    async def open_counts(self) -> dict[str, int]:
        """Open sessions per tenant (every replica's)."""

    @abc.abstractmethod
    async def tenants_of(self, session_id: str) -> list[str]:
        """Tenants with an open or remembered-ended session of this id."""

    @abc.abstractmethod
    async def ended_by(self, key: Key) -> str | None:
        """How the session ended, while remembered."""

    # ---- held for a reward ----

    @abc.abstractmethod
    async def hold(self, traj: Trajectory, deadline: float) -> None:
        """Keep ``traj`` until a reward comes or ``deadline`` (wall clock) passes."""

    @abc.abstractmethod
    async def held(self, trajectory_id: str) -> Trajectory | None: ...

    @abc.abstractmethod
    async def unhold(self, trajectory_id: str) -> None: ...

    @abc.abstractmethod
    async def due(self, now: float, limit: int) -> list[str]:
        """Held trajectory ids whose deadline passed."""

    @abc.abstractmethod
    async def held_count(self) -> int: ...

    # ---- published session trajectories (tid -> tenant) ----

    @abc.abstractmethod
    async def mark_published(self, trajectory_id: str, tenant: str, remember_s: float) -> None:
        ...

    @abc.abstractmethod
    async def published_tenant(self, trajectory_id: str) -> str | None: ...

    # ---- request ids run now (rollouts: one run of a request_id across replicas) ----

    @abc.abstractmethod
    async def claim_request(self, rid: str, owner: str, ttl: float) -> bool:
        """Take the lease on request id ``rid`` for ``ttl`` seconds; False: another run
        holds it."""

    @abc.abstractmethod
    async def renew_request(self, rid: str, owner: str, ttl: float) -> bool: ...

    @abc.abstractmethod
    async def release_request(self, rid: str, owner: str) -> None: ...

    # ---- the idle sweeper ----

    @abc.abstractmethod
    async def sweep_lease(self, owner: str, ttl: float) -> bool:
        """Whether ``owner`` may sweep now (one replica sweeps at a time)."""

    async def close(self) -> None:
        """Release connections (the trajectory store owns them)."""


def _lean(rec: Record) -> Record:
    """A turn kept without its prompt (the branch holds the sequence once)."""
    if isinstance(rec, TurnRecord) and rec.turn.prompt_token_ids.shape[0]:
        return replace(rec, turn=replace(rec.turn, prompt_token_ids=np.zeros(0, np.int32)))
    return rec


@dataclass
class _Open:
    head: Head
    records: list[Record] = field(default_factory=list)
    outbox: dict[str, Trajectory] = field(default_factory=dict)
    owner: str = ""
    until: float = 0.0


class MemorySessionStore(SessionStore):
    """In this process only (the embedded store): one replica, nothing to share."""

    shared = False

    def __init__(self, clock=time.time) -> None:
        self.clock = clock
        self.sessions: dict[Key, _Open] = {}
        self.ended: OrderedDict[Key, str] = OrderedDict()
        self.held_: dict[str, tuple[Trajectory, float]] = {}
        self.published: OrderedDict[str, str] = OrderedDict()

    def _lock(self, o: _Open, owner: str, lease_s: float) -> None:
        o.owner, o.until = owner, self.clock() + lease_s

    async def claim(self, key, owner, lease_s, have):
        if key in self.ended:
            return Claim("ended", ended_by=self.ended[key])
        o = self.sessions.get(key)
        if o is None:
            return Claim("absent")
        now = self.clock()
        if o.until > now:
            return Claim("busy", retry_after=o.until - now)
        self._lock(o, owner, lease_s)
        since = have[1] if have is not None and have[0] == o.head.branches \
            and have[1] <= len(o.records) else 0
        return Claim("ok", replace(o.head), o.records[since:], since,
                     outbox=list(o.outbox.values()))

    async def create(self, head, owner, lease_s, max_total, max_per_tenant):
        key = (head.tenant, head.session_id)
        if key in self.ended:
            return "ended"
        if key in self.sessions:
            return "busy"
        if len(self.sessions) >= max_total:
            return "full"
        if sum(1 for k in self.sessions if k[0] == head.tenant) >= max_per_tenant:
            return "tenant_full"
        o = self.sessions[key] = _Open(replace(head))
        self._lock(o, owner, lease_s)
        return "ok"

    async def commit(self, key, owner, head, records, reset, outbox=None):
        o = self.sessions.get(key)
        if o is None or o.owner != owner:
            return False
        if outbox is not None:
            o.outbox[outbox.trajectory_id] = outbox
        if reset:
            o.records = []
        o.records.extend(_lean(r) for r in records)
        o.head = replace(head)
        o.owner, o.until = "", 0.0
        return True

    async def clear_outbox(self, key, trajectory_id):
        o = self.sessions.get(key)
        if o is not None:
            o.outbox.pop(trajectory_id, None)

    async def release(self, key, owner):
        o = self.sessions.get(key)
        if o is not None and o.owner == owner:
            o.owner, o.until = "", 0.0

    async def renew(self, locks, lease_s):
        for key, owner in locks.items():
            o = self.sessions.get(key)
            if o is not None and o.owner == owner:
                o.until = self.clock() + lease_s

    async def finish(self, key, owner, how, remember_s):
        o = self.sessions.get(key)
        if o is None or o.owner != owner:
            return False
        del self.sessions[key]
        self.ended[key] = how
        while len(self.ended) > REMEMBER:
            self.ended.popitem(last=False)
        return True

    async def drop(self, key, owner):
        o = self.sessions.get(key)
        if o is not None and o.owner == owner:
            del self.sessions[key]

    async def idle(self, before, limit):
        old = sorted((o.head.last_active, k) for k, o in self.sessions.items()
                     if o.head.last_active < before)
        return [k for _, k in old[:limit]]

    async def open_counts(self):
        out: dict[str, int] = {}
        for t, _ in self.sessions:
            out[t] = out.get(t, 0) + 1
        return out

    async def tenants_of(self, session_id):
        return [k[0] for k in self.sessions if k[1] == session_id] or \
            [k[0] for k in self.ended if k[1] == session_id]

    async def ended_by(self, key):
        return self.ended.get(key)

    async def hold(self, traj, deadline):
        self.held_[traj.trajectory_id] = (traj, deadline)

    async def held(self, trajectory_id):
        got = self.held_.get(trajectory_id)
        return got[0] if got else None

    async def unhold(self, trajectory_id):
        self.held_.pop(trajectory_id, None)

    async def due(self, now, limit):
        return [t for t, (_, d) in self.held_.items() if d <= now][:limit]

    async def held_count(self):
        return len(self.held_)

    async def mark_published(self, trajectory_id, tenant, remember_s):
        self.published[trajectory_id] = tenant
        while len(self.published) > REMEMBER:
            self.published.popitem(last=False)

    async def published_tenant(self, trajectory_id):
        return self.published.get(trajectory_id)

    async def sweep_lease(self, owner, ttl):
        return True

    # one process: the rollout service's own per-request events already serialize runs
    async def claim_request(self, rid, owner, ttl):
        return True

    async def renew_request(self, rid, owner, ttl):
        return True

    async def release_request(self, rid, owner):
        return None

