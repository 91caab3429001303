"""Builds the optional native data plane (``rollout_gateway._native``, C through the
CPython API) with the machine's C compiler; everything else is in pyproject.toml.

The extension is optional: when it cannot be compiled (no compiler, no Python headers)
the install still succeeds, says so, and the gateway runs the pure-Python data plane
(``rollout-gateway --version`` reports which one is active; docs/benchmarks.md)."""

from __future__ import annotations

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext that warns instead of failing: the pure-Python fallback takes over."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any build failure means "no native"
            self._warn(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            self._warn(exc)

    @staticmethod
    def _warn(exc: BaseException) -> None:
        print(f"WARNING: rollout_gateway._native was not built ({exc}); the gateway will "
              "use its pure-Python data plane (same results, slower)", file=sys.stderr)


setup(
    ext_modules=[Extension("rollout_gateway._native", ["rollout_gateway/_native.c"],
                           extra_compile_args=["-O3", "-std=c11"], optional=True)],
    cmdclass={"build_ext": OptionalBuildExt},
)
