"""Waiting for a service started as a child process (an engine, a gateway) to answer."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Container
from typing import Any

import httpx


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, *,
                 ok: Container[int] | None = (200,), **get: Any) -> str | None:
    """Poll ``GET url`` every 0.1 s until it answers with a status in ``ok`` (any status
    when None). Returns None once it does, else why not: ``"exited with code N"`` when
    the process ended first, ``"not healthy within Ts"`` when ``timeout`` passed.
    ``get``: more arguments for ``httpx.get`` (e.g. ``verify``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with code {proc.returncode}"
        try:
            status = httpx.get(url, timeout=1.0, **get).status_code
            if ok is None or status in ok:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return f"not healthy within {timeout:g}s"
