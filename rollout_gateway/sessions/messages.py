"""OpenAI chat messages: validated once, turned into one canonical form.

The canonical form (plain dicts: ``role``, ``content`` str, and ``tool_calls`` /
``tool_call_id`` / ``name`` when present) is what templates render and what a session
compares with the history it stored, so formatting differences that do not change the
conversation (``content`` as text parts, key order in tool-call arguments, ``null`` vs
absent fields) never count as an edit of the history.
"""

from __future__ import annotations

import json
from typing import Any

from rollout_gateway.errors import InvalidArgument

ROLES = ("system", "developer", "user", "assistant", "tool")


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise InvalidArgument(f"{where}.content[{i}]: only text parts "
                                      "({'type': 'text', 'text': ...}) are supported")
            parts.append(p["text"])
        return "".join(parts)
    raise InvalidArgument(f"{where}.content must be a string or a list of text parts")


def _arguments(args: Any, where: str) -> str:
    """Tool-call arguments as a JSON string with sorted keys (so equal calls compare equal)."""
    if isinstance(args, str):
        try:
            return json.dumps(json.loads(args), sort_keys=True, ensure_ascii=False)
        except ValueError:
            return args  # not JSON: kept verbatim (the template renders it as given)
    if isinstance(args, dict):
        return json.dumps(args, sort_keys=True, ensure_ascii=False)
    raise InvalidArgument(f"{where}.function.arguments must be a JSON string")


def canonical_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list) or not calls:
        raise InvalidArgument(f"{where}.tool_calls must be a non-empty list")
    out = []
    for j, c in enumerate(calls):
        w = f"{where}.tool_calls[{j}]"
        if not isinstance(c, dict):
            raise InvalidArgument(f"{w} must be an object")
        fn = c.get("function")
        if not isinstance(c.get("id"), str) or not c["id"]:
            raise InvalidArgument(f"{w}.id must be a non-empty string")
        if c.get("type", "function") != "function":
            raise InvalidArgument(f"{w}.type must be 'function'")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidArgument(f"{w}.function.name must be a non-empty string")
        out.append({"id": c["id"], "type": "function",
                    "function": {"name": fn["name"],
                                 "arguments": _arguments(fn.get("arguments", "{}"), w)}})
    return out


def canonical_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate OpenAI chat messages; InvalidArgument (400) names the first problem.

    Rules: a non-empty list of objects; roles system | developer (rendered as system) |
    user | assistant | tool; text content only; an assistant message has content or
    tool_calls; a tool message answers (``tool_call_id``) a call made by an earlier
    assistant message and not yet answered."""
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    open_calls: set[str] = set()
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidArgument(f"{where} must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise InvalidArgument(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}")
        c: dict[str, Any] = {"role": "system" if role == "developer" else role,
                             "content": _text(m.get("content"), where)}
        if isinstance(m.get("name"), str) and m["name"]:
            c["name"] = m["name"]
        if role == "assistant":
            if m.get("tool_calls"):
                c["tool_calls"] = canonical_tool_calls(m["tool_calls"], where)
                open_calls |= {t["id"] for t in c["tool_calls"]}
            elif m.get("content") is None:
                raise InvalidArgument(f"{where}: an assistant message needs content or tool_calls")
        elif m.get("tool_calls"):
            raise InvalidArgument(f"{where}: only assistant messages carry tool_calls")
        if role == "tool":
            tid = m.get("tool_call_id")
            if not isinstance(tid, str) or not tid:
                raise InvalidArgument(f"{where}: a tool message needs tool_call_id")
            if tid not in open_calls:
                raise InvalidArgument(f"{where}: tool message answers {tid!r}, but no earlier "
                                      "assistant message made that call (or it was answered)")
            open_calls.discard(tid)
            c["tool_call_id"] = tid
        elif m.get("content") is None and role != "assistant":
            raise InvalidArgument(f"{where}.content is required")
        out.append(c)
    return out


def assistant_message(content: str, tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The canonical form of a reply the gateway returned (what the harness echoes back)."""
    m: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        m["tool_calls"] = canonical_tool_calls(tool_calls, "reply")
    return m
