"""OpenAI-compatible routes for agent harnesses: ``/v1/chat/completions``,
``/v1/completions``, ``/v1/models``, and the session routes ``/v1/sessions/{id}/end``,
``/v1/trajectories/{id}/reward``. See ``docs/agents.md``."""

from __future__ import annotations

import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from rollout_gateway.api.deps import Sessions, Settings, StartedAt
from rollout_gateway.api.errors import ORJSONResponse
from rollout_gateway.api.security import require_client
from rollout_gateway.engines.decode_toplogprobs import LogprobRows
from rollout_gateway.errors import InvalidArgument, NotFound
from rollout_gateway.rollouts.models import SamplingParams
from rollout_gateway.sessions.manager import Reply
from rollout_gateway.sessions.messages import canonical_messages
from rollout_gateway.sessions.templates import ChatTemplate
from rollout_gateway.settings import GatewaySettings

#: every route here is a client's (``client_api_key``: the openai client sends it as its
#: api_key)
router = APIRouter(tags=["openai"], dependencies=[Depends(require_client)])

_SESSION_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")
#: max_tokens when the caller gives none (chat; completions default to 16 as OpenAI's)
DEFAULT_CHAT_MAX_TOKENS = 1024


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, description="Must be the served model name.")
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    session_id: str | None = Field(default=None, description="Session id (extra_body); the "
                                   "x-session-id header does the same.")
    group_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.:-]{1,200}$",
                                 description="Group of the trajectory (GRPO: sessions of one "
                                 "task); default: the session id.")
    metadata: dict[str, str] | None = Field(default=None, description="Stored with the "
                                            "trajectory (up to 16 keys).")

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v):
        if v is not None and (len(v) > 16 or any(len(k) > 64 or len(x) > 512
                                                 for k, x in v.items())):
            raise ValueError("metadata: at most 16 keys of <= 64 characters, values <= 512")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list) and (len(v) > 16 or not all(isinstance(s, str) and s for s in v)):
            raise ValueError("stop must be up to 16 non-empty strings")
        return v

    def sampling(self, max_new: int, limit: int) -> SamplingParams:
        if self.seed is not None and self.n > 1:
            raise InvalidArgument("seed with n > 1 would give n identical choices (one seed "
                                  "per engine request); send n requests with different seeds")
        if max_new > limit:
            raise InvalidArgument(f"max_tokens={max_new} exceeds the limit of {limit}")
        kw: dict[str, Any] = {"max_new_tokens": max_new}
        for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"),
                             ("stop", "stop"), ("sampling_seed", "seed"),
                             ("presence_penalty", "presence_penalty"),
                             ("frequency_penalty", "frequency_penalty")):
            v = getattr(self, theirs)
            if v is not None:
                kw[ours] = v
        return SamplingParams(**kw)


class ChatCompletionRequest(_Common):
    messages: list[Any]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False


class EndSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: float | None = Field(default=None, description="Outcome reward of the session.")
    await_reward: bool = Field(default=False, description="Without a reward: hold the "
                               "trajectory until POST /v1/trajectories/{id}/reward (bounded "
                               "by session_reward_wait_s).")


class RewardBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: float


def _finite(x: float | None, name: str) -> None:
    if x is not None and not math.isfinite(x):
        raise InvalidArgument(f"{name} must be a finite number")


def _session_id(request: Request, body_sid: str | None) -> str | None:
    hdr = request.headers.get("x-session-id")
    if hdr and body_sid and hdr != body_sid:
        raise InvalidArgument(f"x-session-id header {hdr!r} and session_id {body_sid!r} differ")
    sid = hdr or body_sid
    if sid is not None and not _SESSION_ID.match(sid):
        raise InvalidArgument("session id must be 1-200 characters of A-Z a-z 0-9 _ . : -")
    return sid


def _check_model(settings: GatewaySettings, model: str | None) -> str:
    name = settings.served_model_name
    if model is not None and model != name:
        raise NotFound(f"model {model!r} is not served here (GET /v1/models lists {name!r})")
    return name


def _include_usage(req: _Common) -> bool:
    opts = req.stream_options or {}
    if req.stream_options is not None and not req.stream:
        raise InvalidArgument("stream_options is only allowed with stream: true")
    return bool(opts.get("include_usage"))


