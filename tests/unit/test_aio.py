"""aio.Periodic, the one background loop of discovery, health, history, sessions and the heap
trimmer: a failed step is logged and the next runs; start twice starts one loop; stop ends
it; the first step waits one period unless ``now``."""

from __future__ import annotations

import asyncio
import logging

from rollout_gateway.aio import Periodic

log = logging.getLogger("test_aio")


async def test_a_failed_step_is_logged_and_the_loop_goes_on(caplog):
    calls = 0
    third = asyncio.Event()

    async def step() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("boom")
        if calls == 3:
            third.set()

    loop = Periodic(step, 0.001, what="the thing", log=log, now=True)
    loop.start()
    loop.start()  # already running: still one loop
    await asyncio.wait_for(third.wait(), 10)
    await loop.stop()
    assert not loop.running
    done = calls
    assert done >= 3
    assert "the thing failed: boom" in caplog.text
    assert [r.levelno for r in caplog.records if "failed" in r.message] == [logging.WARNING]
    await loop.stop()  # stopping a stopped loop is fine
    assert calls == done  # nothing runs after stop


async def test_the_first_step_waits_one_period_unless_now():
    ran = asyncio.Event()

    async def step() -> None:
        ran.set()

    later = Periodic(step, 3600, what="later", log=log)
    later.start()
    for _ in range(20):  # let the loop run up to its first wait
        await asyncio.sleep(0)
    assert later.running and not ran.is_set()
    await later.stop()

    at_once = Periodic(step, 3600, what="at once", log=log, now=True)
    at_once.start()
    await asyncio.wait_for(ran.wait(), 10)
    await at_once.stop()
    assert not at_once.running
