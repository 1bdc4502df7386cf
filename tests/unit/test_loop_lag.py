"""The event-loop lag watcher: work that holds the loop shows as a late wake-up."""

from __future__ import annotations

import asyncio
import time

import pytest

from proxy.runtime import loop_lag

pytestmark = pytest.mark.unit


def test_work_holding_the_loop_is_seen_as_lag() -> None:
    seen: list[float] = []

    async def scenario() -> None:
        watcher = asyncio.create_task(loop_lag.watch(0.005, seen.append))
        await asyncio.sleep(0.02)  # a few wake-ups on time
        on_time = len(seen)
        time.sleep(0.1)  # noqa: ASYNC251 - the loop held on purpose: nothing else runs
        await asyncio.sleep(0.02)
        watcher.cancel()
        assert on_time >= 1
        assert seen[on_time:], "woken again after the hold"

    asyncio.run(scenario())
    assert all(lag >= 0 for lag in seen)
    assert max(seen) >= 0.09, "the 100 ms hold, less the 5 ms interval"