def _rollout_info(r: Reply, sid: str | None) -> dict[str, Any]:
    """The gateway's extension of each choice: where the tokens went and how they were made."""
    t = r.turn
    return {"session_id": sid, "trajectory_id": r.trajectory_id, "branch": r.branch,
            "turn": r.turn_index, "branched": r.branched or None,
            "token_ids": r.token_ids, "policy_version": t.tokens.policy_version,
            "kv_version": t.tokens.kv_version, "engine_ids": t.engine_ids,
            "spanning_versions": t.min_version != t.max_version,
            "segments": [{"start": s.start, "end": s.end, "policy_version": s.policy_version,
                          "engine_id": s.engine_id, "began": s.began.value,
                          "ended": s.ended.value} for s in t.segments]}


def _lp(x: Any) -> float:
    """A logprob for JSON: -inf (an engine's null) as OpenAI writes it, -9999.0."""
    return -9999.0 if x is None or not math.isfinite(x) else float(x)


def _alternatives(rows: LogprobRows | list | None, k: int) -> list[list[tuple[int, float]]]:
    """Per token, the engine's top-k alternatives as (id, logprob)."""
    if rows is None:
        return []
    if isinstance(rows, LogprobRows):
        top = rows.cut(k)
        return [[(i, _lp(lp)) for lp, i in zip(lr, ir)]
                for lr, ir in zip(top.logprobs.tolist(), top.ids.tolist())]
    return [[(int(r[1]), _lp(r[0])) for r in (row or [])[:k]] for row in rows]


def _lp_entries(tpl: ChatTemplate, ids: np.ndarray, lps: np.ndarray,
                tops: list[list[tuple[int, float]]] | None = None) -> list[dict[str, Any]]:
    out = []
    for j, (i, lp) in enumerate(zip(ids.tolist(), lps.tolist())):
        alts = tops[j] if tops else []
        out.append({"token": tpl.token_text(i), "logprob": _lp(lp), "bytes": tpl.token_bytes(i),
                    "top_logprobs": [{"token": tpl.token_text(a), "logprob": alp,
                                      "bytes": tpl.token_bytes(a)} for a, alp in alts]})
    return out


