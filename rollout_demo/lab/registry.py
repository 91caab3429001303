"""The lab's presets: one named experiment each, registered by the module that defines it.

A preset runs its methods x lags x seeds and returns the results dict of ``results.json``
(``cells`` and ``claims``, see docs/lab.md); the CLI adds the provenance fields (preset,
paper, commit, machine, seeds, cpu_seconds). Its ``render`` turns a committed results dict
into the markdown body of its section in docs/lab.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

#: Paper keys in report order, with their section titles in docs/lab.md.
PAPERS: dict[str, str] = {
    "regime": "Where staleness hurts (the uncorrected base)",
    "sat": "SAT: staleness-aware trust region",
    "estr": "ESTR: entropy-selective token rejection",
    "old_logits": "Old logits: the proximal policy without a snapshot",
    "theory": "Theory: surrogate-gradient bias and the stable learning rate",
    "product": "Through the product: lag made by the gateway",
    "routing": "Routing replay (R3)",
}

#: Modules the CLI imports so that they register their presets. Each owner adds its own
#: lines under its comment (kept apart so that parallel branches merge without conflict);
#: a module listed here must import: there are no silently optional presets.
PRESET_MODULES: list[str] = [
    # lab-core: regime, SAT, ESTR
    "rollout_demo.lab.regime",
    "rollout_demo.lab.sat",
    "rollout_demo.lab.estr",

    # lab-theory: old logits, theory
    "rollout_demo.lab.oldlogit",
    "rollout_demo.lab.theory",

    # lab-product: through the gateway, routing replay
    "rollout_demo.lab.product",
    "rollout_demo.lab.routing",

]


@dataclass
class RunContext:
    """What a preset's ``run`` gets from the CLI."""

    seeds: list[int]
    out: Path
    quick: bool = False
    #: one line per finished run (the CLI prints it with the elapsed time)
    progress: Callable[[str], None] = field(default=print)


@dataclass(frozen=True)
class Preset:
    name: str  # CLI name, e.g. "sat-anchor"
    paper: str  # section key, one of PAPERS
    summary: str  # one line for --list
    cpu_minutes: float  # expected CPU minutes for the default seeds (said by --list)
    run: Callable[[RunContext], dict]  # does the work, returns the results dict
    render: Callable[[dict], str]  # markdown section body for docs/lab.md from results
    #: the default seeds of a committed run (the statistics rule asks for 6 or more)
    default_seeds: tuple[int, ...] = (0, 1, 2, 3, 4, 5)
    #: the claims of a results dict recomputed from its ``cells`` (and ``seeds``,
    #: ``settings``), the same as ``run`` states them; the report calls it on two seed sets'
    #: cells concatenated to pool a claim that flips between them (None: not poolable)
    claims: Callable[[dict], list[dict]] | None = None


PRESETS: dict[str, Preset] = {}


def register(p: Preset) -> Preset:
    """Add ``p`` to :data:`PRESETS` (a name registered twice is a bug, not an override)."""
    if p.paper not in PAPERS:
        raise ValueError(f"preset {p.name!r}: unknown paper {p.paper!r} (one of {list(PAPERS)})")
    if p.name in PRESETS and PRESETS[p.name] is not p:
        raise ValueError(f"preset {p.name!r} registered twice")
    PRESETS[p.name] = p
    return p


def load_presets() -> dict[str, Preset]:
    """Import every module of :data:`PRESET_MODULES`; returns the registry."""
    for mod in PRESET_MODULES:
        importlib.import_module(mod)
    return PRESETS
