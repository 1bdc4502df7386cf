"""The proxy's metadata refreshes over time (`UpstreamCluster.keep_refreshed`): one per
interval while the cluster answers, sooner after one that reached no broker (backing off
to a few seconds), and never ended by a pass that fails unexpectedly."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from proxy.kafka.topology import Endpoint, Topology
from proxy.runtime.cluster import UpstreamCluster

INTERVAL_S = 30.0


class Stop(Exception):
    """Ends the loop under test once the scripted refreshes are used up."""


class ScriptedCluster(UpstreamCluster):
    """Refreshes that succeed, fail or raise as scripted; each wait before one noted."""

    def __init__(self, script: list[bool | Exception]) -> None:
        super().__init__(Topology([Endpoint("kafka", 9092)], "proxy", broker_port_base=40000), 1.0)
        self._script: Iterator[bool | Exception] = iter(script)
        self._refreshes = len(script)
        self.waits: list[float] = []

    async def refresh_metadata(self) -> bool:
        outcome = next(self._script)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def sleep(self, delay_s: float) -> None:
        self.waits.append(delay_s)
        if len(self.waits) > self._refreshes:
            raise Stop


async def run(script: list[bool | Exception], last_ok: bool) -> list[float]:
    """The waits the loop asked for: one before each scripted refresh, and the next."""
    cluster = ScriptedCluster(script)
    with pytest.raises(Stop):
        await cluster.keep_refreshed(
            INTERVAL_S, last_ok, first_retry_s=1.0, last_retry_s=5.0, sleep=cluster.sleep
        )
    return cluster.waits


async def test_a_cluster_that_answers_is_asked_once_per_interval() -> None:
    assert await run([True, True], last_ok=True) == [INTERVAL_S] * 3


async def test_after_a_failure_the_next_refresh_comes_sooner_backing_off_to_the_interval() -> None:
    waits = await run([False] * 6 + [True], last_ok=True)
    assert waits == [INTERVAL_S, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0, INTERVAL_S]


async def test_a_short_interval_bounds_the_retries_too() -> None:
    cluster = ScriptedCluster([False, False])
    with pytest.raises(Stop):
        await cluster.keep_refreshed(1.5, True, first_retry_s=1.0, sleep=cluster.sleep)
    assert cluster.waits == [1.5, 1.0, 1.5]


async def test_a_proxy_started_before_its_cluster_asks_again_within_a_second() -> None:
    assert await run([True], last_ok=False) == [1.0, INTERVAL_S]


async def test_an_unexpected_error_in_one_refresh_does_not_end_the_loop() -> None:
    waits = await run([RuntimeError("a defect"), True], last_ok=True)
    assert waits == [INTERVAL_S, 1.0, INTERVAL_S]


async def test_cancelling_the_loop_ends_it() -> None:
    cluster = ScriptedCluster([])
    task = asyncio.ensure_future(cluster.keep_refreshed(INTERVAL_S, True))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