def _usage(replies: list[Reply]) -> dict[str, int]:
    p = replies[0].prompt_tokens if replies else 0
    c = sum(len(r.token_ids) for r in replies)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _sse(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _data(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n\n"


def _stops(req: _Common) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


class _Chunks:
    """The frames of one streamed answer; every chunk names it (id, object, created, model)."""

    def __init__(self, rid: str, obj: str, created: int, model: str) -> None:
        self.names = {"id": rid, "object": obj, "created": created, "model": model}

    def __call__(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return _data({**self.names, "choices": choices, **extra})

    def response(self, events: Any, frame: Callable[[dict[str, Any]], bytes | None],
                 include_usage: bool, first: list[bytes] | None = None) -> StreamingResponse:
        """The SSE answer: ``first``, then each delta or reply event as ``frame`` writes it
        (None: nothing to send yet), an error event as an error frame; the usage chunk when
        asked, then ``[DONE]``."""
        stream: AsyncIterator[dict[str, Any]] = events

        async def body() -> AsyncIterator[bytes]:
            for b in first or []:
                yield b
            finals: list[Reply] = []
            async for ev in stream:
                if ev["type"] not in ("delta", "reply"):
                    yield _data({"error": ev["error"]})
                    continue
                if ev["type"] == "reply":
                    finals.append(ev["reply"])
                out = frame(ev)
                if out is not None:
                    yield out
            if include_usage:
                yield self([], usage=_usage(finals))
            yield b"data: [DONE]\n\n"

        return _sse(body())


class _TextStream:
    """Incremental detokenization of one choice: emits text that can no longer change
    (no trailing partial UTF-8, no possible start of a stop string)."""

    def __init__(self, tpl: ChatTemplate, stops: list[str], hold_all: bool) -> None:
        self.tpl = tpl
        self.ids: list[int] = []
        self.sent = ""
        self.stops = [s for s in stops if s]
        self.hold_all = hold_all

    def feed(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        if self.hold_all:
            return ""
        body = [i for i in self.ids if i not in self.tpl.end_ids]
        text = self.tpl.decode(body, skip_special_tokens=True).rstrip("\ufffd")
        text = self._settled(text)
        if len(text) > len(self.sent) and text.startswith(self.sent):
            out, self.sent = text[len(self.sent):], text
            return out
        return ""

    def _settled(self, text: str) -> str:
        """Cut at a complete stop string; hold back a suffix that may begin one."""
        for s in self.stops:
            at = text.find(s)
            if at >= 0:
                text = text[:at]
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return text[:len(text) - hold]

    def finish(self, content: str) -> str:
        if content.startswith(self.sent):
            out, self.sent = content[len(self.sent):], content
            return out
        return ""  # cannot happen with the hold-back; never resend text


# ---- /v1/chat/completions ----

@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request, sessions: Sessions,
                           settings: Settings) -> Response:
    """OpenAI chat completions; with a session id, one turn of that session."""
    model = _check_model(settings, req.model)
    sid = _session_id(request, req.session_id)
    tpl = sessions.template
    k = req.top_logprobs or 0
    if k and not req.logprobs:
        raise InvalidArgument("top_logprobs needs logprobs: true")
    if req.tool_choice not in (None, "auto", "none"):
        raise InvalidArgument("tool_choice must be 'auto' or 'none' (forced calls are not "
                              "supported)")
    include_usage = _include_usage(req)
    messages = canonical_messages(req.messages)
    if req.max_completion_tokens and req.max_tokens and req.max_completion_tokens != req.max_tokens:
        raise InvalidArgument("max_tokens and max_completion_tokens differ")
    max_new = req.max_completion_tokens or req.max_tokens or DEFAULT_CHAT_MAX_TOKENS
    sp = req.sampling(max_new, settings.max_new_tokens_limit)
    parse_tools: bool | int = bool(req.tools) and req.tool_choice != "none"
    if parse_tools and req.parallel_tool_calls is False:
        parse_tools = 1  # at most one call; later blocks stay in the content
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    out = await sessions.call(sid=sid, kind="chat", plan_input=messages, tools=req.tools,
                                 sp=sp, n=req.n, parse_tools=parse_tools, stream=req.stream,
                                 group_id=req.group_id, metadata=req.metadata, top_logprobs=k)
    if not req.stream:
        replies: list[Reply] = out  # type: ignore[assignment]
        choices = []
        for r in replies:
            msg: dict[str, Any] = {"role": "assistant",
                                   "content": r.content if (r.content or not r.tool_calls) else None}
            if r.tool_calls:
                msg["tool_calls"] = r.tool_calls
            choices.append({"index": r.index, "message": msg, "finish_reason": r.finish_reason,
                            "logprobs": {"content": _lp_entries(
                                tpl, r.token_ids, r.logprobs, _alternatives(r.top_logprobs, k))}
                            if req.logprobs else None,
                            "rollout": _rollout_info(r, sid)})
        return ORJSONResponse({"id": rid, "object": "chat.completion", "created": created,
                               "model": model, "choices": choices, "usage": _usage(replies),
                               "session_id": sid})
    chunk = _Chunks(rid, "chat.completion.chunk", created, model)
    streams = [_TextStream(tpl, _stops(req), parse_tools) for _ in range(req.n)]

    def frame(ev: dict[str, Any]) -> bytes | None:
        i = ev["index"]
        if ev["type"] == "delta":
            ids = np.asarray(ev["token_ids"]).tolist()
            text = streams[i].feed(ids)
            # with top_logprobs the entries (and their alternatives) come with the
            # final chunk: the engines' top-k rows arrive when the sample finishes
            lp = ({"content": _lp_entries(tpl, np.asarray(ids), np.asarray(ev["logprobs"]))}
                  if req.logprobs and not k else None)
            if not (text or lp):
                return None
            return chunk([{"index": i, "delta": {"content": text} if text else {},
                           "logprobs": lp, "finish_reason": None}])
        r: Reply = ev["reply"]
        delta: dict[str, Any] = {}
        rest = streams[i].finish(r.content)
        if rest:
            delta["content"] = rest
        if r.tool_calls:
            delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(r.tool_calls)]
        lp = ({"content": _lp_entries(tpl, r.token_ids, r.logprobs,
                                      _alternatives(r.top_logprobs, k))}
              if k else None)
        return chunk([{"index": i, "delta": delta, "logprobs": lp,
                       "finish_reason": r.finish_reason, "rollout": _rollout_info(r, sid)}])

    roles = [chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}]) for i in range(req.n)]
    return chunk.response(out, frame, include_usage, first=roles)


# ---- /v1/completions ----

