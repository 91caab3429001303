"""Small asyncio helpers shared by the gateway's background tasks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel a background task (if any) and wait until it has stopped."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class Periodic:
    """Runs ``step`` every ``period_s`` seconds in one background task, from ``start()``
    (call it from the event loop; a second call does nothing) to ``stop()``.

    The first step runs after one period, or at once with ``now``. A step that raises is
    logged on ``log`` as ``"<what> failed: <error>"`` (with its traceback when ``trace``) and
    the next one runs on time: the loop never dies of a failed step."""

    def __init__(self, step: Callable[[], Awaitable[object]], period_s: float, *, what: str,
                 log: logging.Logger, now: bool = False, trace: bool = False) -> None:
        self.step = step
        self.period_s = period_s
        self.what = what
        self.log = log
        self.now = now
        self.trace = trace
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _loop(self) -> None:
        if not self.now:
            await asyncio.sleep(self.period_s)
        while True:
            try:
                await self.step()
            except Exception as exc:  # noqa: BLE001 - the loop must survive a failed step
                self.log.warning("%s failed: %s", self.what, exc, exc_info=self.trace)
            await asyncio.sleep(self.period_s)
