"""A session's branch as an append-only list of records, so any gateway replica can
rebuild it from the session store.

A branch is one :class:`BranchStart` (its prompt, what it inherits from the branch it
forked from) followed by one :class:`TurnRecord` per model call (the context tokens the
call read, its stamped tokens, what the next request is matched against). :func:`apply`
turns records into the :class:`~rollout_gateway.sessions.session.Branch` the manager
works on; the replica that ran a call applies the same record it stores, so every replica
rebuilds the same branch.

Per turn only what the turn added is stored: the context ids, the call's own columns
(the trajectory codec, no prompt), the new messages and the rendered prompt's new text.
:func:`encode` / :func:`decode` frame a record as bytes for a shared store (JSON facts,
then raw little-endian arrays; no per-token objects).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import orjson

from rollout_gateway.core import trajectory_codec
from rollout_gateway.core.trajectory import Trajectory
from rollout_gateway.errors import InvalidArgument
from rollout_gateway.sessions.session import Branch, Call

_MAGIC = b"RGS1"
_HEAD = struct.Struct("<4sI")


@dataclass
class BranchStart:
    """A new branch: its prompt and what it keeps of the branch it forked from."""

    trajectory_id: str
    index: int
    prompt_ids: np.ndarray  # int32
    tools: Any = None
    calls: list[Call] = field(default_factory=list)  # earlier calls still matchable
    messages: list[dict[str, Any]] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)  # branched_from / branch_reason
    created_at: float = 0.0


@dataclass
class TurnRecord:
    """One model call appended to the branch."""

    context_ids: np.ndarray  # int32, read by the call before its model tokens
    turn: Trajectory  # the call's stamped model tokens (its prompt may be left out)
    prompt_len: int  # tokens of the call's engine input
    n_messages: int  # chat: messages of the request (before the reply)
    prompt_keep: int  # characters of the previous call's prompt_text this one starts with
    prompt_rest: str  # the rest of this call's prompt_text
    content: str  # the reply's text
    keep_messages: int  # messages of the branch kept before ``new_messages``
    new_messages: list[dict[str, Any]]  # the request's new messages and the reply
    group_id: str = ""
    metadata: dict[str, str] = field(default_factory=dict)  # the caller's, this call


Record = BranchStart | TurnRecord


def turn_record(branch: Branch, context_ids: list[int], turn: Trajectory, *, kind: str,
                plan_input: Any, prompt_text: str, content: str, reply_msg: dict[str, Any],
                group_id: str, metadata: dict[str, str]) -> TurnRecord:
    """The record of a call about to be appended to ``branch``."""
    prev = branch.calls[-1].prompt_text if branch.calls else ""
    keep = len(prev) if prev and prompt_text.startswith(prev) else 0
    if kind == "chat":
        msgs = list(plan_input)
        old = branch.messages
        k = len(old) if msgs[:len(old)] == old else 0
        new = msgs[k:] + [reply_msg]
        n_messages = len(msgs)
    else:
        k, new, n_messages = 0, [], 0
    return TurnRecord(context_ids=np.asarray(context_ids, np.int32), turn=turn,
                      prompt_len=int(turn.prompt_token_ids.shape[0]), n_messages=n_messages,
                      prompt_keep=keep, prompt_rest=prompt_text[keep:], content=content,
                      keep_messages=k, new_messages=new, group_id=group_id,
                      metadata=dict(metadata))


def apply(branch: Branch | None, rec: Record) -> Branch:
    """``rec`` applied: a BranchStart makes a new branch, a TurnRecord extends ``branch``."""
    if isinstance(rec, BranchStart):
        return Branch(trajectory_id=rec.trajectory_id, index=rec.index,
                      prompt_ids=np.asarray(rec.prompt_ids, np.int32), tools=rec.tools,
                      messages=list(rec.messages), calls=list(rec.calls),
                      metadata=dict(rec.metadata), created_at=rec.created_at)
    if branch is None:
        raise InvalidArgument("a session turn record without its branch")
    prev = branch.calls[-1].prompt_text if branch.calls else ""
    branch.add_turn(rec.context_ids.tolist(), rec.turn, prompt_len=rec.prompt_len)
    branch.group_id = rec.group_id
    branch.metadata.update(rec.metadata)
    branch.messages = branch.messages[:rec.keep_messages] + list(rec.new_messages)
    seq_len = int(branch.prompt_ids.shape[0]) + branch.output_len
    branch.calls.append(Call(rec.n_messages, prev[:rec.prompt_keep] + rec.prompt_rest, seq_len,
                             rec.turn.tokens.token_ids.copy(), rec.content))
    return branch


# ---- bytes (shared stores) ----

def _frame(facts: dict[str, Any], blobs: list[bytes]) -> bytes:
    facts["blobs"] = [len(b) for b in blobs]
    head = orjson.dumps(facts)
    return b"".join([_HEAD.pack(_MAGIC, len(head)), head, *blobs])


def _unframe(data: bytes) -> tuple[dict[str, Any], list[memoryview]]:
    try:
        magic, n = _HEAD.unpack_from(data, 0)
        if magic != _MAGIC:
            raise ValueError("not a session record")
        facts = orjson.loads(data[_HEAD.size:_HEAD.size + n])
        view = memoryview(data)[_HEAD.size + n:]
        blobs, at = [], 0
        for size in facts["blobs"]:
            blobs.append(view[at:at + size])
            at += size
        if at != len(view):
            raise ValueError("trailing bytes")
        return facts, blobs
    except (struct.error, ValueError, KeyError, TypeError, orjson.JSONDecodeError) as exc:
        raise InvalidArgument(f"malformed session record: {exc}") from None


def _ids(b: memoryview) -> np.ndarray:
    return np.frombuffer(b, dtype="<i4").astype(np.int32)


def encode(rec: Record) -> bytes:
    if isinstance(rec, BranchStart):
        blobs = [rec.prompt_ids.astype("<i4").tobytes()]
        calls = []
        for c in rec.calls:
            calls.append([c.n_messages, c.prompt_text, c.seq_len, c.content])
            blobs.append(np.asarray(c.model_ids).astype("<i4").tobytes())
        return _frame({"k": "start", "tid": rec.trajectory_id, "index": rec.index,
                       "tools": rec.tools, "calls": calls, "messages": rec.messages,
                       "metadata": rec.metadata, "created_at": rec.created_at}, blobs)
    # the call's engine input is the branch's sequence: stored once, in the branch
    turn = replace(rec.turn, prompt_token_ids=np.zeros(0, np.int32))
    return _frame({"k": "turn", "prompt_len": rec.prompt_len, "n_messages": rec.n_messages,
                   "prompt_keep": rec.prompt_keep, "prompt_rest": rec.prompt_rest,
                   "content": rec.content, "keep_messages": rec.keep_messages,
                   "new_messages": rec.new_messages, "group_id": rec.group_id,
                   "metadata": rec.metadata},
                  [rec.context_ids.astype("<i4").tobytes(), trajectory_codec.encode(turn)])


def decode(data: bytes) -> Record:
    f, blobs = _unframe(data)
    try:
        if f["k"] == "start":
            calls = [Call(int(n), str(p), int(s), _ids(b), str(c))
                     for (n, p, s, c), b in zip(f["calls"], blobs[1:], strict=True)]
            return BranchStart(trajectory_id=f["tid"], index=int(f["index"]),
                               prompt_ids=_ids(blobs[0]), tools=f["tools"], calls=calls,
                               messages=f["messages"], metadata=f["metadata"],
                               created_at=float(f["created_at"]))
        return TurnRecord(context_ids=_ids(blobs[0]),
                          turn=trajectory_codec.decode(bytes(blobs[1])),
                          prompt_len=int(f["prompt_len"]), n_messages=int(f["n_messages"]),
                          prompt_keep=int(f["prompt_keep"]), prompt_rest=f["prompt_rest"],
                          content=f["content"], keep_messages=int(f["keep_messages"]),
                          new_messages=f["new_messages"], group_id=f["group_id"],
                          metadata=f["metadata"])
    except (KeyError, ValueError, TypeError, IndexError) as exc:
        raise InvalidArgument(f"malformed session record: {exc}") from None
