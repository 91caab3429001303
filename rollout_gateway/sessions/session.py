"""One agent session: its token sequence, stamped, assembled turn by turn (no I/O).

A session is a sequence of *branches*; each branch is one trajectory. A branch's
``prompt_token_ids`` are the tokens before the model's first output; its output columns
are every token after, in order: the model's tokens exactly as the engine produced them
(loss mask 1) and the *context* tokens between them (loss mask 0: chat-template tokens,
user / tool / environment messages). ``turns`` tile the output: context, model, context,
model, ... Context tokens carry the policy / KV version of the engine request that read
them (they were prefilled by it), logprob 0 and entropy 0; their segments are marked
``context``.

Each new request is matched against the branch (:func:`plan_chat`,
:func:`plan_completion`). If the request extends the stored history, only the text the
template adds after the model's last output is tokenized (the model's ids are never
re-tokenized). If the harness edited earlier history, the session starts a new branch
from the longest stored prefix the request still agrees with (or from scratch), says so
in the response and counts it: never a silent re-tokenization.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_gateway.core.stamping import stitch_routing
from rollout_gateway.core.trajectory import (
    EntropyKind,
    FinishReason,
    RoutedExperts,
    Segment,
    TokenColumns,
    Trajectory,
    Transition,
    Turn,
)
from rollout_gateway.errors import EngineError
from rollout_gateway.sessions.templates import ChatTemplate

_KIND_RANK = {EntropyKind.EXACT: 0, EntropyKind.TOPK_ESTIMATE: 1, EntropyKind.NONE: 2}
_VERDICT_RANK = {"": 0, "accept": 0, "mask": 1, "drop": 2}


@dataclass(slots=True)
class Call:
    """What one model call of a branch left behind (to match the next request against)."""

    n_messages: int  # chat: messages of the request (before the reply)
    prompt_text: str  # chat: the rendered prompt (with generation prompt); completion: prompt
    seq_len: int  # prompt + output tokens of the branch after this call's model tokens
    model_ids: np.ndarray
    content: str  # what the gateway returned as the reply's text


@dataclass
class Plan:
    """How the next request maps onto the session's tokens."""

    kind: str  # "new" (first call / no session) | "continue" | "branch"
    prefix_len: int  # tokens of the current branch kept (branch: become the new prompt)
    context_ids: list[int]  # tokens to append before the model generates
    prompt_text: str = ""
    reason: str = ""  # branch: why


@dataclass
class Branch:
    """One trajectory of a session, growing turn by turn."""

    trajectory_id: str
    index: int
    prompt_ids: np.ndarray
    tools: Any = None
    messages: list[dict[str, Any]] = field(default_factory=list)  # canonical, incl. replies
    calls: list[Call] = field(default_factory=list)
    cols: list[TokenColumns] = field(default_factory=list)
    mask: list[np.ndarray] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    routing: list[tuple[int, np.ndarray | None]] = field(default_factory=list)
    num_experts: int = 0
    entropy_kind: EntropyKind = EntropyKind.EXACT
    entropy_bound: float = 0.0
    finish: FinishReason | None = None
    created_at: float = field(default_factory=time.time)
    metadata: dict[str, str] = field(default_factory=dict)
    stale_verdict: str = ""
    stale_ranges: list[str] = field(default_factory=list)
    output_len: int = 0
    group_id: str = ""  # the caller's group (GRPO); default: the session id

    def sequence(self) -> np.ndarray:
        return np.concatenate([self.prompt_ids, *(c.token_ids for c in self.cols)]).astype(np.int32)

    def add_turn(self, context_ids: list[int], turn: Trajectory, *,
                 prompt_len: int | None = None) -> None:
        """Append context tokens (read by this call) and the call's stamped model tokens.
        ``prompt_len``: the call's input length when ``turn`` comes without its prompt
        (rebuilt from the session store)."""
        seq_len = int(self.prompt_ids.shape[0]) + self.output_len
        plen = int(turn.prompt_token_ids.shape[0]) if prompt_len is None else prompt_len
        if plen != seq_len + len(context_ids):
            raise EngineError(f"turn prompt has {plen} tokens, the "
                              f"session expected {seq_len + len(context_ids)}")
        k = len(self.calls)
        o = self.output_len
        c = len(context_ids)
        segs = turn.segments
        v = segs[0].policy_version if segs else -1
        if len(turn.tokens):
            v = int(turn.tokens.kv_version[0])  # the version that prefilled the context
        if c:
            z = np.zeros(c, np.float32)
            vv = np.full(c, v, np.int32)
            self.cols.append(TokenColumns(np.asarray(context_ids, np.int32), z, z, vv, vv))
            self.mask.append(np.zeros(c, np.uint8))
            self.turns.append(Turn(o, o + c, "context", k))
            self.segments.append(Segment(o, o + c, v, segs[0].engine_id if segs else "",
                                         began=Transition.CONTEXT, ended=Transition.CONTEXT,
                                         started_at=segs[0].started_at if segs else 0.0,
                                         ended_at=segs[0].started_at if segs else 0.0))
        base = o + c
        n = len(turn.tokens)
        self.cols.append(turn.tokens)
        self.mask.append(np.ones(n, np.uint8))
        self.turns.append(Turn(base, base + n, "model", k))
        for s in segs:
            self.segments.append(Segment(s.start + base, s.end + base, s.policy_version,
                                         s.engine_id, s.began, s.ended, s.started_at,
                                         s.ended_at))
        re = turn.routed_experts
        self.routing.append((plen,
                             re.data if re is not None and re.start == 0 else None))
        if re is not None:
            self.num_experts = max(self.num_experts, re.num_experts)
        if _KIND_RANK[turn.entropy_kind] > _KIND_RANK[self.entropy_kind]:
            self.entropy_kind = turn.entropy_kind
        self.entropy_bound = max(self.entropy_bound, turn.entropy_error_bound)
        self.finish = turn.finish_reason
        verdict = turn.metadata.get("stale_verdict", "")
        if _VERDICT_RANK.get(verdict, 0) > _VERDICT_RANK.get(self.stale_verdict, 0):
            self.stale_verdict = verdict
        for r in filter(None, turn.metadata.get("stale_masked_tokens", "").split(",")):
            a, b = (int(x) for x in r.split("-"))
            self.stale_ranges.append(f"{a + base}-{b + base}")
        self.output_len = base + n

    def trajectory(self, *, session_id: str, ended_by: str, reward: float | None,
                   template: str) -> Trajectory:
        """The branch as one tagged trajectory (what gets published)."""
        routed = None
        rows = stitch_routing(self.routing)
        if rows is not None and self.num_experts:
            routed = RoutedExperts(data=rows, num_experts=self.num_experts)
        md = dict(self.metadata)
        md.update({"session_id": session_id, "session_branch": str(self.index),
                   "session_turns": str(len(self.calls)), "session_ended_by": ended_by,
                   "chat_template": template})
        if self.stale_verdict and self.stale_verdict != "accept":
            md["stale_verdict"] = self.stale_verdict
        if self.stale_ranges:
            md["stale_masked_tokens"] = ",".join(self.stale_ranges)
        return Trajectory(
            trajectory_id=self.trajectory_id, prompt_token_ids=self.prompt_ids,
            tokens=TokenColumns.concat(self.cols), segments=list(self.segments),
            finish_reason=self.finish or FinishReason(type="abort", message="no model turn"),
            group_id=self.group_id or session_id, entropy_kind=self.entropy_kind,
            entropy_error_bound=self.entropy_bound if self.entropy_kind is EntropyKind.TOPK_ESTIMATE else 0.0,
            routed_experts=routed, created_at=self.created_at, finished_at=time.time(),
            metadata=md, reward=reward,
            loss_mask=np.concatenate(self.mask) if self.mask else np.zeros(0, np.uint8),
            turns=list(self.turns))


