"""Agent sessions over the rollout machinery: each OpenAI-style call is one engine request
run by :class:`~rollout_gateway.rollouts.rollout.RolloutService` (admission, the staleness
policy, failover, swaps, stamping), then appended to its session's branch; a session is
published when it ends (``end``, idle timeout, a new branch, shutdown)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_gateway.aio import Periodic
from rollout_gateway.core.staleness import is_stale, lag
from rollout_gateway.core.trajectory import Trajectory, Transition
from rollout_gateway.engines.decode_toplogprobs import LogprobRows
from rollout_gateway.engines.pool import Engine
from rollout_gateway.errors import (
    FailedPrecondition,
    GatewayError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from rollout_gateway.rollouts.models import RolloutRequest, SamplingParams
from rollout_gateway.rollouts.rollout import RolloutService
from rollout_gateway.rollouts.sample import PREFERRED_ENGINE, PassThrough
from rollout_gateway.sessions.messages import assistant_message
from rollout_gateway.sessions.session import Branch, Call, Plan, plan_chat, plan_completion
from rollout_gateway.sessions.templates import ChatTemplate, load_template, parse_tool_calls
from rollout_gateway.settings import GatewaySettings

log = logging.getLogger(__name__)

#: ended session ids / published trajectory ids remembered (for clear 409s)
_REMEMBER = 100_000


@dataclass
class Session:
    session_id: str
    branch: Branch | None = None
    branches: int = 0
    last_active: float = field(default_factory=time.monotonic)
    busy: bool = False
    published: list[str] = field(default_factory=list)
    group_id: str | None = None


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
    """Sessions by id, their branches, held-for-reward trajectories, the idle sweeper."""

    def __init__(self, settings: GatewaySettings, rollouts: RolloutService, *,
                 learner_version: Callable[[], Awaitable[int]],
                 engines: Callable[[], list[Engine]],
                 publish: Callable[[Trajectory], Awaitable[Any]]) -> None:
        self.settings = settings
        self.rollouts = rollouts  # runs each call (admission, staleness, failover, stamping)
        self.learner_version = learner_version  # the registry's
        self.engines = engines  # the pool's engines (follow-up turns prefer the last one)
        self.publish = publish  # the store's: a session's trajectory when it ends
        s = settings
        self.template: ChatTemplate = load_template(s.chat_template)
        self.idle_timeout = s.session_idle_timeout_s
        self.reward_wait = s.session_reward_wait_s
        self.max_sessions = s.max_sessions
        self.sessions: dict[str, Session] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()  # session id -> how it ended
        self.held: dict[str, tuple[Trajectory, float]] = {}  # awaiting a reward
        self.published: OrderedDict[str, None] = OrderedDict()
        self.counters = {"session_calls": 0, "sessions_started": 0, "sessions_ended": 0,
                         "sessions_idle_ended": 0, "session_branches": 0,
                         "session_trajectories_published": 0, "session_publish_failed": 0,
                         "session_stale_dropped": 0, "rewards_attached": 0,
                         "rewards_missing": 0}
        period = max(0.05, min(self.idle_timeout, self.reward_wait) / 4)
        self._sweeper = Periodic(self.sweep, period, what="session sweep", log=log, trace=True)
        self._pumps: set[asyncio.Task[None]] = set()

    # ---- lifecycle ----

    def start(self) -> None:
        self._sweeper.start()

    async def stop(self) -> None:
        """Publish what is open (ended_by ``shutdown``) and what waits for a reward."""
        await self._sweeper.stop()
        for sid in list(self.sessions):
            with contextlib.suppress(GatewayError):
                await self._end(sid, "shutdown", None, await_reward=False)
        for tid in list(self.held):
            with contextlib.suppress(GatewayError):
                await self._release_held(tid, None)

    async def sweep(self) -> None:
        now = time.monotonic()
        for sid, s in list(self.sessions.items()):
            if not s.busy and now - s.last_active >= self.idle_timeout:
                try:
                    await self._end(sid, "idle_timeout", None, await_reward=False)
                    self.counters["sessions_idle_ended"] += 1
                except GatewayError as exc:
                    log.error("session %s: idle end failed: %s", sid, exc.message)
        for tid, (_t, deadline) in list(self.held.items()):
            if now >= deadline:
                with contextlib.suppress(GatewayError):
                    await self._release_held(tid, None)

    # ---- calls ----

    def _session(self, sid: str | None) -> Session | None:
        if sid is None:
            return None
        if sid in self.ended:
            raise FailedPrecondition(f"session {sid!r} has ended ({self.ended[sid]}); start a "
                                     "new session id", details={"session_id": sid})
        s = self.sessions.get(sid)
        if s is None:
            if len(self.sessions) >= self.max_sessions:
                raise ResourceExhausted(f"{self.max_sessions} sessions are open (max_sessions); "
                                        "end some first")
            s = self.sessions[sid] = Session(sid)
            self.counters["sessions_started"] += 1
        if s.busy:
            raise FailedPrecondition(f"session {sid!r} already has a call in flight; a session's "
                                     "turns are sequential", details={"session_id": sid})
        return s

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
                   top_logprobs: int = 0) -> list[Reply] | AsyncIterator[dict[str, Any]]:
        """One chat (``kind='chat'``, ``plan_input`` = canonical messages) or completion
        (``plan_input`` = prompt text or ids) call. ``parse_tools``: False, True, or the
        most tool calls to parse (1 for ``parallel_tool_calls: false``). With ``stream``, an async iterator of
        ``{"type": "delta" | "reply" | "error", ...}`` events (errors before the first
        event raise here)."""
        s = self._session(sid)
        if s is not None and n != 1:
            raise InvalidArgument("n > 1 in a session: a session continues one reply; use n=1 "
                                  "or leave out the session id")
        if s is not None and group_id is not None:
            if s.group_id is not None and s.group_id != group_id:
                raise InvalidArgument(f"session {sid!r} is in group {s.group_id!r}, not "
                                      f"{group_id!r}")
            s.group_id = group_id
        # top-k alternatives: the engines' own rows, forwarded (SGLang's top_logprobs_num)
        pt = PassThrough(top_logprobs_num=top_logprobs) if top_logprobs > 0 else None
        tag = {"group_id": (s.group_id if s is not None else group_id) or "",
               "metadata": dict(metadata or {}), "passthrough": pt}
        if kind == "chat":
            plan = plan_chat(self.template, s.branch if s else None, plan_input, tools)
        else:
            plan = plan_completion(self.template, s.branch if s else None, plan_input)
        input_ids, extends = self._prepare(s, plan)
        req = self._request(input_ids, sp, n, sid, {"api": kind})
        self.rollouts.validate(req)
        self.counters["session_calls"] += 1
        if s is not None:
            s.busy = True
            s.last_active = time.monotonic()
        try:
            # the sample tasks (created inside run_with_text / open_stream) inherit it
            token = PREFERRED_ENGINE.set(await self._preferred_engine(extends))
            try:
                if not stream:
                    pairs = await self.rollouts.run_with_text(req, pt)
                else:
                    events = await self.rollouts.open_stream(req, pt)
            finally:
                PREFERRED_ENGINE.reset(token)
            if not stream:
                return [await self._record(s, plan, extends, kind, plan_input, tools, i, t,
                                           parse_tools, tag) for i, (t, _text) in enumerate(pairs)]
        except BaseException:
            if s is not None:
                s.busy = False
                s.last_active = time.monotonic()
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
                    s.busy = False
                    s.last_active = time.monotonic()
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
        finally:
            if s is not None:
                s.busy = False
                s.last_active = time.monotonic()

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
        if extends is not None:
            branch = extends
            branch.add_turn(list(plan.context_ids), turn)
        else:
            if s is not None and s.branch is not None:
                old = s.branch
            prefix = turn.prompt_token_ids
            bi = s.branches if s is not None else 0
            tid = f"{s.session_id}.b{bi}" if s is not None else f"call-{uuid.uuid4().hex}"
            branch = Branch(trajectory_id=tid, index=bi, prompt_ids=np.array(prefix, np.int32),
                            tools=tools)
            if old is not None and plan.prefix_len:
                # earlier calls of the prefix stay matchable in the new branch
                branch.calls = [c for c in old.calls if c.seq_len <= plan.prefix_len]
                branch.messages = list(old.messages[:branch.calls[-1].n_messages + 1]) \
                    if branch.calls and kind == "chat" else []
            branch.add_turn([], turn)
            if old is not None:
                branched = plan.reason or "history_edited"
                branch.metadata["branched_from"] = old.trajectory_id
                branch.metadata["branch_reason"] = branched
                self.counters["session_branches"] += 1
            if s is not None:
                s.branch = branch
                s.branches += 1
        branch.group_id = tag["group_id"]
        branch.metadata.update({k: v for k, v in tag["metadata"].items()  # the caller's
                                if k not in ("branched_from", "branch_reason")})
        seq_len = int(branch.prompt_ids.shape[0]) + branch.output_len
        reply_msg = assistant_message(content, calls)
        if kind == "chat":
            branch.messages = list(plan_input) + [reply_msg]
            branch.calls.append(Call(len(plan_input), plan.prompt_text, seq_len, ids.copy(), content))
        else:
            branch.calls.append(Call(0, plan.prompt_text, seq_len, ids.copy(), content))
        pt = tag["passthrough"]
        reply = Reply(index=index, content=content, tool_calls=calls, finish_reason=finish,
                      token_ids=ids, logprobs=turn.tokens.logprobs, turn=turn,
                      trajectory_id=branch.trajectory_id, branch=branch.index,
                      turn_index=len(branch.calls) - 1,
                      prompt_tokens=int(turn.prompt_token_ids.shape[0]), branched=branched,
                      top_logprobs=pt.out.get(index, {}).get("output_top_logprobs")
                      if pt is not None else None)
        if old is not None:  # the superseded branch is finished: publish it
            await self._publish(old, s.session_id, "branch", None, await_reward=False)
        if s is None:
            await self._publish(branch, branch.trajectory_id, "single_call", None,
                                await_reward=False)
        return reply

    # ---- ending and rewards ----

    async def _publish(self, branch: Branch, session_id: str, ended_by: str,
                       reward: float | None, *, await_reward: bool) -> dict[str, Any]:
        traj = branch.trajectory(session_id=session_id, ended_by=ended_by, reward=reward,
                                 template=self.template.name)
        out = {"trajectory_id": traj.trajectory_id, "num_tokens": traj.num_tokens,
               "turns": len(branch.calls), "branch": branch.index}
        if branch.stale_verdict == "drop":
            self.counters["session_stale_dropped"] += 1
            return {**out, "published": False,
                    "reason": "a turn fell outside the staleness bound (stale policy: drop)"}
        if await_reward and reward is None:
            self.held[traj.trajectory_id] = (traj, time.monotonic() + self.reward_wait)
            return {**out, "published": False, "awaiting_reward": True,
                    "reward_wait_s": self.reward_wait}
        await self._store(traj)
        return {**out, "published": True}

    async def _store(self, traj: Trajectory) -> None:
        try:
            await self.publish(traj)
        except GatewayError:
            self.counters["session_publish_failed"] += 1
            raise
        self.counters["session_trajectories_published"] += 1
        self.published[traj.trajectory_id] = None
        while len(self.published) > _REMEMBER:
            self.published.popitem(last=False)

    async def _release_held(self, tid: str, reward: float | None) -> None:
        traj, _ = self.held.pop(tid)
        if reward is None:
            traj.metadata["reward"] = "missing"
            self.counters["rewards_missing"] += 1
        else:
            traj.reward = reward
            self.counters["rewards_attached"] += 1
        try:
            await self._store(traj)
        except GatewayError:
            self.held[tid] = (traj, time.monotonic() + self.reward_wait)  # kept, retried
            raise

    async def _end(self, sid: str, how: str, reward: float | None, *, await_reward: bool
                   ) -> dict[str, Any]:
        s = self.sessions.get(sid)
        if s is None:
            if sid in self.ended:
                raise FailedPrecondition(f"session {sid!r} has already ended ({self.ended[sid]})",
                                         details={"session_id": sid})
            raise NotFound(f"no session {sid!r}", details={"session_id": sid})
        if s.busy:
            raise FailedPrecondition(f"session {sid!r} has a call in flight; end it after the "
                                     "call returns", details={"session_id": sid})
        result: dict[str, Any] = {"session_id": sid, "ended_by": how}
        if s.branch is not None:
            result.update(await self._publish(s.branch, sid, how, reward,
                                              await_reward=await_reward))
        else:
            result.update({"published": False, "reason": "the session had no model call"})
        del self.sessions[sid]
        self.ended[sid] = how
        while len(self.ended) > _REMEMBER:
            self.ended.popitem(last=False)
        self.counters["sessions_ended"] += 1
        return result

    async def end(self, sid: str, reward: float | None, await_reward: bool) -> dict[str, Any]:
        return await self._end(sid, "end", reward, await_reward=await_reward)

    async def attach_reward(self, tid: str, reward: float) -> dict[str, Any]:
        if tid in self.held:
            await self._release_held(tid, reward)
            return {"trajectory_id": tid, "reward": reward, "published": True}
        if tid in self.published:
            raise FailedPrecondition(
                f"trajectory {tid!r} was published without a reward; end its session with "
                "'await_reward': true to attach one later", details={"trajectory_id": tid})
        raise NotFound(f"no trajectory {tid!r} is waiting for a reward",
                       details={"trajectory_id": tid})