def _prompt(p: Any) -> str | list[int]:
    if isinstance(p, str):
        if not p:
            raise InvalidArgument("prompt must not be empty")
        return p
    if p and all(isinstance(x, int) for x in p):
        if min(p) < 0:
            raise InvalidArgument("prompt token ids must be non-negative")
        return list(p)
    if len(p) == 1:
        return _prompt(p[0])
    raise InvalidArgument("prompt must be one string or one list of token ids (batches of "
                          "prompts: send one request each)")


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request, sessions: Sessions,
                      settings: Settings) -> Response:
    """OpenAI (legacy) completions over a raw prompt; with a session id, one turn."""
    model = _check_model(settings, req.model)
    sid = _session_id(request, req.session_id)
    if req.echo:
        raise InvalidArgument("echo is not supported")
    include_usage = _include_usage(req)
    prompt = _prompt(req.prompt)
    sp = req.sampling(req.max_tokens or 16, settings.max_new_tokens_limit)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    tpl = sessions.template
    want_lp = req.logprobs is not None
    k = req.logprobs or 0
    out = await sessions.call(sid=sid, kind="completion", plan_input=prompt, tools=None,
                                 sp=sp, n=req.n, parse_tools=False, stream=req.stream,
                                 group_id=req.group_id, metadata=req.metadata, top_logprobs=k)

    def lp_obj(ids: np.ndarray, lps: np.ndarray, rows: list | None = None) -> dict[str, Any]:
        toks = [tpl.token_text(i) for i in ids.tolist()]
        offs, o = [], 0
        for t in toks:
            offs.append(o)
            o += len(t)
        tops = None
        if k:
            tops = [{tpl.token_text(a): alp for a, alp in alts}
                    for alts in _alternatives(rows, k)]
        return {"tokens": toks, "token_logprobs": [_lp(x) for x in lps.tolist()],
                "top_logprobs": tops, "text_offset": offs}

    if not req.stream:
        replies: list[Reply] = out  # type: ignore[assignment]
        return ORJSONResponse({
            "id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": r.index, "text": r.content, "finish_reason": r.finish_reason,
                         "logprobs": lp_obj(r.token_ids, r.logprobs, r.top_logprobs)
                         if want_lp else None,
                         "rollout": _rollout_info(r, sid)} for r in replies],
            "usage": _usage(replies), "session_id": sid})
    chunk = _Chunks(rid, "text_completion", created, model)
    streams = [_TextStream(tpl, _stops(req), False) for _ in range(req.n)]

    def frame(ev: dict[str, Any]) -> bytes | None:
        i = ev["index"]
        if ev["type"] == "delta":
            ids = np.asarray(ev["token_ids"])
            text = streams[i].feed(ids.tolist())
            if not (text or (want_lp and not k)):
                return None
            return chunk([{"index": i, "text": text, "finish_reason": None,
                           "logprobs": lp_obj(ids, np.asarray(ev["logprobs"]))
                           if want_lp and not k else None}])
        r: Reply = ev["reply"]
        return chunk([{"index": i, "text": streams[i].finish(r.content),
                       "finish_reason": r.finish_reason,
                       "logprobs": lp_obj(r.token_ids, r.logprobs, r.top_logprobs)
                       if k else None, "rollout": _rollout_info(r, sid)}])

    return chunk.response(out, frame, include_usage)


# ---- models, sessions, rewards ----

@router.get("/v1/models")
async def list_models(settings: Settings, started_at: StartedAt) -> Response:
    return ORJSONResponse({"object": "list", "data": [
        {"id": settings.served_model_name, "object": "model", "created": int(started_at),
         "owned_by": "rollout-gateway"}]})


@router.get("/v1/models/{model_id}")
async def get_model(model_id: str, settings: Settings, started_at: StartedAt) -> Response:
    _check_model(settings, model_id)
    return ORJSONResponse({"id": model_id, "object": "model", "created": int(started_at),
                           "owned_by": "rollout-gateway"})


@router.post("/v1/sessions/{session_id}/end")
async def end_session(session_id: str, request: Request, sessions: Sessions) -> Response:
    """End a session: its trajectory (current branch) is published, with the reward if
    given; ``await_reward`` holds it for POST /v1/trajectories/{id}/reward instead."""
    raw = await request.body()
    try:
        body = EndSession.model_validate_json(raw) if raw.strip() else EndSession()
    except ValueError as exc:
        raise InvalidArgument(f"invalid body: {exc}") from None
    _finite(body.reward, "reward")
    return ORJSONResponse(await sessions.end(session_id, body.reward, body.await_reward))


@router.post("/v1/trajectories/{trajectory_id}/reward")
async def trajectory_reward(trajectory_id: str, body: RewardBody,
                            sessions: Sessions) -> Response:
    """Attach a reward to a session trajectory held with ``await_reward``; publishes it."""
    _finite(body.reward, "reward")
    return ORJSONResponse(await sessions.attach_reward(trajectory_id, body.reward))

