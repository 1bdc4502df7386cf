"""The CPU of one wait of the persisted positions' flusher (`PersistedRecorder._linger`):
`asyncio.wait_for` on an Event that nothing sets, timed out, against a timer that sets the
Event, and a plain sleep; on uvloop, 5,000 waits of 0.1 ms each, twice in turn.

    .venv/bin/python benchmarks/results/calls-2026-11-28/linger.py
"""

import asyncio
import contextlib
import time

import uvloop

WAITS = 5000
LINGER_S = 0.0001


async def main() -> None:
    event = asyncio.Event()

    async def wait_for() -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), LINGER_S)

    async def timer() -> None:
        handle = asyncio.get_running_loop().call_later(LINGER_S, event.set)
        try:
            await event.wait()
        finally:
            handle.cancel()
        event.clear()

    async def sleep() -> None:
        await asyncio.sleep(LINGER_S)

    for wait in (wait_for, timer, sleep) * 2:
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(WAITS):
            await wait()
        cpu_us = (time.process_time() - cpu) / WAITS * 1e6
        wall_us = (time.perf_counter() - wall) / WAITS * 1e6
        print(f"{wait.__name__:9} {cpu_us:5.1f} us CPU {wall_us:5.1f} us wall a wait")


uvloop.run(main())