# ---- matching a request against the stored branch ----

def _after_reply(template: ChatTemplate, call: Call, rendered: str) -> str | None:
    """``rendered`` is the template's text from the end of ``call``'s prompt on: the reply as
    the template writes it, then what follows. Return the text after the model's own
    tokens, or None if the template's text cannot be lined up with them.

    The model's tokens are kept; the reply's end is found at the template's end-of-turn
    token. If the model sampled that token, the context starts after it; if it stopped
    otherwise (length, a stop string), the template's end-of-turn token is context."""
    ids = call.model_ids
    last = int(ids[-1]) if len(ids) else None
    ended = last is not None and last in template.end_ids
    end_text = template.token_text(last) if ended else (
        template.token_text(min(template.end_ids)) if template.end_ids else "")
    if not end_text:
        return None
    model_text = template.decode(ids, skip_special_tokens=False)
    if rendered.startswith(model_text):  # the template writes the reply as the model did
        return rendered[len(model_text):] if ended or not model_text.endswith(end_text) else None
    at = rendered.find(end_text)
    if at < 0:
        return None
    return rendered[at + len(end_text):] if ended else rendered[at:]


def plan_chat(template: ChatTemplate, branch: Branch | None, messages: list[dict[str, Any]],
              tools: Any) -> Plan:
    full = template.render(messages, tools=tools, add_generation_prompt=True)
    if branch is None or not branch.calls:
        return Plan("new", 0, template.encode(full), full)
    reason = "history_edited"
    if tools != branch.tools:
        reason = "tools_changed"
    else:
        for j in range(len(branch.calls) - 1, -1, -1):
            call = branch.calls[j]
            stored = branch.messages[:call.n_messages + 1]  # the request + our reply
            if messages[:len(stored)] != stored:
                continue
            if not full.startswith(call.prompt_text):
                reason = "template_not_prefix_stable"
                break
            rest = _after_reply(template, call, full[len(call.prompt_text):])
            if rest is None:
                reason = "reply_not_in_template_output"
                break
            kind = "continue" if j == len(branch.calls) - 1 else "branch"
            return Plan(kind, call.seq_len, template.encode(rest), full,
                        "" if kind == "continue" else "history_edited")
    return Plan("branch", 0, template.encode(full), full, reason)


def plan_completion(template: ChatTemplate, branch: Branch | None, prompt: str | list[int]
                    ) -> Plan:
    """``/v1/completions``: a text prompt must extend prompt + reply text of a stored call;
    a token-id prompt must extend its token sequence."""
    text = prompt if isinstance(prompt, str) else ""
    ids_prompt = None if isinstance(prompt, str) else list(prompt)
    if branch is None or not branch.calls:
        return Plan("new", 0, template.encode(text) if ids_prompt is None else ids_prompt, text)
    seq = branch.sequence()
    for j in range(len(branch.calls) - 1, -1, -1):
        call = branch.calls[j]
        if ids_prompt is not None:
            head = seq[:call.seq_len].tolist()
            if call.prompt_text or ids_prompt[:len(head)] != head:
                continue
            ctx = ids_prompt[len(head):]
        else:
            head_text = call.prompt_text + call.content
            if not call.prompt_text and call.seq_len or not text.startswith(head_text):
                continue
            ctx = template.encode(text[len(head_text):])
        kind = "continue" if j == len(branch.calls) - 1 else "branch"
        return Plan(kind, call.seq_len, ctx, text, "" if kind == "continue" else "history_edited")
    return Plan("branch", 0, template.encode(text) if ids_prompt is None else ids_prompt, text,
                "history_edited")
