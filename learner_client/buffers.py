"""Reused memory for the learner's bulk buffers: received trajectory bytes and collated
routed experts (the two multi-MB allocations per batch).

A fresh multi-MB allocation is returned to the OS when freed and paid for again next time
(page faults, the kernel zeroing each page): about as much CPU as the copy that fills it.
:class:`BufferPool` keeps such buffers and hands one out again once nothing refers to it
any more: every array or tensor made from it (numpy views, ``torch.from_numpy``) holds a
reference, so a buffer is reused only after the learner dropped everything built on it.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

__all__ = ["BufferPool"]

_ROUND = 64 << 10  # buffer sizes are whole multiples of this
_LOOKS = 8  # buffers get() checks (oldest first) before it allocates


def _free_refcount() -> int:
    """sys.getrefcount of a buffer only the pool's list refers to, read the way
    BufferPool reads it (from a local bound to the list item)."""
    bufs = [np.empty(1, np.uint8)]
    b = bufs[0]
    return sys.getrefcount(b)


_FREE = _free_refcount()


class BufferPool:
    """Buffers reused once unreferenced (refcount back to the pool's own), at most
    ``max_bytes`` of them kept (a larger request is served, not kept). Thread-safe; one
    pool per kind of buffer and process, so a learner that re-creates its client keeps
    its warm buffers."""

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = max_bytes
        self._bufs: list[np.ndarray] = []
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, n: int) -> np.ndarray:
        """A uint8 buffer of at least ``n`` bytes that nothing else refers to (contents
        undefined: a new one is not zeroed)."""
        with self._lock:
            return self._get(n)

    def _get(self, n: int) -> np.ndarray:
        # oldest first (buffers are released roughly in the order they were handed out), a few
        # looks at most: a pool whose oldest buffers are all still held grows instead
        bufs = self._bufs
        for i in range(min(len(bufs), _LOOKS)):
            b = bufs[i]
            if n <= len(b) <= 2 * n + _ROUND and sys.getrefcount(b) <= _FREE:
                del bufs[i]
                bufs.append(b)  # now the newest
                return b
        if self._bytes + n + _ROUND > self.max_bytes:  # make room: forget unreferenced ones
            held = []
            for i in range(len(bufs)):
                b = bufs[i]
                if sys.getrefcount(b) > _FREE:
                    held.append(b)
            self._bufs = bufs = held
            self._bytes = sum(len(x) for x in held)
        b = np.empty(-(-n // _ROUND) * _ROUND, np.uint8)  # whole 64 KiB: fits the next ones
        if self._bytes + len(b) <= self.max_bytes:
            bufs.append(b)
            self._bytes += len(b)
        return b

    def __len__(self) -> int:
        return len(self._bufs)
