"""Chat templates: messages -> prompt text -> token ids, and model ids -> text.

Two kinds, one interface (:class:`ChatTemplate`):

* :class:`ReferenceTemplate` for the reference engine's byte tokenizer (documented in
  ``docs/agents.md``)::

      <|bos|>[<|tools|>\\n{tools json}<|eos|>\\n]
      <|{role}|>\\n{content}[<tool_call>{"name": .., "arguments": ..}</tool_call>...]<|eos|>\\n
      ...
      <|assistant|>\\n                      (the generation prompt)

  ``<|bos|>`` / ``<|eos|>`` are the special ids 256 / 257; everything else is UTF-8 bytes.
  The model ends its turn by sampling ``<|eos|>``.
* :class:`HFTemplate`: a real model's own tokenizer and chat template, loaded from the
  model path with ``transformers.AutoTokenizer`` (as SGLang does).

Sessions never re-tokenize what the model produced: they only tokenize the text the
template adds *after* it (see :mod:`rollout_gateway.sessions.session`).

Special-token text inside a message (a user writing ``<|eos|>`` or ``<|im_end|>``) is text:
:meth:`ChatTemplate.render` marks it (:data:`MARK`, a lone surrogate, which validated
request text can never hold) and :meth:`ChatTemplate.encode` turns marked special text into
ordinary tokens (bytes), so a message can never forge a turn boundary. Only the template's
own specials become special ids. A raw ``/v1/completions`` prompt is the template's text
written by hand: its special-token text stays special (as SGLang tokenizes it).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from rollout_gateway.errors import InvalidArgument

#: The reference model's vocabulary (the contract with ``reference_engine.tokenizer``, a
#: separate program: ``tests/unit/test_agent_sessions.py`` checks both agree): ids 0-255 are
#: the UTF-8 bytes, then BOS, EOS, PAD.
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
SPECIAL_NAMES = {BOS_ID: "<|bos|>", EOS_ID: "<|eos|>", PAD_ID: "<|pad|>"}

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
#: written after the first character of special-token text found in a message (render);
#: encode drops it and encodes that text as ordinary tokens. A lone surrogate: no validated
#: request text holds one (rollouts.models.Text), so it cannot be forged.
MARK = "\udfff"


class ChatTemplate(ABC):
    """Interface: render messages to text, text <-> ids."""

    name = "base"
    #: ids that end the model's turn (stripped from the returned content)
    end_ids: frozenset[int] = frozenset()

    @abstractmethod
    def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool) -> str:
        """The prompt text of ``messages`` (with the assistant header when asked)."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Ids of ``text``; special-token strings in it become their special ids."""

    @abstractmethod
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""

    def token_text(self, token_id: int) -> str:
        """One token's text (OpenAI logprobs ``token``)."""
        return self.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> list[int]:
        return list(self.token_text(token_id).encode("utf-8"))

    def special_texts(self) -> list[str]:
        """The texts the tokenizer turns into special ids (longest first)."""
        return []

    def escape(self, text: str) -> str:
        """Message text with its special-token text marked (:data:`MARK`): encoded as
        ordinary tokens, never as special ids."""
        for sp in self.special_texts():
            if sp in text:
                text = text.replace(sp, sp[0] + MARK + sp[1:])
        return text

    def _marked_parts(self, text: str) -> list[tuple[str, bool]]:
        """``text`` as (part, was marked special text) pairs, the marks removed."""
        if MARK not in text:
            return [(text, False)]
        marked = [sp[0] + MARK + sp[1:] for sp in self.special_texts()]
        pattern = re.compile("(" + "|".join(re.escape(m) for m in marked) + ")")
        return [(p.replace(MARK, ""), i % 2 == 1)
                for i, p in enumerate(pattern.split(text)) if p]


def tool_call_text(call: dict[str, Any]) -> str:
    """How a tool call appears in the reference template (Hermes style)."""
    fn = call["function"]
    return "<tool_call>" + json.dumps({"name": fn["name"], "arguments": fn["arguments"]},
                                      ensure_ascii=False) + "</tool_call>"


