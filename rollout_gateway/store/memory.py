"""The embedded trajectory store: one process, no server, same semantics as Redis.

In memory by default. With ``journal_path`` every state change (publish, group cursor,
leases' delivery counts, acks, counters, recycled prompts) is written to a SQLite file
in WAL mode before the call returns, so a process that is killed and restarted reloads
every pending and unconsumed entry. Leases do not survive a restart: entries that were
leased become available again at once (delivery count kept, so they show as redeliveries).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from dataclasses import dataclass, field

from rollout_gateway.core import trajectory_codec
from rollout_gateway.core.trajectory import Trajectory
from rollout_gateway.errors import InvalidArgument, NotFound, StoreError
from rollout_gateway.store.base import (
    GroupStats,
    StoreConfig,
    StoredEntry,
    StoreStats,
    TrajectoryStore,
    UnconsumedTokens,
    backlog_full,
    check_name,
    count_unconsumed,
    entry_facts,
    version_tokens,
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (seq INTEGER PRIMARY KEY, tid TEXT UNIQUE, data BLOB,
    ntok INTEGER, vmin INTEGER, vmax INTEGER, added REAL);
CREATE TABLE IF NOT EXISTS dedup (tid TEXT PRIMARY KEY, expires REAL);
CREATE TABLE IF NOT EXISTS groups (name TEXT PRIMARY KEY, cursor INTEGER);
CREATE TABLE IF NOT EXISTS pending (grp TEXT, seq INTEGER, deliveries INTEGER,
    PRIMARY KEY (grp, seq));
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER);
CREATE TABLE IF NOT EXISTS recycled (id INTEGER PRIMARY KEY AUTOINCREMENT, data BLOB);
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v INTEGER);
"""

_COUNTERS = ("published", "duplicates", "stale_dropped", "stale_masked", "stale_recycled",
             "dead_lettered", "redelivered")


@dataclass(slots=True)
class _Entry:
    seq: int
    tid: str
    data: bytes
    ntok: int
    vmin: int
    vmax: int
    added: float
    vt: str = ""  # output tokens per version (not journaled: reloaded entries count at vmin)


@dataclass(slots=True)
class _Lease:
    consumer: str
    until: float  # monotonic; 0 = available now (nacked or reloaded)
    deliveries: int


@dataclass(slots=True)
class _Group:
    name: str
    cursor: int  # next seq never delivered to this group
    pending: dict[int, _Lease] = field(default_factory=dict)


