"""What an error may tell a caller: no traceback or exception class name ever; no URL, IP
address or filesystem path unless the caller is the authenticated admin. Applied at the
HTTP and gRPC boundaries (the full text goes to the gateway's log)."""

from __future__ import annotations

import re
from typing import Any

_TRACEBACK = re.compile(r"Traceback \(most recent call last\).*", re.S)
_CLASS = re.compile(r"\b(?:[a-z_][\w]*\.)*[A-Z]\w*(?:Error|Exception|Timeout|Warning)\b:?\s*")
_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>,;)]+")
_IP4 = re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b")
_IP6 = re.compile(r"\[[0-9a-fA-F:.]+\](?::\d+)?")
_HOSTPORT = re.compile(r"\b(connecting to|connect to|at|to host|host) [\w.-]+:\d+\b")
_PATH = re.compile(r"(?<![\w.:/-])/(?!v1/)(?:[\w.@+~-]+/)+[\w.@+~-]*")


def clean_message(text: str, *, private: bool = True) -> str:
    """``text`` without traceback or exception class names; with ``private`` also without
    URLs, addresses and filesystem paths."""
    text = text.encode("utf-8", "replace").decode("utf-8")  # lone surrogates
    text = _TRACEBACK.sub("", text)
    text = _CLASS.sub("", text)
    if private:
        text = _URL.sub("<url>", text)
        text = _IP6.sub("<address>", text)
        text = _IP4.sub("<address>", text)
        text = _HOSTPORT.sub(r"\1 <address>", text)
        text = _PATH.sub("<path>", text)
    return text.strip() or "error"


def clean(obj: Any, *, private: bool = True) -> Any:
    """:func:`clean_message` applied to every string in a JSON-like value."""
    if isinstance(obj, str):
        return clean_message(obj, private=private)
    if isinstance(obj, dict):
        return {k: clean(v, private=private) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v, private=private) for v in obj]
    return obj
