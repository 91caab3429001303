"""Which data plane decodes engine answers: ``native`` (the compiled parsers in
``rollout_gateway/_native.c``) or ``python`` (the pure-Python reference, same results).

The native module is built by ``pip install`` with the machine's C compiler (setup.py);
when it is missing or fails to import, the Python data plane is used and
:func:`data_plane` says so (``rollout-gateway --version``, ``rollout-gateway status``,
``GET /v1/lag``). ``ROLLOUT_GATEWAY_DATA_PLANE=python`` (or the ``data_plane`` setting)
forces the Python one, e.g. to debug or to compare; ``native`` makes a missing module an
error instead of a silent fallback. The choice is read once at import and can be changed
at run time with :func:`select` (``serve`` applies the setting at start-up).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Literal

DataPlane = Literal["auto", "native", "python"]
ENV = "ROLLOUT_GATEWAY_DATA_PLANE"

try:
    from rollout_gateway import _native as _compiled
    _IMPORT_ERROR: str | None = None
except ImportError as exc:  # not built (no compiler at install time) or not loadable
    _compiled = None
    _IMPORT_ERROR = str(exc)

#: the module the decoders call, or None for the pure-Python data plane
impl: ModuleType | None = None


def select(choice: str = "auto") -> str:
    """Pick the data plane: ``auto`` (native when built), ``native`` or ``python``.
    Returns the active one's name; raises RuntimeError for ``native`` when not built."""
    global impl
    if choice not in ("auto", "native", "python"):
        raise ValueError(f"data plane must be auto, native or python, not {choice!r}")
    if choice == "native" and _compiled is None:
        raise RuntimeError(f"the native data plane is not built: {_IMPORT_ERROR} "
                           "(reinstall with a C compiler: pip install -e .)")
    impl = None if choice == "python" else _compiled
    return data_plane()


@contextmanager
def using(choice: str) -> Iterator[str]:
    """``with using("python"):`` -- run a block on one data plane (tests, benchmarks),
    then restore the previous choice. Not for concurrent use."""
    global impl
    saved = impl
    try:
        yield select(choice)
    finally:
        impl = saved


def compiled() -> ModuleType:
    """The native module whatever is selected (tests compare it with the Python code)."""
    if _compiled is None:
        raise RuntimeError(f"the native data plane is not built: {_IMPORT_ERROR}")
    return _compiled


def built() -> bool:
    """Whether the native module was built and imports."""
    return _compiled is not None


def data_plane() -> str:
    """``native`` or ``python``: the data plane decoding engine answers now."""
    return "native" if impl is not None else "python"


def describe() -> str:
    """One line for ``--version`` / ``status``: the active plane and why."""
    if impl is not None:
        return "data plane: native (compiled parsers)"
    if _compiled is None:
        return f"data plane: python (native module not built: {_IMPORT_ERROR})"
    return f"data plane: python (forced by {ENV}=python or the data_plane setting)"


# at import, never fail: a bad value or "native" without the module is reported by the
# settings (serve) or select(); here it means auto
select("python" if os.environ.get(ENV, "").strip().lower() == "python" else "auto")
