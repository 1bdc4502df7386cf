"""How long the event loop is held at a stretch: its lag behind a short timer.

A proxy process is one event loop: whatever runs on it without awaiting (a large copy, a
long computation, a GC pause, the CPU taken by other processes) holds every connection of
the process meanwhile. A watcher asks to be woken every `INTERVAL_S` and records how late
it was woken (`dedup_proxy_event_loop_lag_seconds`): the longest wait any connection had
for the loop, to within the interval.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final

from proxy.runtime import metrics

INTERVAL_S: Final = 0.01  # a hundred wake-ups a second: some 0.2 % of a core


async def watch(
    interval_s: float = INTERVAL_S,
    observe: Callable[[float], None] = metrics.EVENT_LOOP_LAG.observe,
) -> None:
    """Runs until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        asleep = loop.time()
        await asyncio.sleep(interval_s)
        observe(max(0.0, loop.time() - asleep - interval_s))
