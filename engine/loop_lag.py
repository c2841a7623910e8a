"""The front end's event-loop lag: how late a periodic wake-up runs. Everything the front end does for a
request (parsing, tokenizing, detokenizing, writing SSE) runs on one event loop; when that loop is busy,
work for every other request waits behind it, and the wake-ups come late by that much.

    lag = LoopLag(); lag.start()             # inside the running loop (the app's lifespan)
    lag.worst_since(arrival_ns)              # seconds: the worst lag seen since then
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque

PERIOD_S = 0.05  # a wake-up every 50 ms: finer than a request's life, cheap (20 wake-ups a second)
KEEP = 1200  # samples kept: a minute at 50 ms; a request open longer sees its last minute


class LoopLag:
    """Samples the lag on a task of the running loop; `worst_since` reads the kept samples."""

    def __init__(self, period_s: float = PERIOD_S) -> None:
        self.period_s = period_s
        self.samples: deque[tuple[int, float]] = deque(maxlen=KEEP)  # (monotonic ns, lag s)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start sampling on the running loop."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            due = time.monotonic_ns() + int(self.period_s * 1e9)
            await asyncio.sleep(self.period_s)
            now = time.monotonic_ns()
            self.samples.append((now, max(now - due, 0) / 1e9))

    def worst_since(self, since_ns: int) -> float | None:
        """The largest lag sampled at or after `since_ns` (None when no sample is that recent)."""
        worst = None
        for t, lag in reversed(self.samples):
            if t < since_ns:
                break
            worst = lag if worst is None else max(worst, lag)
        return worst
