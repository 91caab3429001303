"""HeapTrimmer: malloc_trim once a burst is over, not while memory still climbs, not for
small growth; and the real glibc call where there is one."""

from __future__ import annotations

import pytest

from rollout_gateway.heaptrim import HeapTrimmer, load_malloc_trim, resident_bytes

MIB = 1 << 20


class Fake:
    """A resident size the test sets; trimming gives back ``self.free``."""

    def __init__(self, rss: int) -> None:
        self.rss, self.free, self.calls = rss, 0, 0

    def trim(self, pad: int) -> int:
        assert pad == 0
        self.calls += 1
        self.rss -= self.free
        self.free = 0
        return 1


async def test_trims_once_a_burst_is_over():
    f = Fake(100 * MIB)
    t = HeapTrimmer(5.0, 32 * MIB, trim=f.trim, rss=lambda: f.rss)
    t._floor = t._last = f.rss  # as start() does
    f.rss += 10 * MIB
    assert not await t.check()  # grew less than the threshold
    f.rss, f.free = 900 * MIB, 400 * MIB
    assert not await t.check()  # still climbing
    f.rss = 650 * MIB  # the burst is over: some went back by itself, 400 MiB free
    assert await t.check() and f.rss == 250 * MIB and f.calls == 1
    assert t.trims == 1 and t.released_bytes == 400 * MIB
    f.rss += 10 * MIB  # a stored trajectory or two: nothing to do
    assert not await t.check() and f.calls == 1
    f.rss = 240 * MIB  # shrank: the floor follows it down
    assert not await t.check() and t._floor == 240 * MIB


async def test_no_malloc_trim_means_disabled():
    t = HeapTrimmer(5.0, trim=None, rss=lambda: 1)
    t._trim = None
    assert not t.enabled and not await t.check()
    assert not HeapTrimmer(0, trim=lambda pad: 1, rss=lambda: 1).enabled


async def test_the_real_malloc_trim_runs():
    if load_malloc_trim() is None or resident_bytes() is None:
        pytest.skip("no glibc malloc_trim or /proc here")
    t = HeapTrimmer(5.0, min_growth_bytes=0)
    t._floor = t._last = resident_bytes()
    junk = [bytearray(1 << 16) for _ in range(2000)]  # ~128 MiB, freed again
    del junk
    t._last = None  # not comparing against the previous reading
    assert await t.check() and t.trims == 1