def parse_tool_calls(text: str, turn: int, limit: int | None = None
                     ) -> tuple[str, list[dict[str, Any]]]:
    """Hermes-style ``<tool_call>{"name": .., "arguments": {..}}</tool_call>`` blocks in the
    model's text -> (content without them, OpenAI ``tool_calls``). Blocks that are not valid
    JSON with a string ``name`` stay in the content (the model's text, unchanged), and so
    do blocks past ``limit`` calls (``parallel_tool_calls: false`` -> 1)."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for m in _TOOL_CALL.finditer(text):
        if limit is not None and len(calls) >= limit:
            break
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", {})
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append({"id": f"call_{turn}_{len(calls)}", "type": "function",
                      "function": {"name": obj["name"],
                                   "arguments": args if isinstance(args, str)
                                   else json.dumps(args, ensure_ascii=False)}})
    kept.append(text[pos:])
    return ("".join(kept).strip() if calls else text), calls


def _args_obj(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class ReferenceTemplate(ChatTemplate):
    """The reference model's template over its byte tokenizer (see the module docstring)."""

    name = "reference"
    end_ids = frozenset({EOS_ID})
    _split = re.compile("(" + "|".join(re.escape(SPECIAL_NAMES[i]) for i in (BOS_ID, EOS_ID)) + ")")
    _ids = {SPECIAL_NAMES[BOS_ID]: BOS_ID, SPECIAL_NAMES[EOS_ID]: EOS_ID}

    def special_texts(self) -> list[str]:
        return [SPECIAL_NAMES[i] for i in (BOS_ID, EOS_ID)]

    def render(self, messages, *, tools, add_generation_prompt):
        out = ["<|bos|>"]
        if tools:
            out.append("<|tools|>\n" + self.escape(json.dumps(tools, ensure_ascii=False))
                       + "<|eos|>\n")
        for m in messages:
            body = self.escape(m.get("content") or "")
            for call in m.get("tool_calls") or ():
                fn = call["function"]
                body += self.escape(tool_call_text(
                    {"function": {"name": fn["name"], "arguments": _args_obj(fn["arguments"])}}))
            out.append(f"<|{m['role']}|>\n{body}<|eos|>\n")
        if add_generation_prompt:
            out.append("<|assistant|>\n")
        return "".join(out)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in self._split.split(text):
            if part in self._ids:
                ids.append(self._ids[part])
            elif part:  # marked special text (a message's) is bytes like the rest
                ids.extend(part.replace(MARK, "").encode("utf-8"))
        return ids

    def decode(self, ids, *, skip_special_tokens=True):
        # specials are ASCII names, so one UTF-8 decode of the joined bytes replaces a
        # truncated character before a special exactly as decoding each run apart would
        return b"".join(self._bytes(int(t), skip_special_tokens) for t in ids).decode(
            "utf-8", errors="replace")

    @staticmethod
    def _bytes(t: int, skip_special: bool) -> bytes:
        if 0 <= t < 256:
            return bytes((t,))
        name = SPECIAL_NAMES.get(t)
        return name.encode() if name and not skip_special else b""

    def token_text(self, token_id: int) -> str:
        t = int(token_id)
        if t in SPECIAL_NAMES:
            return SPECIAL_NAMES[t]
        return bytes((t,)).decode("utf-8", errors="replace") if 0 <= t < 256 else ""

    def token_bytes(self, token_id: int) -> list[int]:
        t = int(token_id)
        return [t] if 0 <= t < 256 else list(self.token_text(t).encode())


class HFTemplate(ChatTemplate):
    """A model's own tokenizer and chat template (``transformers.AutoTokenizer``)."""

    def __init__(self, path: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:  # pragma: no cover - transformers ships with [hf]
            raise InvalidArgument("chat_template from a model path needs transformers "
                                  "(pip install 'rollout-gateway[hf]')") from exc
        try:
            self.tok = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"cannot load a tokenizer from {path!r}: {exc}") from exc
        if not getattr(self.tok, "chat_template", None):
            raise InvalidArgument(f"the tokenizer at {path!r} has no chat template")
        self.name = f"hf:{path}"
        ends = {self.tok.eos_token_id} if self.tok.eos_token_id is not None else set()
        self.end_ids = frozenset(ends)
        specials = set(getattr(self.tok, "all_special_tokens", []) or [])
        specials |= {t.content for t in (getattr(self.tok, "added_tokens_decoder", {}) or {})
                     .values() if getattr(t, "special", False)}
        self._specials = sorted((t for t in specials if len(t) > 1), key=len, reverse=True)

    def special_texts(self) -> list[str]:
        return self._specials

    def render(self, messages, *, tools, add_generation_prompt):
        msgs = []
        for m in messages:
            m = dict(m)
            if isinstance(m.get("content"), str):
                m["content"] = self.escape(m["content"])
            if m.get("tool_calls"):
                m["tool_calls"] = [{"id": c["id"], "type": "function",
                                    "function": {"name": c["function"]["name"],
                                                 "arguments": _args_obj(c["function"]["arguments"])}}
                                   for c in m["tool_calls"]]
            msgs.append(m)
        try:
            return self.tok.apply_chat_template(msgs, tools=tools or None, tokenize=False,
                                                add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 - a template's own raise_exception etc.
            raise InvalidArgument(f"the chat template rejected the messages: {exc}") from None

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part, marked in self._marked_parts(text):
            if marked:  # special-token text of a message: its characters, not the special
                ids += self.tok.encode(part, add_special_tokens=False, split_special_tokens=True)
            else:
                ids += self.tok.encode(part, add_special_tokens=False)
        return ids

    def decode(self, ids, *, skip_special_tokens=True):
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_template(spec: str) -> ChatTemplate:
    """``reference`` -> :class:`ReferenceTemplate`; anything else is a model / tokenizer path."""
    if spec == "reference":
        return ReferenceTemplate()
    return HFTemplate(spec)
