"""Agent sessions over the rollout machinery: each OpenAI-style call is one engine request
run by :class:`~rollout_gateway.rollouts.rollout.RolloutService` (admission, the staleness
policy, failover, swaps, stamping), then appended to its session's branch; a session is
published when it ends (``end``, idle timeout, a new branch, shutdown).

A session's state lives in the session store (:mod:`rollout_gateway.sessions.store`: in
memory with the embedded store, in Redis shared by every replica), so any replica serves
any turn: a call locks its session there, brings this replica's copy up to date (only
the records it has not seen) and appends its turn when it ends.

Sessions belong to a tenant (:mod:`rollout_gateway.rollouts.tenancy`): a session id names a
session within its tenant's namespace, and another tenant's calls, ends and rewards find
nothing there (404; ``owner`` None, the admin, acts on every tenant's). Trajectory ids end
in a random part (``<session>.b<k>.<random>``), so nobody can name a trajectory they were
not told."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollout_gateway.aio import Periodic
from rollout_gateway.core.staleness import is_stale, lag
from rollout_gateway.core.trajectory import Trajectory, Transition
from rollout_gateway.engines.decode_toplogprobs import LogprobRows
from rollout_gateway.engines.pool import Engine
from rollout_gateway.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    GatewayError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from rollout_gateway.rollouts.models import RolloutRequest, SamplingParams
from rollout_gateway.rollouts.rollout import RolloutService
from rollout_gateway.rollouts.sample import PREFERRED_ENGINE, PassThrough
from rollout_gateway.rollouts.gatekeeper import default_replica_id
from rollout_gateway.rollouts.tenancy import TENANT_KEY
from rollout_gateway.sessions import records
from rollout_gateway.sessions.messages import assistant_message
from rollout_gateway.sessions.session import Branch, Plan, plan_chat, plan_completion
from rollout_gateway.sessions.store import Claim, Head, Key, MemorySessionStore, SessionStore
from rollout_gateway.sessions.templates import ChatTemplate, load_template, parse_tool_calls
from rollout_gateway.settings import DEFAULT_TENANT, GatewaySettings

log = logging.getLogger(__name__)


def _random() -> str:
    """The unguessable part of a trajectory id (96 bits, URL-safe)."""
    return secrets.token_urlsafe(12)


@dataclass
class Session:
    """A replica's copy of a session (the session store holds the session itself)."""

    session_id: str
    tenant: str = DEFAULT_TENANT
    branch: Branch | None = None
    branches: int = 0  # branches started (the store's head)
    n: int = 0  # records of the current branch this copy has applied
    group_id: str | None = None
    owner: str = ""  # the lock this replica holds for a call in flight ("" none)
    fresh: bool = False  # not in the store yet (its first call)
    unpublished: int = 0  # finished branches still in its outbox (the store failed)

    @property
    def key(self) -> Key:
        return (self.tenant, self.session_id)

    def head(self) -> Head:
        return Head(self.tenant, self.session_id, self.group_id, self.branches, self.n,
                    time.time())


@dataclass
class Reply:
    """One choice of one call, as the HTTP layer renders it."""

    index: int
    content: str
    tool_calls: list[dict[str, Any]]
    finish_reason: str  # OpenAI: stop | length | tool_calls
    token_ids: np.ndarray
    logprobs: np.ndarray
    turn: Trajectory  # the call's own stamped trajectory (model tokens only)
    trajectory_id: str
    branch: int
    turn_index: int
    prompt_tokens: int
    branched: str = ""  # the reason, when this call started a new branch
    #: per output token, the engine's top alternatives as [logprob, id, ...] rows (None:
    #: not asked for; a None row: the engine had none)
    top_logprobs: LogprobRows | list | None = None


def _content(template: ChatTemplate, ids: np.ndarray, finish: Any) -> str:
    """The reply text: the model's tokens without its end-of-turn token, minus a matched
    stop string (as SGLang trims it)."""
    body = ids[:-1] if len(ids) and int(ids[-1]) in template.end_ids else ids
    text = template.decode(body.tolist(), skip_special_tokens=True)
    if isinstance(finish.matched, str) and finish.matched and text.endswith(finish.matched):
        text = text[:-len(finish.matched)]
    return text


