"""Who an engine is: the facts that, when they change behind the gateway's back, mean the
engine at a URL is not the one the gateway registered (a restart, other weights, a version
label moved by someone else), so it must be registered again before it serves.

Read from what SGLang 0.5.23 exposes (``http_server.py`` ``/server_info``, ``/model_info``):

* ``process``: a fingerprint of the process. ``/server_info`` carries ``startup_time``
  (the tokenizer manager's measured start-up durations: load_weight, kv_cache_allocation,
  scheduler_e2e, ... in float seconds) and ``random_seed`` (drawn at random per process
  unless ``--random-seed`` was given): a new process answers other values. None when
  the engine reports neither.
* ``model_path``: ``/model_info``'s, moved by a successful ``update_weights_from_disk``.
* ``weight_version``: ``/model_info``'s label.

No I/O here.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import orjson

#: /server_info fields that differ between two processes of the same launch command
PROCESS_FIELDS = ("startup_time", "random_seed")


@dataclass(frozen=True, slots=True)
class EngineIdentity:
    process: str | None = None
    model_path: str | None = None
    weight_version: int | None = None

    def changes(self, now: EngineIdentity) -> list[str]:
        """What differs in ``now`` (empty: the same engine). A fact either side does not
        report is not compared."""
        out = []
        if self.process is not None and now.process is not None and self.process != now.process:
            out.append("a new process (/server_info startup_time, random_seed)")
        if self.model_path != now.model_path and None not in (self.model_path, now.model_path):
            out.append(f"model_path {self.model_path!r} -> {now.model_path!r}")
        if self.weight_version != now.weight_version:
            out.append(f"weight_version {self.weight_version} -> {now.weight_version}")
        return out


def process_marker(server: dict[str, Any]) -> str | None:
    """The process fingerprint from a ``/server_info`` answer, or None."""
    facts = {k: server.get(k) for k in PROCESS_FIELDS if server.get(k) is not None}
    if not facts:
        return None
    return hashlib.blake2b(orjson.dumps(facts, option=orjson.OPT_SORT_KEYS),
                           digest_size=8).hexdigest()
