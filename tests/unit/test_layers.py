"""The import graph, read from the source (every import: module level, inside functions,
under ``TYPE_CHECKING``): no circle among rollout_gateway's modules, no import up the layers
of docs/architecture.md, and the three programs (gateway, learner client, reference engine)
kept apart."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("rollout_gateway", "learner_client", "reference_engine", "rollout_proto")

#: rollout_gateway's layers, bottom first, by the first name under the package ("" is the
#: package itself). A module imports from its own layer or below, never above.
LAYERS = (
    {"", "errors", "aio", "redact", "proc", "heaptrim", "auth", "settings", "core", "native"},
    {"engines", "store", "registry"},
    {"rollouts", "swap", "old_logits", "sessions", "observe"},
    {"transport", "api"},
    {"gateway"},
    {"commands", "cli", "__main__"},
)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _known(name: str) -> str | None:
    """The module ``name`` loads: itself, or the nearest package above it we index."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(_known(a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # ``from pkg import mod`` loads pkg.mod; ``from mod import name`` loads mod
            found.update(_known(f"{base}.{a.name}") if f"{base}.{a.name}" in MODULES
                         else _known(base) for a in node.names)
    return {m for m in found if m and m != module}


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _top(module: str) -> str:
    return module.split(".")[0]


def _area(module: str) -> str:
    """rollout_gateway.api.routes -> "api"; rollout_gateway -> ""."""
    return module.split(".")[1] if "." in module else ""


def _layer(module: str) -> int:
    for i, names in enumerate(LAYERS):
        if _area(module) in names:
            return i
    raise AssertionError(f"{module}: put {_area(module)!r} in a layer of LAYERS (and of "
                         "docs/architecture.md)")


def _gateway_edges() -> list[tuple[str, str]]:
    return [(m, d) for m, deps in sorted(GRAPH.items()) if _top(m) == "rollout_gateway"
            for d in sorted(deps) if _top(d) == "rollout_gateway"]


def test_the_scan_sees_the_known_edges():
    assert "rollout_gateway.errors" in GRAPH["rollout_gateway.gateway"]
    assert "rollout_gateway.api.deps" in GRAPH["rollout_gateway.api.app"]  # function-level


def test_no_import_circle_in_rollout_gateway():
    deps: dict[str, list[str]] = {m: [] for m in GRAPH if _top(m) == "rollout_gateway"}
    for m, d in _gateway_edges():
        deps[m].append(d)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in deps[m]:
            if state.get(d) == 1:
                circles.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in deps:
        if m not in state:
            visit(m, [m])
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_no_import_runs_up_the_layers():
    up = [f"{m} (layer {_layer(m)}) -> {d} (layer {_layer(d)})"
          for m, d in _gateway_edges() if _layer(d) > _layer(m)]
    assert not up, "\n".join(up)


def test_the_front_doors_do_not_import_each_other():
    doors = {"transport", "api"}
    crossing = [f"{m} -> {d}" for m, d in _gateway_edges()
                if _area(m) in doors and _area(d) in doors - {_area(m)}]
    assert not crossing, "\n".join(crossing)


def test_the_programs_stay_apart():
    never = {"learner_client": {"rollout_gateway", "reference_engine"},
             "rollout_gateway": {"learner_client"},
             "reference_engine": {"rollout_gateway", "learner_client"}}
    bad = [f"{m} -> {d}" for m, deps in sorted(GRAPH.items())
           for d in sorted(deps) if _top(d) in never.get(_top(m), ())]
    # the gateway launches the reference engine (``up``), nothing below the programs uses it
    bad += [f"{m} -> {d}" for m, deps in sorted(GRAPH.items())
            if _top(m) == "rollout_gateway" and _layer(m) < len(LAYERS) - 1
            for d in sorted(deps) if _top(d) == "reference_engine"]
    assert not bad, "\n".join(bad)