class SessionManager:
    """Agent sessions over the session store: the calls, branches, held-for-reward
    trajectories, the idle sweeper. Any replica sharing the store serves any session."""

    def __init__(self, settings: GatewaySettings, rollouts: RolloutService, *,
                 learner_version: Callable[[], Awaitable[int]],
                 engines: Callable[[], list[Engine]],
                 publish: Callable[[Trajectory], Awaitable[Any]],
                 store: SessionStore | None = None, replica_id: str | None = None) -> None:
        self.settings = settings
        self.rollouts = rollouts  # runs each call (admission, staleness, failover, stamping)
        self.learner_version = learner_version  # the registry's
        self.engines = engines  # the pool's engines (follow-up turns prefer the last one)
        self.publish = publish  # the store's: a session's trajectory when it ends
        self.store: SessionStore = store or MemorySessionStore()
        self.replica_id = replica_id or settings.admission.replica_id or default_replica_id()
        s = settings
        self.template: ChatTemplate = load_template(s.chat_template)
        self.idle_timeout = s.session_idle_timeout_s
        self.reward_wait = s.session_reward_wait_s
        self.lease_s = s.session_lease_s
        self.remember_s = s.session_remember_s
        self.max_sessions = s.max_sessions
        self.max_per_tenant = s.max_sessions_per_tenant or s.max_sessions
        #: this replica's copies of sessions (the store holds them), most recent last
        self.cache: OrderedDict[Key, Session] = OrderedDict()
        self.locks: dict[Key, str] = {}  # sessions this replica runs a call of -> lock owner
        #: open sessions per tenant (every replica's), refreshed every lease / 3
        self.open_by_tenant: Counter[str] = Counter()
        self.counters = {"session_calls": 0, "sessions_started": 0, "sessions_ended": 0,
                         "sessions_idle_ended": 0, "session_branches": 0,
                         "session_trajectories_published": 0, "session_publish_failed": 0,
                         "session_stale_dropped": 0, "rewards_attached": 0,
                         "rewards_missing": 0, "session_turns_loaded": 0}
        self.sweep_period = max(0.05, min(self.idle_timeout, self.reward_wait) / 4)
        self._sweeper = Periodic(self.sweep, self.sweep_period, what="session sweep", log=log,
                                 trace=True)
        self._ticker = Periodic(self.tick, self.lease_s / 3, what="session leases", log=log)
        self._pumps: set[asyncio.Task[None]] = set()

    # ---- lifecycle ----

    def start(self) -> None:
        self._sweeper.start()
        self._ticker.start()

    async def stop(self) -> None:
        """Embedded store: publish what is open (ended_by ``shutdown``) and what waits for
        a reward. Shared store: leave both there for the other replicas (their sweepers end
        idle sessions and publish held trajectories past their wait)."""
        await self._sweeper.stop()
        await self._ticker.stop()
        if self.store.shared:
            return
        for key in await self.store.idle(float("inf"), self.max_sessions):
            with contextlib.suppress(GatewayError):
                await self._end(key, "shutdown", None, await_reward=False)
        for tid in await self.store.due(float("inf"), 1 << 30):
            with contextlib.suppress(GatewayError):
                await self._release_held(tid, None)

    async def tick(self) -> None:
        """Renew the locks of calls in flight here; refresh the open-sessions gauge."""
        await self.store.renew(dict(self.locks), self.lease_s)
        self.open_by_tenant = Counter(await self.store.open_counts())

    async def sweep(self) -> None:
        """End idle sessions and publish held trajectories past their wait, whichever
        replica created them (one replica sweeps at a time: the store's sweep lease)."""
        if not await self.store.sweep_lease(self.replica_id, self.sweep_period * 0.9):
            return
        cutoff = time.time() - self.idle_timeout
        for key in await self.store.idle(cutoff, 1000):
            try:
                if await self._end(key, "idle_timeout", None, await_reward=False,
                                   idle_before=cutoff):
                    self.counters["sessions_idle_ended"] += 1
            except GatewayError as exc:
                log.error("session %s: idle end failed: %s", key[1], exc.message)
        for tid in await self.store.due(time.time(), 1000):
            with contextlib.suppress(GatewayError):
                await self._release_held(tid, None)

    # ---- the session store ----

    def _owner(self) -> str:
        return f"{self.replica_id}/{_random()}"

    def _cached(self, key: Key, s: Session) -> None:
        self.cache[key] = s
        self.cache.move_to_end(key)
        while len(self.cache) > self.max_sessions:
            self.cache.popitem(last=False)

    async def _claim(self, key: Key) -> tuple[Claim, Session | None]:
        """Lock ``key`` and bring this replica's copy up to date (only the records it has
        not seen are read). The Session is None unless the claim is "ok"."""
        old = self.cache.get(key)
        owner = self._owner()
        got = await self.store.claim(key, owner, self.lease_s,
                                     (old.branches, old.n) if old is not None else None)
        if got.status != "ok":
            if got.status != "busy":
                self.cache.pop(key, None)
            return got, None
        assert got.head is not None
        s = old if old is not None and got.since else Session(key[1], key[0])
        if not got.since:
            s.branch, s.n = None, 0
        try:
            for rec in got.records:
                s.branch = records.apply(s.branch, rec)
        except GatewayError:
            self.cache.pop(key, None)
            await self.store.release(key, owner)
            raise
        self.counters["session_turns_loaded"] += len(got.records)
        s.n, s.branches, s.group_id = got.since + len(got.records), got.head.branches, \
            got.head.group_id
        s.owner = owner
        self.locks[key] = owner
        self._cached(key, s)
        s.unpublished = await self._flush(key, got.outbox) if got.outbox else 0
        return got, s

    async def _unlock(self, s: Session) -> None:
        """Give up the lock of a call that recorded nothing (a first call: the session)."""
        owner, s.owner = s.owner, ""
        if not owner:
            return
        self.locks.pop(s.key, None)
        if s.fresh and s.branch is None:
            self.cache.pop(s.key, None)
            await self.store.drop(s.key, owner)
            self.open_by_tenant[s.tenant] -= 1
        else:
            await self.store.release(s.key, owner)

    async def _unlock_quietly(self, s: Session) -> None:
        """:meth:`_unlock` on an error path: the error raised is the caller's (a store
        failure here leaves the lock to lapse after its lease)."""
        try:
            await asyncio.shield(self._unlock(s))
        except (GatewayError, asyncio.CancelledError) as exc:
            log.warning("session %s: unlocking failed (%s); its lease lapses", s.session_id,
                        getattr(exc, "message", type(exc).__name__))

    async def _commit(self, s: Session, recs: list[records.Record], reset: bool,
                      outbox: Trajectory | None = None) -> None:
        owner, s.owner = s.owner, ""
        self.locks.pop(s.key, None)
        if not await self.store.commit(s.key, owner, s.head(), recs, reset, outbox):
            self.cache.pop(s.key, None)
            raise Aborted(f"session {s.session_id!r}: its lock expired while the call ran "
                          f"(session_lease_s={self.lease_s:g}) and another call took it; "
                          "this call's turn was not recorded", details={"session_id":
                                                                         s.session_id})
        s.fresh = False

    # ---- calls ----

    async def _session(self, tenant: str, sid: str | None) -> Session | None:
        """The tenant's session ``sid``, locked for this call: the open one, or a new one
        not registered yet (:meth:`_open` registers it once the call is valid)."""
        if sid is None:
            return None
        got, s = await self._claim((tenant, sid))
        if got.status == "ended":
            raise FailedPrecondition(f"session {sid!r} has ended ({got.ended_by}); start a "
                                     "new session id", details={"session_id": sid})
        if got.status == "busy":
            exc = FailedPrecondition(f"session {sid!r} already has a call in flight; a "
                                     "session's turns are sequential",
                                     details={"session_id": sid,
                                              "retry_after_s": round(got.retry_after, 3)})
            exc.retryable = True
            raise exc
        if s is None:
            return Session(sid, tenant, fresh=True)
        return s

    async def _open(self, s: Session) -> None:
        """Register a new session (its first call passed validation): bounded overall
        (``max_sessions``) and per tenant (``max_sessions_per_tenant``), every replica's
        sessions counted."""
        owner = self._owner()
        got = await self.store.create(s.head(), owner, self.lease_s, self.max_sessions,
                                      self.max_per_tenant)
        if got == "busy":  # another first call got there first
            raise FailedPrecondition(f"session {s.session_id!r} already has a call in "
                                     "flight; a session's turns are sequential",
                                     details={"session_id": s.session_id})
        if got == "ended":
            raise FailedPrecondition(f"session {s.session_id!r} has ended; start a new "
                                     "session id", details={"session_id": s.session_id})
        if got == "full":
            raise ResourceExhausted(f"{self.max_sessions} sessions are open (max_sessions); "
                                    "end some first")
        if got == "tenant_full":
            raise ResourceExhausted(f"this tenant has {self.max_per_tenant} sessions open "
                                    "(max_sessions_per_tenant); end some first")
        s.owner = owner
        self.locks[s.key] = owner
        self._cached(s.key, s)
        self.open_by_tenant[s.tenant] += 1
        self.counters["sessions_started"] += 1

    def _request(self, input_ids: list[int], sp: SamplingParams, n: int, sid: str | None,
                 metadata: dict[str, str]) -> RolloutRequest:
        if not input_ids:
            raise InvalidArgument("the prompt renders to no tokens")
        return RolloutRequest(input_ids=input_ids, n=n, sampling_params=sp, session_id=sid,
                              publish=False, metadata=metadata)

    def _prepare(self, s: Session | None, plan: Plan) -> tuple[list[int], Branch | None]:
        """The engine input for ``plan`` and the branch it extends (None: a new branch)."""
        if s is None or s.branch is None or plan.kind == "new":
            return list(plan.context_ids), None
        seq = s.branch.sequence()
        if plan.kind == "continue":
            return seq.tolist() + list(plan.context_ids), s.branch
        return seq[:plan.prefix_len].tolist() + list(plan.context_ids), None

    async def call(self, *, sid: str | None, kind: str, plan_input: Any, tools: Any,
                   sp: SamplingParams, n: int, parse_tools: bool | int, stream: bool = False,
                   group_id: str | None = None, metadata: dict[str, str] | None = None,
                   top_logprobs: int = 0, tenant: str = DEFAULT_TENANT,
                   on_done: Callable[[], None] | None = None
                   ) -> list[Reply] | AsyncIterator[dict[str, Any]]:
        """One chat (``kind='chat'``, ``plan_input`` = canonical messages) or completion
        (``plan_input`` = prompt text or ids) call. ``parse_tools``: False, True, or the
        most tool calls to parse (1 for ``parallel_tool_calls: false``). With ``stream``, an async iterator of
        ``{"type": "delta" | "reply" | "error", ...}`` events (errors before the first
        event raise here). ``tenant``: whose session ``sid`` is. A call that fails
        before its generation starts opens no session. ``on_done`` (streams): called when
        the generation has ended, read or not."""
        s = await self._session(tenant, sid)  # locked for this call (a fresh one: not yet)
        try:
            if s is not None and n != 1:
                raise InvalidArgument("n > 1 in a session: a session continues one reply; use "
                                      "n=1 or leave out the session id")
            if s is not None and group_id is not None:
                if s.group_id is not None and s.group_id != group_id:
                    raise InvalidArgument(f"session {sid!r} is in group {s.group_id!r}, not "
                                          f"{group_id!r}")
            # top-k alternatives: the engines' own rows, forwarded (SGLang's top_logprobs_num)
            pt = PassThrough(top_logprobs_num=top_logprobs) if top_logprobs > 0 else None
            tag = {"group_id": ((s.group_id or group_id) if s is not None else group_id) or "",
                   "metadata": dict(metadata or {}), "passthrough": pt}
            if kind == "chat":
                plan = plan_chat(self.template, s.branch if s else None, plan_input, tools)
            else:
                plan = plan_completion(self.template, s.branch if s else None, plan_input)
            input_ids, extends = self._prepare(s, plan)
            req = self._request(input_ids, sp, n, sid, {"api": kind})
            self.rollouts.validate(req)
            if s is not None:
                if s.fresh:
                    await self._open(s)  # valid: now it counts (429 past the bounds)
                if group_id is not None:
                    s.group_id = group_id
            self.counters["session_calls"] += 1
            # the sample tasks (created inside run_with_text / open_stream) inherit it
            token = PREFERRED_ENGINE.set(await self._preferred_engine(extends))
            try:
                if not stream:
                    pairs = await self.rollouts.run_with_text(req, pt, tenant=tenant)
                else:
                    events = await self.rollouts.open_stream(req, pt, tenant=tenant,
                                                             on_done=on_done)
            finally:
                PREFERRED_ENGINE.reset(token)
            if not stream:
                return [await self._record(s, plan, extends, kind, plan_input, tools, i, t,
                                           parse_tools, tag) for i, (t, _text) in enumerate(pairs)]
        except BaseException:
            if s is not None:  # a first call that failed leaves no session
                await self._unlock_quietly(s)
            raise
        return self._stream(s, plan, extends, kind, plan_input, tools, events, parse_tools, tag)

    async def _preferred_engine(self, branch: Branch | None) -> str | None:
        """Follow-up turns: the engine that served the session's last turn (it holds the
        prefix) while it is routable and its version is within the staleness bound of the
        learner's; otherwise the freshest routable engine. None: plain sticky routing."""
        if branch is None:
            return None
        last = next((x.engine_id for x in reversed(branch.segments)
                     if x.began is not Transition.CONTEXT), None)
        try:
            lv = await self.learner_version()
        except GatewayError:
            return None
        bound = self.settings.admission.max_staleness
        engines = {e.id: e for e in self.engines() if e.routable and e.version is not None}
        held = engines.get(last) if last else None
        if held is not None and not is_stale(lag(lv, held.version), bound):
            return held.id
        fresh = [e for e in engines.values() if not is_stale(lag(lv, e.version), bound)]
        if not fresh:
            return None
        return max(fresh, key=lambda e: (e.version, -e.outstanding_requests)).id

    def _stream(self, s, plan, extends, kind, plan_input, tools, events, parse_tools, tag
                ) -> AsyncIterator[dict[str, Any]]:
        """The engine stream, consumed by a task started now (so a client that goes away, even
        before the response body starts, still leaves a complete session behind and releases
        the admission slot); the HTTP response reads its queue."""
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for ev in events:
                    if ev["type"] == "chunk":
                        await queue.put({"type": "delta", "index": ev["sample_index"],
                                         "token_ids": ev["token_ids"], "logprobs": ev["logprobs"]})
                    elif ev["type"] == "trajectory":
                        try:
                            reply = await self._record(s, plan, extends, kind, plan_input, tools,
                                                       ev["sample_index"], ev["trajectory"],
                                                       parse_tools, tag)
                        except GatewayError as exc:
                            await queue.put({"type": "error", "index": ev["sample_index"],
                                             "error": exc.to_dict()})
                            continue
                        await queue.put({"type": "reply", "index": ev["sample_index"],
                                         "reply": reply})
                    else:
                        await queue.put({"type": "error", "index": ev["sample_index"],
                                         "error": ev["error"]})
            except GatewayError as exc:
                await queue.put({"type": "error", "index": 0, "error": exc.to_dict()})
            finally:
                if s is not None:
                    with contextlib.suppress(GatewayError):
                        await self._unlock(s)
                await queue.put(None)

        task = asyncio.get_running_loop().create_task(pump())
        self._pumps.add(task)  # held until done
        task.add_done_callback(self._pumps.discard)

        async def read() -> AsyncIterator[dict[str, Any]]:
            while (ev := await queue.get()) is not None:
                yield ev

        return read()

    async def _record(self, s: Session | None, plan: Plan, extends: Branch | None, kind: str,
                      plan_input: Any, tools: Any, index: int, turn: Trajectory,
                      parse_tools: bool | int, tag: dict[str, Any]) -> Reply:
        """Append one finished call to its branch (a new one if needed); publish at once
        when there is no session."""
        try:
            return await self._record_inner(s, plan, extends, kind, plan_input, tools, index,
                                            turn, parse_tools, tag)
        except BaseException:
            if s is not None:
                self.cache.pop(s.key, None)  # the copy may hold what was not stored
                await self._unlock_quietly(s)
            raise

    async def _record_inner(self, s, plan, extends, kind, plan_input, tools, index, turn,
                            parse_tools, tag) -> Reply:
        ids = turn.tokens.token_ids
        content = _content(self.template, ids, turn.finish_reason)
        calls: list[dict[str, Any]] = []
        if parse_tools:
            content, calls = parse_tool_calls(content, len(extends.calls) if extends else 0,
                                              None if parse_tools is True else int(parse_tools))
        finish = {"length": "length"}.get(turn.finish_reason.type, "stop")
        if calls:
            finish = "tool_calls"
        branched = ""
        old: Branch | None = None
        recs: list[records.Record] = []
        if extends is not None:
            branch = extends
            context = list(plan.context_ids)
        else:
            if s is not None and s.branch is not None:
                old = s.branch
            bi = s.branches if s is not None else 0
            tid = f"{s.session_id}.b{bi}.{_random()}" if s is not None else f"call-{_random()}"
            start = records.BranchStart(trajectory_id=tid, index=bi,
                                        prompt_ids=np.array(turn.prompt_token_ids, np.int32),
                                        tools=tools, created_at=time.time())
            if old is not None and plan.prefix_len:
                # earlier calls of the prefix stay matchable in the new branch
                start.calls = [c for c in old.calls if c.seq_len <= plan.prefix_len]
                start.messages = list(old.messages[:start.calls[-1].n_messages + 1]) \
                    if start.calls and kind == "chat" else []
            if old is not None:
                branched = plan.reason or "history_edited"
                start.metadata = {"branched_from": old.trajectory_id, "branch_reason": branched}
                self.counters["session_branches"] += 1
            recs.append(start)
            branch = records.apply(None, start)
            context = []
        reply_msg = assistant_message(content, calls)
        rec = records.turn_record(
            branch, context, turn, kind=kind, plan_input=plan_input,
            prompt_text=plan.prompt_text, content=content, reply_msg=reply_msg,
            group_id=tag["group_id"],
            metadata={k: v for k, v in tag["metadata"].items()  # the caller's
                      if k not in ("branched_from", "branch_reason", TENANT_KEY)})
        records.apply(branch, rec)
        recs.append(rec)
        pt = tag["passthrough"]
        reply = Reply(index=index, content=content, tool_calls=calls, finish_reason=finish,
                      token_ids=ids, logprobs=turn.tokens.logprobs, turn=turn,
                      trajectory_id=branch.trajectory_id, branch=branch.index,
                      turn_index=len(branch.calls) - 1,
                      prompt_tokens=int(turn.prompt_token_ids.shape[0]), branched=branched,
                      top_logprobs=pt.out.get(index, {}).get("output_top_logprobs")
                      if pt is not None else None)
        tenant = turn.metadata.get(TENANT_KEY, DEFAULT_TENANT)
        if s is None:
            await self._publish(branch, branch.trajectory_id, tenant, "single_call", None,
                                await_reward=False)
            return reply
        done: Trajectory | None = None
        if old is not None:  # the superseded branch is finished: published after the commit
            if old.stale_verdict == "drop":
                self.counters["session_stale_dropped"] += 1
            else:
                done = self._final(old, s.session_id, tenant, "branch", None)
        s.branch = branch
        if extends is None:
            s.branches += 1
            s.n = 0
        s.n += len(recs)
        # the new branch and the old one's trajectory (in the session's outbox) at once: a
        # replica dying before the publish leaves it to the session's next claimer
        await self._commit(s, recs, reset=extends is None, outbox=done)
        if done is not None:
            await self._flush(s.key, [done])
        return reply

    # ---- ending and rewards ----

    def _final(self, branch: Branch, session_id: str, tenant: str, ended_by: str,
               reward: float | None) -> Trajectory:
        traj = branch.trajectory(session_id=session_id, ended_by=ended_by, reward=reward,
                                 template=self.template.name)
        traj.metadata[TENANT_KEY] = tenant  # the gateway's, over anything the caller set
        return traj

    async def _flush(self, key: Key, outbox: list[Trajectory]) -> int:
        """Publish a session's outbox (finished branches a new branch replaced); each
        leaves it once the trajectory store has it (already had it: a replica died after
        its publish). Returns how many are left (the store failed: retried at the
        session's next claim)."""
        left = 0
        for traj in outbox:
            try:
                if await self.publish(traj) is not False:
                    self.counters["session_trajectories_published"] += 1
                await self.store.mark_published(traj.trajectory_id,
                                                traj.metadata.get(TENANT_KEY, DEFAULT_TENANT),
                                                self.remember_s)
                await self.store.clear_outbox(key, traj.trajectory_id)
            except GatewayError as exc:
                left += 1
                self.counters["session_publish_failed"] += 1
                log.warning("session %s: publishing its finished branch %s failed: %s "
                            "(kept; retried at its next call)", key[1], traj.trajectory_id,
                            exc.message)
        return left

    async def _publish(self, branch: Branch, session_id: str, tenant: str, ended_by: str,
                       reward: float | None, *, await_reward: bool) -> dict[str, Any]:
        traj = self._final(branch, session_id, tenant, ended_by, reward)
        out = {"trajectory_id": traj.trajectory_id, "num_tokens": traj.num_tokens,
               "turns": len(branch.calls), "branch": branch.index}
        if branch.stale_verdict == "drop":
            self.counters["session_stale_dropped"] += 1
            return {**out, "published": False,
                    "reason": "a turn fell outside the staleness bound (stale policy: drop)"}
        if await_reward and reward is None:
            await self.store.hold(traj, time.time() + self.reward_wait)
            return {**out, "published": False, "awaiting_reward": True,
                    "reward_wait_s": self.reward_wait}
        await self._store(traj)
        return {**out, "published": True}

    async def _store(self, traj: Trajectory) -> None:
        try:
            stored = await self.publish(traj)
        except GatewayError:
            self.counters["session_publish_failed"] += 1
            raise
        if stored is False:  # the store already had this id: never report it published
            self.counters["session_publish_failed"] += 1
            raise AlreadyExists(f"trajectory {traj.trajectory_id!r} is already in the store; "
                                "it was not published again",
                                details={"trajectory_id": traj.trajectory_id})
        self.counters["session_trajectories_published"] += 1
        await self.store.mark_published(traj.trajectory_id,
                                        traj.metadata.get(TENANT_KEY, DEFAULT_TENANT),
                                        self.remember_s)

    async def _release_held(self, tid: str, reward: float | None) -> bool:
        """Publish held ``tid`` with ``reward`` (None: marked missing). False: no longer
        held (another replica published it)."""
        traj = await self.store.held(tid)
        if traj is None:
            return False
        if reward is None:
            traj.metadata["reward"] = "missing"
        else:
            traj.reward = reward
        try:
            await self._store(traj)
        except AlreadyExists:
            # another replica published it meanwhile (its reward, or none past the wait)
            await self.store.unhold(tid)
            if reward is None:
                return False
            raise
        await self.store.unhold(tid)  # after the store has it: a crash in between re-publishes
        self.counters["rewards_missing" if reward is None else "rewards_attached"] += 1
        return True

    async def _key(self, sid: str, owner: str | None, tenant: str | None) -> Key:
        """The key of session ``sid`` as ``owner`` (a tenant; None: the admin, who names
        the tenant or is given the one open or ended session of that id) sees it."""
        if owner is not None:
            return (owner, sid)
        if tenant is not None:
            return (tenant, sid)
        found = await self.store.tenants_of(sid)
        if len(found) > 1:
            raise InvalidArgument(f"tenants {sorted(found)} each have a "
                                  f"session {sid!r}: name one with ?tenant=",
                                  details={"session_id": sid})
        return (found[0], sid) if found else (DEFAULT_TENANT, sid)

    async def _end(self, key: Key, how: str, reward: float | None, *, await_reward: bool,
                   idle_before: float | None = None) -> dict[str, Any] | None:
        """End session ``key``. ``idle_before`` (the sweeper): only if it is still idle;
        None when it was not (or is gone, or busy)."""
        sid = key[1]
        got, s = await self._claim(key)
        if idle_before is not None and (s is None or got.head is None
                                        or got.head.last_active >= idle_before):
            if s is not None:
                await self._unlock(s)
            elif got.status in ("absent", "ended"):  # a leftover in the idle index
                await self.store.prune(key, idle_before)
            return None
        if got.status == "ended":
            raise FailedPrecondition(f"session {sid!r} has already ended ({got.ended_by})",
                                     details={"session_id": sid})
        if got.status == "absent":
            raise NotFound(f"no session {sid!r}", details={"session_id": sid})
        if got.status == "busy" or s is None:
            raise FailedPrecondition(f"session {sid!r} has a call in flight; end it after the "
                                     "call returns", details={"session_id": sid})
        result: dict[str, Any] = {"session_id": sid, "ended_by": how}
        try:
            if s.unpublished:
                raise Unavailable(f"session {sid!r}: an earlier branch of it could not be "
                                  "published yet; end it again", details={"session_id": sid})
            if s.branch is not None:
                result.update(await self._publish(s.branch, sid, s.tenant, how, reward,
                                                  await_reward=await_reward))
            else:
                result.update({"published": False, "reason": "the session had no model call"})
        except BaseException:
            await self._unlock_quietly(s)
            raise
        owner, s.owner = s.owner, ""
        self.locks.pop(key, None)
        self.cache.pop(key, None)
        if not await self.store.finish(key, owner, how, self.remember_s):
            raise Aborted(f"session {sid!r}: its lock expired while it was being ended; "
                          "another call took it", details={"session_id": sid})
        self.open_by_tenant[key[0]] -= 1
        self.counters["sessions_ended"] += 1
        return result

    async def end(self, sid: str, reward: float | None, await_reward: bool, *,
                  owner: str | None = DEFAULT_TENANT, tenant: str | None = None
                  ) -> dict[str, Any]:
        """End ``owner``'s session ``sid`` (``owner`` None: the admin, any tenant's;
        ``tenant`` names which when several have that id)."""
        got = await self._end(await self._key(sid, owner, tenant), "end", reward,
                              await_reward=await_reward)
        assert got is not None
        return got

    async def _owned(self, tid: str, owner: str | None) -> tuple[Trajectory | None, bool]:
        """(the held trajectory or None, whether ``tid`` is ``owner``'s: held or
        published; None: the admin, everyone's)."""
        held = await self.store.held(tid)
        if held is not None:
            mine = owner is None or held.metadata.get(TENANT_KEY, DEFAULT_TENANT) == owner
            return held, mine
        published = await self.store.published_tenant(tid)
        return None, published is not None and (owner is None or published == owner)

    async def attach_reward(self, tid: str, reward: float, *,
                            owner: str | None = DEFAULT_TENANT) -> dict[str, Any]:
        held, mine = await self._owned(tid, owner)
        if not mine:  # another tenant's (no oracle), or unknown
            raise NotFound(f"no trajectory {tid!r} is waiting for a reward",
                           details={"trajectory_id": tid})
        if held is not None and await self._release_held(tid, reward):
            return {"trajectory_id": tid, "reward": reward, "published": True}
        raise FailedPrecondition(
            f"trajectory {tid!r} was published without a reward; end its session with "
            "'await_reward': true to attach one later", details={"trajectory_id": tid})
