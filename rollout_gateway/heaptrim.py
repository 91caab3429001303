"""Give the heap's freed memory back to the OS after a burst (glibc ``malloc_trim``).

When many rollouts finish together, the gateway holds their engine answers and replies
for a moment (hundreds of MiB for 1000 rollouts with routed experts). glibc returns freed
memory to the OS only from the top of its heap, so after the burst the process keeps
most of it resident (free, reused by the next burst) wherever one object that lives on
(a stored trajectory, a connection) sits above it. :class:`HeapTrimmer` checks every
``interval_s`` whether the resident size grew by ``min_growth_bytes`` more than malloc's
bytes in use did since its last trim (``mallinfo2``; where that is missing, whether it
grew by that much at all), and then calls ``malloc_trim(0)`` in a worker thread (5-20 ms
after a burst of 1000 rollouts; ctypes releases the GIL, so the event loop runs on).
Growth that is memory in use (stored trajectories) never triggers it. Python's own
small-object arenas are not malloc's: they stay at their high-water mark and are reused.
Off Linux + glibc (musl, macOS) it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable

from rollout_gateway.aio import Periodic

log = logging.getLogger(__name__)

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int | None:
    """This process's resident set size (None where /proc is not there)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None where the C library has none)."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def load_malloc_in_use() -> Callable[[], int] | None:
    """Bytes malloc has handed out and not had back (heap + its own mmaps), from glibc's
    ``mallinfo2`` (2.33+; None without it)."""
    info = getattr(_libc(), "mallinfo2", None)
    if info is None:
        return None
    info.argtypes, info.restype = [], _MallInfo2

    def in_use() -> int:
        mi = info()
        return int(mi.uordblks + mi.hblkhd)
    return in_use


_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters
_M_MMAP_THRESHOLD = -3


def keep_freed_heap(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Large blocks from the heap, and freed heap kept on free (glibc ``mallopt``): a
    multi-megabyte answer buffer then reuses memory already paged in, instead of a fresh
    ``mmap`` (a page fault per 4 KiB, about as costly as the copy itself) per response.
    Only with a :class:`HeapTrimmer` running, which gives the memory back after a burst.
    Returns whether glibc took both settings (False elsewhere)."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and \
        bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))


_LIBC = object()  # HeapTrimmer's default: glibc's functions


class HeapTrimmer:
    """Every ``interval_s``: ``malloc_trim(0)`` when the resident size grew at least
    ``min_growth_bytes`` more than malloc's bytes in use since the last trim (or start)."""

    def __init__(self, interval_s: float, min_growth_bytes: int = 32 << 20, *,
                 trim: Callable[[int], int] | None | object = _LIBC,
                 rss: Callable[[], int | None] = resident_bytes,
                 in_use: Callable[[], int] | None | object = _LIBC) -> None:
        """``trim`` / ``in_use``: glibc's by default; None: none (no trimming / the
        resident size alone decides)."""
        self.interval_s = interval_s
        self.min_growth_bytes = min_growth_bytes
        self._trim = load_malloc_trim() if trim is _LIBC else trim
        self._rss = rss
        self._in_use = load_malloc_in_use() if in_use is _LIBC else in_use
        self.trims = 0  # malloc_trim calls made
        self.released_bytes = 0  # resident bytes they gave back
        self._base: tuple[int, int] | None = None  # (resident, in use) after the last trim
        self._loop = Periodic(self.check, interval_s, what="malloc_trim check", log=log)

    @property
    def enabled(self) -> bool:
        return self._trim is not None and self.interval_s > 0 and self._rss() is not None

    def _now(self) -> tuple[int, int] | None:
        rss = self._rss()
        if rss is None:
            return None
        return rss, self._in_use() if self._in_use is not None else 0

    def start(self) -> None:
        if self.enabled and not self._loop.running:
            self._base = self._now()
            self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    async def check(self) -> bool:
        """One check: trim if resident memory grew past what is in use; returns whether
        it trimmed."""
        now = self._now()
        if self._trim is None or now is None:
            return False
        base = self._base or now
        grown = (now[0] - base[0]) - (now[1] - base[1])  # resident, beyond what is in use
        if grown < 0:  # gave back more than it freed (arenas unmapped): follow it down
            self._base = now
        if grown < self.min_growth_bytes:
            return False
        await asyncio.to_thread(self._trim, 0)
        after = self._now() or now
        self.trims += 1
        self.released_bytes += max(now[0] - after[0], 0)
        self._base = after
        log.debug("malloc_trim: resident %.0f -> %.0f MiB", now[0] / 2**20, after[0] / 2**20)
        return True
