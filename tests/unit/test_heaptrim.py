"""HeapTrimmer: malloc_trim when resident memory grew past what malloc has in use (a
burst left freed heap resident), never for memory in use, nor for small growth; and the
real glibc call where there is one."""

from __future__ import annotations

import pytest

from rollout_gateway.heaptrim import (
    HeapTrimmer,
    load_malloc_in_use,
    load_malloc_trim,
    resident_bytes,
)

MIB = 1 << 20


class Fake:
    """A process whose resident size and malloc bytes in use the test sets; a trim gives
    back ``free`` resident bytes."""

    def __init__(self) -> None:
        self.rss, self.used, self.free, self.calls = 100 * MIB, 20 * MIB, 0, 0

    def trim(self, pad: int) -> int:
        assert pad == 0
        self.calls += 1
        self.rss -= self.free
        self.free = 0
        return 1


def trimmer(f: Fake, **kw) -> HeapTrimmer:
    t = HeapTrimmer(5.0, 32 * MIB, trim=f.trim, rss=lambda: f.rss,
                    **({"in_use": lambda: f.used} | kw))
    t._base = t._now()  # as start() does
    return t


async def test_trims_what_a_burst_left_resident_never_memory_in_use():
    f = Fake()
    t = trimmer(f)
    f.rss += 122 * MIB  # trajectories the store keeps: in use, nothing to give back
    f.used += 122 * MIB
    assert not await t.check()
    f.rss += 20 * MIB  # a little more resident than in use: below the threshold
    assert not await t.check()
    f.rss, f.free = 650 * MIB, 380 * MIB  # after a burst: freed heap still resident
    assert await t.check() and f.calls == 1 and f.rss == 270 * MIB
    assert t.trims == 1 and t.released_bytes == 380 * MIB
    assert not await t.check()  # nothing new since
    f.rss = 200 * MIB  # shrank by itself: the baseline follows
    assert not await t.check() and t._base == (200 * MIB, f.used)
    f.rss, f.used, f.free = 800 * MIB, 600 * MIB, 0  # a burst, trimmed at its top
    assert await t.check() and f.calls == 2
    f.rss, f.used, f.free = 780 * MIB, 142 * MIB, 500 * MIB  # over: in use fell, not RSS
    assert await t.check() and f.calls == 3 and f.rss == 280 * MIB


async def test_without_mallinfo_the_resident_size_alone_decides():
    f = Fake()
    t = trimmer(f, in_use=None)
    f.rss += 10 * MIB
    assert not await t.check()
    f.rss += 30 * MIB
    assert await t.check() and f.calls == 1


async def test_no_malloc_trim_means_disabled():
    t = HeapTrimmer(5.0, trim=None, rss=lambda: 1)
    assert not t.enabled and not await t.check()
    assert not HeapTrimmer(0, trim=lambda pad: 1, rss=lambda: 1).enabled


async def test_the_real_malloc_trim_runs():
    if load_malloc_trim() is None or resident_bytes() is None:
        pytest.skip("no glibc malloc_trim or /proc here")
    t = HeapTrimmer(5.0, min_growth_bytes=0)
    assert t.enabled and (load_malloc_in_use() is None) == (t._in_use is None)
    junk = [bytearray(1 << 16) for _ in range(2000)]  # ~128 MiB in use, then freed
    del junk
    t._base = (0, 0)  # everything resident counts as grown since
    assert await t.check() and t.trims == 1


def test_keep_freed_heap_takes_on_glibc():
    from rollout_gateway.heaptrim import keep_freed_heap, load_malloc_trim

    if load_malloc_trim() is None:  # not glibc: nothing to tune, and it says so
        assert keep_freed_heap() is False
        return
    assert keep_freed_heap() is True