class MemoryStore(TrajectoryStore):
    """Embedded store; pass ``journal_path`` for durability across process restarts."""

    def __init__(self, config: StoreConfig | None = None, journal_path: str | None = None):
        self.config = config or StoreConfig()
        self._entries: dict[int, _Entry] = {}  # insertion (= seq) ordered
        self._dedup: dict[str, float] = {}  # trajectory_id -> forget-after (wall clock)
        self._groups: dict[str, _Group] = {}
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._recycled: list[tuple[int, bytes]] = []
        self._next_seq = 1
        self._cond = asyncio.Condition()
        self._db: sqlite3.Connection | None = None
        self._closed = False
        if journal_path:
            self._open_journal(journal_path)

    # ---- journal ----

    def _open_journal(self, path: str) -> None:
        try:
            db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open store journal {path!r}: {exc}") from exc
        self._db = db
        for seq, tid, data, ntok, vmin, vmax, added in db.execute(
                "SELECT seq, tid, data, ntok, vmin, vmax, added FROM entries ORDER BY seq"):
            self._entries[seq] = _Entry(seq, tid, bytes(data), ntok, vmin, vmax, added)
            self._dedup[tid] = float("inf")
        for tid, expires in db.execute("SELECT tid, expires FROM dedup"):
            self._dedup.setdefault(tid, expires)
        for name, cursor in db.execute("SELECT name, cursor FROM groups"):
            self._groups[name] = _Group(name, cursor)
        for grp, seq, deliveries in db.execute("SELECT grp, seq, deliveries FROM pending"):
            if grp in self._groups:
                self._groups[grp].pending[seq] = _Lease("", 0.0, deliveries)
        for name, value in db.execute("SELECT name, value FROM counters"):
            self._counters[name] = value
        self._recycled = [(i, bytes(d)) for i, d in
                          db.execute("SELECT id, data FROM recycled ORDER BY id")]
        row = db.execute("SELECT v FROM meta WHERE k='next_seq'").fetchone()
        self._next_seq = max([row[0] if row else 1, *[s + 1 for s in self._entries]])

    def _write(self, sql: str, rows: list[tuple] | tuple = ()) -> None:
        if self._db is None:
            return
        try:
            if isinstance(rows, list):
                self._db.executemany(sql, rows)
            else:
                self._db.execute(sql, rows)
        except sqlite3.Error as exc:
            raise StoreError(f"store journal write failed: {exc}") from exc

    def _tx(self):
        return _Tx(self._db)

    # ---- producer side ----

    def _backlog(self) -> int:
        if not self._groups:
            return len(self._entries)
        return max(self._next_seq - g.cursor + len(g.pending) for g in self._groups.values())

    async def publish(self, trajectory: Trajectory) -> bool:
        self._check_open()
        tid = trajectory.trajectory_id
        now = time.time()
        if self._dedup.get(tid, 0.0) > now:
            self._counters["duplicates"] += 1
            self._write("INSERT OR REPLACE INTO counters VALUES ('duplicates', ?)",
                        (self._counters["duplicates"],))
            return False
        if self._backlog() >= self.config.max_backlog:
            raise backlog_full(self.config.max_backlog)
        ntok, vmin, vmax = entry_facts(trajectory)
        entry = _Entry(self._next_seq, tid, trajectory_codec.encode(trajectory), ntok, vmin, vmax, now,
                       version_tokens(trajectory))
        with self._tx():
            self._write("INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (entry.seq, tid, entry.data, ntok, vmin, vmax, now))
            self._write("INSERT OR REPLACE INTO meta VALUES ('next_seq', ?)", (entry.seq + 1,))
            self._write("INSERT OR REPLACE INTO counters VALUES ('published', ?)",
                        (self._counters["published"] + 1,))
        self._entries[entry.seq] = entry
        self._dedup[tid] = float("inf")
        self._next_seq += 1
        self._counters["published"] += 1
        async with self._cond:
            self._cond.notify_all()
        return True

    async def lookup(self, trajectory_ids: list[str]) -> dict[str, bytes | None]:
        self._check_open()
        now = time.time()
        want = {t for t in trajectory_ids if self._dedup.get(t, 0.0) > now}
        out: dict[str, bytes | None] = dict.fromkeys(want)
        if want:
            for e in self._entries.values():
                if e.tid in want:
                    out[e.tid] = e.data
        return out

    async def backlog(self) -> int:
        return self._backlog()

    async def stats(self) -> StoreStats:
        return StoreStats.of(self._counters, self._backlog(), self.config.max_backlog)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._db is not None:
            self._db.close()
            self._db = None

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("store is closed")

    # ---- learner side ----

    def _group(self, group: str) -> _Group:
        check_name("group", group)
        g = self._groups.get(group)
        if g is None:
            raise NotFound(f"consumer group {group!r} does not exist; create it first")
        return g

    async def create_group(self, group: str, *, from_latest: bool = False) -> bool:
        self._check_open()
        check_name("group", group)
        if group in self._groups:
            return False
        cursor = self._next_seq if from_latest else min(self._entries, default=self._next_seq)
        self._write("INSERT INTO groups VALUES (?, ?)", (group, cursor))
        self._groups[group] = _Group(group, cursor)
        return True

    async def has_group(self, group: str) -> bool:
        return check_name("group", group) in self._groups

    def _take(self, g: _Group, consumer: str, count: int) -> list[StoredEntry]:
        now = time.monotonic()
        until = now + self.config.lease_seconds
        out: list[StoredEntry] = []
        for seq, lease in sorted(g.pending.items()):
            if len(out) >= count:
                break
            if lease.until <= now:
                lease.consumer, lease.until = consumer, until
                lease.deliveries += 1
                out.append(self._stored(seq, lease.deliveries))
        while len(out) < count and g.cursor < self._next_seq:
            seq = g.cursor
            g.cursor += 1
            if seq not in self._entries:
                continue
            g.pending[seq] = _Lease(consumer, until, 1)
            out.append(self._stored(seq, 1))
        return out

    def _stored(self, seq: int, deliveries: int) -> StoredEntry:
        e = self._entries[seq]
        return StoredEntry(entry_id=str(seq), trajectory_id=e.tid, data=e.data,
                           num_tokens=e.ntok, min_version=e.vmin, max_version=e.vmax,
                           delivery_count=deliveries, version_tokens=e.vt)

    async def read(self, group: str, consumer: str, count: int, *,
                   block_ms: int = 0, payload: bool = True) -> list[StoredEntry]:
        self._check_open()
        check_name("consumer", consumer)
        g = self._group(group)
        deadline = time.monotonic() + max(block_ms, 0) / 1000
        while True:
            out = self._take(g, consumer, count)
            left = deadline - time.monotonic()
            if out or left <= 0:
                break
            async with self._cond:
                try:
                    await asyncio.wait_for(self._cond.wait(), timeout=min(left, 0.25))
                except TimeoutError:
                    pass
            self._check_open()
        if out:
            name = g.name
            with self._tx():
                self._write("UPDATE groups SET cursor=? WHERE name=?", (g.cursor, name))
                self._write("INSERT OR REPLACE INTO pending VALUES (?, ?, ?)",
                            [(name, int(e.entry_id), e.delivery_count) for e in out])
        return out

    @staticmethod
    def _seqs(entry_ids: list[str]) -> list[int]:
        out = []
        for i in entry_ids:
            if not (isinstance(i, str) and i.isdigit()):
                raise InvalidArgument(f"malformed entry id {i!r}")
            out.append(int(i))
        return out

    async def ack(self, group: str, entry_ids: list[str]) -> int:
        self._check_open()
        g = self._group(group)
        done = [s for s in self._seqs(entry_ids) if g.pending.pop(s, None) is not None]
        self._write("DELETE FROM pending WHERE grp=? AND seq=?", [(group, s) for s in done])
        self._trim()
        return len(done)

    async def extend(self, group: str, consumer: str, entry_ids: list[str]) -> list[str]:
        self._check_open()
        check_name("consumer", consumer)
        g = self._group(group)
        until = time.monotonic() + self.config.lease_seconds
        out = []
        for eid, seq in zip(entry_ids, self._seqs(entry_ids)):
            lease = g.pending.get(seq)
            if lease is not None and lease.consumer == consumer and lease.until > 0:
                lease.until = until
                out.append(eid)
        return out

    async def nack(self, group: str, entry_ids: list[str], *,
                   delivered: bool = True) -> tuple[int, int]:
        self._check_open()
        g = self._group(group)
        requeued, dead = [], []
        for s in self._seqs(entry_ids):
            lease = g.pending.get(s)
            if lease is None:
                continue
            if not delivered:
                lease.deliveries = max(lease.deliveries - 1, 0)
                lease.until = 0.0
                requeued.append(s)
            elif lease.deliveries >= self.config.max_deliveries:
                del g.pending[s]
                dead.append(s)
            else:
                lease.until = 0.0
                requeued.append(s)
        with self._tx():
            self._write("DELETE FROM pending WHERE grp=? AND seq=?", [(group, s) for s in dead])
            self._write("UPDATE pending SET deliveries=? WHERE grp=? AND seq=?",
                        [(g.pending[s].deliveries, group, s) for s in requeued])
        if dead:
            await self._count(dead_lettered=len(dead))
            self._trim()
        if requeued:
            async with self._cond:
                self._cond.notify_all()
        return len(requeued), len(dead)

    async def group_backlog(self, group: str) -> int:
        g = self._group(group)
        return self._next_seq - g.cursor + len(g.pending)

    async def group_stats(self) -> list[GroupStats]:
        return [GroupStats(group=g.name, backlog=self._next_seq - g.cursor + len(g.pending),
                           pending=len(g.pending),
                           redelivered=self._counters.get(f"redelivered:{g.name}", 0))
                for g in self._groups.values()]

    async def unconsumed_tokens(self, limit: int = 10_000) -> UnconsumedTokens:
        groups = list(self._groups.values())
        return count_unconsumed(
            ((e.vt, e.vmin, e.ntok) for seq, e in self._entries.items()
             if not groups or any(seq >= g.cursor or seq in g.pending for g in groups)), limit)

    async def take_recycled(self, max_n: int) -> list[Trajectory]:
        taken, self._recycled = self._recycled[:max_n], self._recycled[max_n:]
        self._write("DELETE FROM recycled WHERE id=?", [(i,) for i, _ in taken])
        return [trajectory_codec.decode(d) for _, d in taken]

    async def _push_recycled(self, entries: list[StoredEntry]) -> None:
        for e in entries:
            rid = (self._recycled[-1][0] + 1) if self._recycled else 1
            if self._db is not None:
                cur = self._db.execute("INSERT INTO recycled (data) VALUES (?)", (e.data,))
                rid = cur.lastrowid
            self._recycled.append((rid, e.data))

    async def _count(self, **counters: int) -> None:
        for k, v in counters.items():
            self._counters[k] = self._counters.get(k, 0) + v
        self._write("INSERT OR REPLACE INTO counters VALUES (?, ?)",
                    [(k, self._counters[k]) for k in counters])

    def _trim(self) -> None:
        """Drop entries acked by every group and older than the retention window."""
        if not self._groups:
            return
        now = time.time()
        if len(self._dedup) > 2 * len(self._entries) + 1024:  # forget expired ids
            self._dedup = {k: v for k, v in self._dedup.items() if v > now}
            self._write("DELETE FROM dedup WHERE expires <= ?", (now,))
        horizon = now - self.config.retention_seconds
        low = min(min([g.cursor, *g.pending]) for g in self._groups.values())
        gone = []
        for seq, e in self._entries.items():
            if seq >= low or e.added > horizon:
                break
            gone.append(e)
        if not gone:
            return
        forget = time.time() + self.config.dedup_seconds
        with self._tx():
            self._write("DELETE FROM entries WHERE seq=?", [(e.seq,) for e in gone])
            self._write("INSERT OR REPLACE INTO dedup VALUES (?, ?)",
                        [(e.tid, forget) for e in gone])
        for e in gone:
            del self._entries[e.seq]
            self._dedup[e.tid] = forget


class _Tx:
    """BEGIN/COMMIT around a few journal writes (no-op without a journal)."""

    def __init__(self, db: sqlite3.Connection | None):
        self.db = db

    def __enter__(self):
        if self.db is not None:
            self.db.execute("BEGIN")
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.db is not None:
            self.db.execute("ROLLBACK" if exc_type else "COMMIT")
        return False
