"""The engine pool: registration, health, gates (swap fences), load-aware sticky routing,
and a circuit breaker per engine.

Each engine has a *gate*: closed while a swap fences it, so new engine requests wait
(or go to another engine whose gate is open, in rolling swaps). Outstanding requests and
tokens are counted per engine for routing and for drain.

Failure handling: a failed engine request takes the engine out of rotation until its next
health probe passes; ``breaker.failures`` failures in a row open its circuit for a
cooldown (doubling per trip) that a passing probe does not shorten. An engine that stops
answering its health probes (hung: SIGSTOP, a wedged GPU) has every request in flight to
it broken off at once, so they resume on other engines from their partial output instead
of waiting out a read timeout.

Identity: the pool records who each engine is at registration (``engines.identity``:
its process, model_path and weight_version label) and every passing health probe of an
unfenced engine reads it again (``/model_info`` and ``/server_info``). An engine that
changed behind the gateway's back (restarted on the same URL within one probe interval,
weights or label changed by someone else) is taken out of routing, its facts detected
again and its registration ``epoch`` bumped before it is re-admitted; the epoch is part of
the KV namespace (``core.stamping.kv_namespace``) and every answer is vetted against it
(``rollouts.vetting``: a request in flight across the change fails over from there). An
engine back from UNHEALTHY is re-detected the same way before it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from rollout_gateway.aio import Periodic, cancel_and_wait
from rollout_gateway.core.trajectory import Transition
from rollout_gateway.core.version_policy import ANY, VersionPolicy
from rollout_gateway.engines.client import AnswerGate, EngineClient, Health
from rollout_gateway.engines.identity import EngineIdentity
from rollout_gateway.engines.shape import routing_problem
from rollout_gateway.errors import (
    AlreadyExists,
    GatewayError,
    NotFound,
    Unavailable,
    VersionPolicyUnmet,
)
from rollout_gateway.settings import GatewaySettings

log = logging.getLogger(__name__)


class EngineState(StrEnum):
    HEALTHY = "healthy"
    PAUSED = "paused"  # answered 503 on /health (paused by us or someone): alive
    UNHEALTHY = "unhealthy"  # failed probes or requests; out of rotation until it recovers
    FAILED_LOAD = "failed_load"  # a weight update failed: out of rotation until re-registered
    DEREGISTERED = "deregistered"


@dataclass(eq=False)
class Engine:
    """One engine as the pool sees it."""

    id: str
    client: EngineClient
    state: EngineState = EngineState.HEALTHY
    version: int | None = None  # weight version it reports (verified after each swap)
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    probe_failures: int = 0
    last_error: str | None = None
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    #: version -> how it was installed under running requests (for kv stamping)
    installed_by: dict[int, Transition] = field(default_factory=dict)
    #: versions whose install kept the older KV in the prefix cache although the swap mode
    #: rebuilds it (the engine refused the flush): stamped as kept, as for in_place
    kv_kept: set[int] = field(default_factory=set)
    #: registration epoch: bumped each time the engine is registered again because it
    #: changed behind the gateway's back (a new process, other model_path or label)
    epoch: int = 0
    #: the version a refit or catch-up verified this engine runs, in this epoch (None: not
    #: verified since it joined or was registered again): a catch-up re-verifies it
    verified_version: int | None = None
    #: who it was at (re-)registration or after the last swap; None: not read yet (the
    #: next probe records it)
    identity: EngineIdentity | None = None
    #: gate closings and openings so far (a probe that overlapped one ignores its read)
    fences: int = 0
    #: one probe at a time (the health loop's and an out-of-turn one)
    probing: asyncio.Lock = field(default_factory=asyncio.Lock)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    #: leases whose request has not streamed a token yet, and the event set when none is
    #: left (an in-place swap under the overlap scheduler waits for it: core.stamping)
    unstarted: int = 0
    all_started: asyncio.Event = field(default_factory=asyncio.Event)
    #: requests in flight to it (a retract swap breaks off those asking for routing)
    leases: set[Lease] = field(default_factory=set)
    registered_at: float = field(default_factory=time.time)
    #: circuit breaker: failed requests in a row, trips in a row, open until (monotonic)
    failures: int = 0
    trips: int = 0
    open_until: float = 0.0

    def __post_init__(self) -> None:
        self.gate.set()
        self.idle.set()
        self.all_started.set()

    @property
    def url(self) -> str:
        return self.client.url

    @property
    def routable(self) -> bool:
        return self.state in (EngineState.HEALTHY, EngineState.PAUSED)

    def to_dict(self) -> dict[str, Any]:
        info = self.client.info
        return {"id": self.id, "url": self.url, "state": self.state.value,
                "weight_version": self.version, "sglang_version": info.version_text,
                "epoch": self.epoch, "model_path": info.model_path,
                "outstanding_requests": self.outstanding_requests,
                "outstanding_tokens": self.outstanding_tokens,
                "fenced": not self.gate.is_set(), "last_error": self.last_error,
                "breaker": {"open": self.breaker_open, "failures_in_a_row": self.failures,
                            "trips": self.trips,
                            "open_for_s": round(max(self.open_until - time.monotonic(), 0), 3)}}

    @property
    def breaker_open(self) -> bool:
        return time.monotonic() < self.open_until

    def patience(self) -> bool:
        """Silence from this engine is expected now (paused or fenced for a swap)."""
        return not self.gate.is_set() or self.state is EngineState.PAUSED


#: a refit broke the request off: its sample is stale, ends with its output so far
BREAK_STALE_PUBLISH = "stale_publish"
#: ... its sample is stale, starts again from the prompt under the new weights
BREAK_STALE_REQUEUE = "stale_requeue"
#: ... its version policy refuses the KV an in_place swap would keep: it resumes re-prefilled
BREAK_KV_POLICY = "kv_policy"


@dataclass(eq=False)
class Lease:
    """One outstanding request on an engine. ``started()`` once its first token arrived:
    the engine has then prefilled it, so no prefill of it can be in flight."""

    engine: Engine
    tokens: int
    rid: str = ""  # the engine request's rid
    routed: bool = False  # it asked for routed experts
    #: the sample's version policy (a refit breaks off a request whose kept KV it refuses)
    policy: VersionPolicy = ANY
    #: the version whose weights computed this request's KV (the engine's when it was sent:
    #: each engine request prefills afresh in its version's cache namespace); an in_place
    #: swap keeps it, so it can fall behind the version the request samples with
    kv_version: int | None = None
    #: the version of the sample's first token (of its engine's version when it has none)
    start_version: int | None = None
    #: why a refit broke the request off on purpose (``BREAK_*``), None otherwise
    broken_off: str | None = None
    is_started: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    def started(self) -> None:
        if self.is_started:
            return
        self.is_started = True
        e = self.engine
        e.unstarted -= 1
        if e.unstarted == 0:
            e.all_started.set()


class EnginePool:
    """All engines of one gateway replica."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        #: large answers read at once, over every engine (EngineClient's gate)
        self.answers = (AnswerGate(settings.max_large_answers)
                        if settings.max_large_answers > 0 else None)
        self._engines: dict[str, Engine] = {}
        self._changed = asyncio.Condition()
        self._health = Periodic(self._probe_all, settings.health_interval_s,
                                what="health round", log=log, trace=True)
        #: probes started out of turn (``suspect``), one per engine at a time
        self._rechecks: dict[str, asyncio.Task[None]] = {}
        #: called with an engine that came back from UNHEALTHY (e.g. to catch its weights up)
        self.on_recovered: Callable[[Engine], Awaitable[Any]] | None = None
        #: whether a swap explains an engine's new identity (one another replica led):
        #: then the pool adopts it instead of registering the engine again
        self.swapped_elsewhere: Callable[[Engine, EngineIdentity], Awaitable[bool]] | None = None

    # ---- registration ------------------------------------------------------------------
    async def register(self, engine_id: str, url: str, api_key: str | None = None, *,
                       fenced: bool = False) -> Engine:
        """Add an engine. ``fenced``: it joins with its gate closed (no request reaches it
        until the caller opens it, e.g. once it runs the pool's current weights)."""
        if engine_id in self._engines:
            raise AlreadyExists(f"engine {engine_id!r} is already registered",
                                details={"engine_id": engine_id})
        client = EngineClient(engine_id, url, timeouts=self.settings.timeouts, api_key=api_key,
                              gate=self.answers)
        try:
            info = await client.detect()
        except GatewayError:
            await client.close()
            raise
        eng = Engine(id=engine_id, client=client, version=info.weight_version,
                     identity=info.identity)
        if fenced:
            self.close_gate(eng)
        self._engines[engine_id] = eng
        await self._notify()
        log.info("registered engine %s at %s (sglang %s, weights v%s)", engine_id, url,
                 info.version_text, info.weight_version)
        problem = routing_problem(engine_id, info, self.settings.model)
        if problem:  # once per registration; each request asking for routing gets it too
            log.warning("%s. Requests that ask for routed experts will fail.", problem)
        return eng

    async def register_offline(self, engine_id: str, url: str, api_key: str | None,
                               why: str) -> Engine:
        """Register an engine that does not answer yet; the health loop brings it in."""
        if engine_id in self._engines:
            raise AlreadyExists(f"engine {engine_id!r} is already registered")
        client = EngineClient(engine_id, url, timeouts=self.settings.timeouts, api_key=api_key,
                              gate=self.answers)
        eng = Engine(id=engine_id, client=client, state=EngineState.UNHEALTHY, last_error=why)
        self._engines[engine_id] = eng
        return eng

    async def deregister(self, engine_id: str) -> Engine:
        eng = self.get(engine_id)
        del self._engines[engine_id]
        eng.state = EngineState.DEREGISTERED
        eng.gate.set()
        await eng.client.close()
        await self._notify()
        return eng

    def get(self, engine_id: str) -> Engine:
        try:
            return self._engines[engine_id]
        except KeyError:
            raise NotFound(f"unknown engine {engine_id!r}", details={"engine_id": engine_id}) from None

    def list(self) -> list[Engine]:
        return list(self._engines.values())

    def __len__(self) -> int:
        return len(self._engines)

    def vocab_size(self) -> int | None:
        """Token ids must be below this: the setting (model.vocab_size), else the smallest
        vocabulary the engines' configs report, else None (unknown: unchecked)."""
        if self.settings.model.vocab_size is not None:
            return self.settings.model.vocab_size
        known = [e.client.info.vocab_size for e in self._engines.values()
                 if e.client.info.vocab_size is not None]
        return min(known) if known else None

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # ---- health ------------------------------------------------------------------------
    async def probe(self, eng: Engine) -> EngineState:
        async with eng.probing:
            return await self._probe(eng)

    async def _probe(self, eng: Engine) -> EngineState:
        fences = eng.fences
        h = await eng.client.health()
        if eng.state in (EngineState.FAILED_LOAD, EngineState.DEREGISTERED):
            return eng.state
        if h is not Health.DOWN and fences != eng.fences:
            # a swap paused or resumed the engine while the probe was out: its 200 or 503
            # describes a moment before that, not now (a 503 applied after the resume would
            # keep the engine out of routing until the next probe)
            return eng.state
        if h is Health.DOWN:
            eng.probe_failures += 1
            if eng.probe_failures >= self.settings.unhealthy_after:
                self.mark_unhealthy(eng, "health probe failed")
                if eng.gate.is_set():  # fenced: our swap is handling it (a slow load)
                    self.evict(eng, "it stopped answering health probes")
        elif eng.state is EngineState.UNHEALTHY and eng.breaker_open:
            eng.probe_failures = 0  # alive, but its circuit is open: it stays out until then
        else:
            eng.probe_failures = 0
            alive = EngineState.HEALTHY if h is Health.OK else EngineState.PAUSED
            if eng.state is EngineState.UNHEALTHY:  # it may have restarted
                await self.readmit(eng, alive)
            else:
                eng.state = alive
                changed = await self._identity_change(eng)
                if changed is not None:
                    await self.readmit(eng, alive, changed)
        return eng.state

    async def _identity_change(self, eng: Engine) -> str | None:
        """What changed about a routable, unfenced engine since it was registered (None:
        nothing, or it could not be read: liveness is the health probe's to judge)."""
        if not eng.gate.is_set():
            return None
        fences = eng.fences
        try:
            now = await eng.client.identity(read=self.settings.timeouts.health_s)
        except GatewayError:
            return None
        if fences != eng.fences or not eng.gate.is_set():
            return None  # a swap ran meanwhile: it re-reads the identity itself
        if eng.identity is None:  # not read after its last swap: this is the record now
            eng.identity = now
            return None
        diff = eng.identity.changes(now)
        if not diff:
            return None
        if (self.swapped_elsewhere is not None and now.process == eng.identity.process
                and await self.swapped_elsewhere(eng, now)):
            eng.identity = now
            if now.weight_version is not None:
                eng.version = max(eng.version or now.weight_version, now.weight_version)
            return None
        return "; ".join(diff)

    async def readmit(self, eng: Engine, alive: EngineState, changed: str | None = None) -> None:
        """Register ``eng`` again before it serves: out of routing while its facts are
        detected again; an engine that ``changed`` or is not who it was gets a new epoch and
        forgets how its versions were installed.
        Then ``on_recovered`` (e.g. catch its weights up to the pool)."""
        if changed is not None:
            log.warning("engine %s changed behind the gateway (%s): registering it again",
                        eng.id, changed)
            # its requests in flight are not broken off (that would count against its
            # circuit): each later chunk of theirs fails the vetting (a new epoch)
            self.mark_unhealthy(eng, f"changed behind the gateway: {changed}")
            await self._notify()
        try:
            info = await eng.client.detect()
        except GatewayError as exc:
            self.mark_unhealthy(eng, exc.message)
            return
        diff = eng.identity.changes(info.identity) if eng.identity is not None else []
        if changed is not None or diff:
            eng.epoch += 1
            eng.verified_version = None
            eng.installed_by.clear()
            eng.kv_kept.clear()
            log.warning("engine %s registered again as epoch %d (%s)", eng.id, eng.epoch,
                        changed or "; ".join(diff))
        eng.identity = info.identity
        eng.version = info.weight_version
        eng.last_error = None
        eng.state = alive
        if self.on_recovered is not None:
            try:
                await self.on_recovered(eng)
            except GatewayError as exc:
                log.warning("engine %s recovered but could not catch up: %s", eng.id,
                            exc.message)
        await self._notify()

    async def reread_identity(self, eng: Engine) -> None:
        """Record who ``eng`` is now; call while it is fenced, after a swap changed its
        weights or label on purpose. Unreadable: the previous record stays."""
        try:
            eng.identity = await eng.client.identity(read=self.settings.timeouts.health_s)
        except GatewayError as exc:  # the next probe records it (never a change)
            eng.identity = None
            log.warning("engine %s: identity not read after the swap: %s", eng.id, exc.message)

    def evict(self, eng: Engine, why: str) -> int:
        """Break off every request in flight to ``eng``; they fail over from their
        partial output. Returns how many."""
        n = eng.client.abort_inflight(f"engine {eng.id} evicted: {why}")
        if n:
            log.warning("engine %s: broke off %d request(s) in flight: %s", eng.id, n, why)
        return n

    def record_success(self, eng: Engine) -> None:
        """An engine request finished: its circuit closes."""
        eng.failures = eng.trips = 0

    def record_failure(self, eng: Engine, why: str) -> None:
        """An engine request failed (broken, silent, garbage): out of rotation until a probe
        passes; ``breaker.failures`` in a row open its circuit for the cooldown."""
        cfg = self.settings.breaker
        eng.failures += 1
        self.mark_unhealthy(eng, why)
        if eng.failures >= cfg.failures and not eng.breaker_open:
            eng.trips += 1
            cool = min(cfg.cooldown_s * 2 ** (eng.trips - 1), cfg.max_cooldown_s)
            eng.open_until = time.monotonic() + cool
            eng.failures = cfg.failures - 1  # after the cooldown one more failure re-opens it
            eng.last_error = f"circuit open for {cool:g}s after failed requests in a row: {why}"
            log.error("engine %s: %s", eng.id, eng.last_error)
            self.evict(eng, "its circuit opened")

    def suspect(self, eng: Engine, why: str) -> None:
        """An answer showed that ``eng`` changed behind the gateway (rollouts.vetting):
        out of routing now (not a failure: its circuit is untouched), and probed at once,
        out of turn, so it is registered again without waiting for the health interval."""
        self.mark_unhealthy(eng, why)
        if eng.id in self._rechecks or not self._health.running:
            return

        async def recheck() -> None:
            try:
                await self.probe(eng)
            except Exception:  # noqa: BLE001 - the health loop tries again
                log.exception("out-of-turn probe of %s failed", eng.id)
            finally:
                self._rechecks.pop(eng.id, None)

        self._rechecks[eng.id] = asyncio.get_running_loop().create_task(recheck())

    def mark_unhealthy(self, eng: Engine, why: str) -> None:
        if eng.state not in (EngineState.FAILED_LOAD, EngineState.DEREGISTERED):
            eng.state = EngineState.UNHEALTHY
        eng.last_error = why

    async def _probe_all(self) -> None:
        for eng in list(self._engines.values()):
            try:
                await self.probe(eng)
            except Exception:  # noqa: BLE001 - one engine's failure skips no other
                log.exception("health probe of %s failed", eng.id)

    def start(self) -> None:
        self._health.start()

    async def close(self) -> None:
        await self._health.stop()
        for t in list(self._rechecks.values()):
            await cancel_and_wait(t)
        for eng in list(self._engines.values()):
            await eng.client.close()
        self._engines.clear()

    # ---- routing -----------------------------------------------------------------------
    def _candidates(self, exclude: Iterable[str], policy: VersionPolicy = ANY,
                    learner_version: int = 0) -> list[Engine]:
        ex = set(exclude)
        return [e for e in self._engines.values() if e.routable and e.id not in ex
                and policy.admits(e.version, learner_version)]

    def barred(self, policy: VersionPolicy, learner_version: int) -> list[Engine]:
        """Engines in rotation that ``policy`` keeps a request from."""
        return [e for e in self._engines.values()
                if e.routable and not policy.admits(e.version, learner_version)]

    def choose(self, *, sticky_key: str | None = None, prefer: str | None = None,
               exclude: Iterable[str] = (), policy: VersionPolicy = ANY,
               learner_version: int = 0) -> Engine | None:
        """Pick an engine now (None if none is routable and admitted by ``policy``, whose
        ``max_staleness`` / ``latest`` read ``learner_version``).

        Open gates first; ``prefer`` (same engine after abort_resume) if routable;
        else the sticky engine for ``sticky_key`` (rendezvous hash) unless it carries
        ``sticky_imbalance`` more requests than the least loaded; else least load.
        A fenced engine is returned only when every candidate is fenced (we then wait at
        its gate rather than fail)."""
        cands = self._candidates(exclude, policy, learner_version)
        if not cands:
            return None
        if prefer is not None:
            for e in cands:
                if e.id == prefer:
                    return e
        open_ = [e for e in cands if e.gate.is_set()] or cands

        def load(e: Engine) -> tuple[int, int]:
            return (e.outstanding_requests, e.outstanding_tokens)

        least = min(open_, key=load)
        if sticky_key is not None:
            sticky = max(open_, key=lambda e: hashlib.blake2b(
                f"{sticky_key}|{e.id}".encode(), digest_size=8).digest())
            if sticky.outstanding_requests - least.outstanding_requests <= self.settings.sticky_imbalance:
                return sticky
        return least

    async def acquire(self, *, sticky_key: str | None = None, prefer: str | None = None,
                      exclude: Iterable[str] = (), why: str | None = None,
                      policy: VersionPolicy = ANY, learner_version: int = 0) -> Engine:
        """Wait until an engine ``policy`` admits is routable and its gate open; return it
        (not yet leased).

        Waits up to ``timeouts.drain_s`` for a fenced engine to reopen, up to
        ``timeouts.no_engine_s`` for any engine to come into rotation, and up to
        ``version_policy_wait_s`` for one the policy admits when engines in rotation are
        all barred by it (then :class:`VersionPolicyUnmet`: never another version)."""
        exclude = set(exclude)
        t = self.settings.timeouts
        start = time.monotonic()
        while True:
            eng = self.choose(sticky_key=sticky_key, prefer=prefer, exclude=exclude,
                              policy=policy, learner_version=learner_version)
            if eng is None and exclude:
                # an engine that failed this request earlier and has since passed a health
                # probe (failures take it out of rotation until then) may be tried again
                eng = self.choose(sticky_key=sticky_key, policy=policy,
                                  learner_version=learner_version)
            if eng is not None and eng.gate.is_set():
                return eng
            barred = self.barred(policy, learner_version) if eng is None else []
            waited = time.monotonic() - start
            limit = (t.drain_s if eng is not None else
                     self.settings.version_policy_wait_s if barred else t.no_engine_s)
            if waited >= limit:
                if barred:
                    raise VersionPolicyUnmet(
                        f"no engine satisfies version policy {policy} (learner version "
                        f"{learner_version}; engines in rotation: " + ", ".join(
                            f"{e.id} v{e.version if e.version is not None else '?'}"
                            for e in barred) + ")",
                        details={"version_policy": str(policy),
                                 "learner_version": learner_version,
                                 "engine_versions": {e.id: e.version for e in barred}})
                if eng is None:
                    msg = "no engine available"
                    if exclude:
                        msg += f" (failed: {', '.join(sorted(exclude))})"
                    if why:
                        msg += f"; last error: {why}"
                    raise Unavailable(msg, details={"excluded": sorted(exclude)})
                raise Unavailable(f"engine {eng.id} stayed fenced for {limit}s",
                                  details={"engine_id": eng.id})
            async with self._changed:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(),
                                           timeout=min(limit - waited, 0.25))

    @contextlib.asynccontextmanager
    async def lease(self, eng: Engine, tokens: int, rid: str = "", routed: bool = False, *,
                    policy: VersionPolicy = ANY,
                    start_version: int | None = None) -> AsyncIterator[Lease]:
        """Count one outstanding request of ``tokens`` expected tokens on ``eng`` (engine rid
        ``rid``; ``routed``: it asks for routed experts; ``policy``: its sample's version
        policy; ``start_version``: the version of its sample's first token, None for the
        engine's)."""
        eng.outstanding_requests += 1
        eng.outstanding_tokens += tokens
        eng.idle.clear()
        eng.unstarted += 1
        eng.all_started.clear()
        lease = Lease(eng, tokens, rid, routed, policy, kv_version=eng.version,
                      start_version=start_version if start_version is not None
                      else eng.version)
        eng.leases.add(lease)
        try:
            yield lease
        finally:
            eng.leases.discard(lease)
            lease.ended.set()
            lease.started()  # over, started or not: nothing of it is left to prefill
            eng.outstanding_requests -= 1
            eng.outstanding_tokens -= tokens
            if eng.outstanding_requests == 0:
                eng.idle.set()

    # ---- fences (used by the swap orchestrator) -----------------------------------------
    def close_gate(self, eng: Engine) -> None:
        eng.fences += 1
        eng.gate.clear()

    async def open_gate(self, eng: Engine, resumed: bool = False) -> None:
        """Lift a fence; ``resumed``: the engine has just answered our continue_generation, so
        it serves again whatever a probe taken during its pause said."""
        eng.fences += 1
        if resumed and eng.state is EngineState.PAUSED:
            eng.state = EngineState.HEALTHY
        eng.gate.set()
        await self._notify()
