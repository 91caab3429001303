"""The ``rollout-gateway`` command.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``. Modules are imported only when their subcommand is used, and
must not import torch at module level, so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("rollout_gateway.commands.up", "run everything on one machine: reference engine(s), "
           "gateway HTTP + gRPC, embedded store (serving only; the main job is demo)"),
    "serve": ("rollout_gateway.commands.serve", "run the gateway (HTTP API + learner gRPC service)"),
    "engine": ("reference_engine.cli", "run the reference engine (toy Qwen3-MoE, SGLang protocol)"),
    "status": ("rollout_gateway.commands.status", "show a running gateway's version lag "
               "(engines, token lag in flight / unconsumed / delivered, pause windows)"),
    "demo": ("rollout_demo.cli", "the main job: engines + gateway + a learner training the toy "
             "MoE over gRPC with a chosen correction and a hot-swap every step"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout-gateway",
        description="Rollout middleware for asynchronous RL (per-token provenance, hot-swap, "
        "trajectory streaming).",
    )
    from rollout_gateway import __version__, native

    parser.add_argument("--version", action="version",
                        version=f"rollout-gateway {__version__}; {native.describe()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:  # import only the module that will run
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
