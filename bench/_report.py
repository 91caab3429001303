"""Machine-readable results for ``bench/run_all``: every benchmark takes ``--json PATH``
and writes one document through :func:`write`.

A document: ``{"bench": name, "title": ..., "command": [...], "params": {...},
"rows": [{"section", "name", "value", "unit", "ratio", "ratio_to"}],
"goals": [{"name", "target", "value", "op", "unit", "floor"}], "notes": [...]}``. ``ratio`` is
measured side by side in the same run against the row named ``ratio_to``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


class Report:
    def __init__(self, bench: str, title: str, **params: Any):
        self.doc: dict[str, Any] = {"bench": bench, "title": title, "command": sys.argv,
                                    "params": params, "rows": [], "goals": [], "notes": []}

    def row(self, section: str, name: str, value: float, unit: str, *,
            ratio: float | None = None, ratio_to: str | None = None, **extra: Any) -> None:
        self.doc["rows"].append({"section": section, "name": name, "value": value,
                                 "unit": unit, "ratio": ratio, "ratio_to": ratio_to, **extra})

    def goal(self, name: str, value: float, target: float, op: str = ">=",
             unit: str = "", floor: str = "") -> None:
        """A goal of issue 13's or 24's list: ``value op target``; ``floor``: what the
        physical floor of the measured thing is on this machine (text, shown beside it)."""
        self.doc["goals"].append({"name": name, "value": value, "target": target, "op": op,
                                  "unit": unit, "floor": floor})

    def note(self, text: str) -> None:
        self.doc["notes"].append(text)

    def write(self, path: str | None) -> None:
        if path:
            Path(path).write_text(json.dumps(self.doc, indent=1, default=float))
