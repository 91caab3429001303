"""Give the heap's freed memory back to the OS after a burst (glibc ``malloc_trim``).

When many rollouts finish together, the gateway holds their engine answers and replies
for a moment (hundreds of MiB for 1000 rollouts with routed experts). glibc returns freed
memory to the OS only from the top of its heap, so after the burst the process keeps
most of it resident (free, reused by the next burst) wherever one object that lives on
(a stored trajectory, a connection) sits above it. :class:`HeapTrimmer` checks every
``interval_s`` whether the resident size grew by ``min_growth_bytes`` since its last trim
and has stopped climbing, and then calls ``malloc_trim(0)`` in a worker thread (5-20 ms
after a burst of 1000 rollouts; ctypes releases the GIL, so the event loop runs on). Python's own small-object arenas are
not malloc's: they stay at their high-water mark and are reused. Off Linux + glibc (musl,
macOS) it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable

from rollout_gateway.aio import cancel_and_wait

log = logging.getLogger(__name__)

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int | None:
    """This process's resident set size (None where /proc is not there)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None where the C library has none)."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class HeapTrimmer:
    """Every ``interval_s``: ``malloc_trim(0)`` once a burst is over, i.e. when the resident
    size is at least ``min_growth_bytes`` above what it was after the last trim (or at
    start) and no higher than at the previous check (not while it still climbs: memory
    given back in the middle of a burst would be faulted in again at once)."""

    def __init__(self, interval_s: float, min_growth_bytes: int = 32 << 20, *,
                 trim: Callable[[int], int] | None = None,
                 rss: Callable[[], int | None] = resident_bytes) -> None:
        self.interval_s = interval_s
        self.min_growth_bytes = min_growth_bytes
        self._trim = trim if trim is not None else load_malloc_trim()
        self._rss = rss
        self.trims = 0  # malloc_trim calls made
        self.released_bytes = 0  # resident bytes they gave back
        self._floor: int | None = None  # resident size after the last trim
        self._last: int | None = None  # resident size at the previous check
        self._task: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        return self._trim is not None and self.interval_s > 0 and self._rss() is not None

    def start(self) -> None:
        if self.enabled and self._task is None:
            self._floor = self._last = self._rss()
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def check(self) -> bool:
        """One check: trim if a burst left enough behind; returns whether it trimmed."""
        now = self._rss()
        if self._trim is None or now is None:
            return False
        floor, last = self._floor, self._last
        self._last = now
        if floor is not None and now < floor + self.min_growth_bytes:
            self._floor = min(floor, now)
            return False
        if last is not None and now > last:
            return False  # still climbing
        await asyncio.to_thread(self._trim, 0)
        after = self._rss() or now
        self.trims += 1
        self.released_bytes += max(now - after, 0)
        self._floor = self._last = after
        log.debug("malloc_trim: resident %.0f -> %.0f MiB", now / 2**20, after / 2**20)
        return True

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.check()
