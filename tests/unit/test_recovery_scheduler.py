"""The recovery queue keeps working through a defect: a partition whose opening failed is
retried while the others open, and a request starts the queue's loop again if it ended."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import pytest

from dedup.partitions import Key
from dedup.recovery import Later, RecoveredPartition
from dedup.recovery_scheduler import RecoveryScheduler
from dedup.state import RecoveredState
from proxy.runtime.metrics import BACKGROUND_PASS_ERRORS

pytestmark = pytest.mark.unit

A, B = ("orders", 0), ("orders", 1)


class InstantRecovery:
    """Every partition recovered at once, empty (`ports.PartitionRecovery`)."""

    def __init__(self) -> None:
        self.calls: list[list[Key]] = []
        self.called = asyncio.Event()
        self.hold = asyncio.Event()
        self.hold.set()

    async def run(
        self, partitions: Sequence[Key], later: Later
    ) -> tuple[dict[Key, RecoveredPartition], dict[Key, Exception]]:
        self.calls.append(list(partitions))
        self.called.set()
        await self.hold.wait()
        empty = RecoveredState({}, {})
        return {
            key: RecoveredPartition(*key, f"token-{len(self.calls)}", 0, None, 0, 0, 0, 0.0, empty)
            for key in partitions
        }, {}


async def test_a_partition_whose_opening_failed_is_retried_and_the_others_open() -> None:
    recovery = InstantRecovery()
    scheduler = RecoveryScheduler(recovery, retry_s=(0.01, 0.01))  # type: ignore[arg-type]
    opened: list[Key] = []
    failures_left = {A: 1}

    def on_opened(key: Key, result: RecoveredPartition) -> None:
        if failures_left.get(key):
            failures_left[key] -= 1
            raise RuntimeError("a defect in what opens the maps")
        opened.append(key)

    scheduler.on_opened = on_opened
    unexpected = BACKGROUND_PASS_ERRORS.labels("recovery")
    before = unexpected._value.get()
    try:
        scheduler.request_all([A, B], "first use")
        assert await scheduler.wait_recovered([A, B], 5)
        assert opened == [B, A], "B opened in the first run, A in its retry"
        assert [sorted(call) for call in recovery.calls] == [[A, B], [A]]
        assert scheduler.partitions.of(A).token == "token-2"
        assert unexpected._value.get() - before == 1
    finally:
        await scheduler.close()


async def test_a_request_starts_the_loop_again_even_for_a_partition_already_queued() -> None:
    recovery = InstantRecovery()
    recovery.hold.clear()
    scheduler = RecoveryScheduler(recovery)  # type: ignore[arg-type]
    try:
        scheduler.request(A, "first use")
        await asyncio.wait_for(recovery.called.wait(), 5)
        task = scheduler._task
        assert task is not None
        task.cancel()  # the loop ended (as by an error), A still queued
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert scheduler.recovering(A)
        recovery.hold.set()
        scheduler.request(A, "first use")  # what a request's gate does while A is not ready
        assert await scheduler.wait_recovered([A], 5)
        assert scheduler._task is not task
    finally:
        await scheduler.close()


class Unprintable(Exception):
    """An error whose own text fails (a defect in some library's exception)."""

    def __str__(self) -> str:
        raise ValueError("no text")


class FailingOnceRecovery(InstantRecovery):
    """Fails `failing`'s first recovery with an error that cannot be described."""

    def __init__(self, failing: Key) -> None:
        super().__init__()
        self.failing: Key | None = failing
        self.times: list[float] = []

    async def run(
        self, partitions: Sequence[Key], later: Later
    ) -> tuple[dict[Key, RecoveredPartition], dict[Key, Exception]]:
        self.times.append(asyncio.get_running_loop().time())
        recovered, failed = await super().run(partitions, later)
        if self.failing in recovered:
            failed[self.failing] = Unprintable()
            del recovered[self.failing]
            self.failing = None
        return recovered, failed


async def test_a_failure_that_cannot_be_recorded_is_still_retried_after_its_pause() -> None:
    recovery = FailingOnceRecovery(A)
    scheduler = RecoveryScheduler(recovery, retry_s=(0.3, 0.3))  # type: ignore[arg-type]
    unexpected = BACKGROUND_PASS_ERRORS.labels("recovery")
    before = unexpected._value.get()
    try:
        scheduler.request_all([A, B], "first use")
        assert await scheduler.wait_recovered([B], 5)
        assert scheduler.recovering(A), "queued again, not lost"
        assert await scheduler.wait_recovered([A], 5)
        assert [sorted(call) for call in recovery.calls] == [[A, B], [A]]
        first, retry = recovery.times
        assert retry - first >= 0.3, "after its pause, not at once"
        assert unexpected._value.get() - before == 1
    finally:
        await scheduler.close()


class OneWaitingRecovery(InstantRecovery):
    """``waiting``'s recovery is finished apart, once ``release`` is set, with ``error`` if
    one is given (as a partition whose log holds an open transaction: `Recovery.run`'s
    ``later``); only its first run waits."""

    def __init__(self, waiting: Key, error: Exception | None = None) -> None:
        super().__init__()
        self.waiting: Key | None = waiting
        self.error = error
        self.release = asyncio.Event()
        self.handed = asyncio.Event()  # set once the recovery was handed to ``later``

    async def run(
        self, partitions: Sequence[Key], later: Later
    ) -> tuple[dict[Key, RecoveredPartition], dict[Key, Exception]]:
        recovered, failed = await super().run(partitions, later)
        if self.waiting in recovered:
            result = recovered.pop(self.waiting)
            error, self.waiting = self.error, None

            async def finish() -> RecoveredPartition:
                await self.release.wait()
                if error is not None:
                    raise error
                return result

            later((result.topic, result.partition), finish())
            self.handed.set()
        return recovered, failed


async def test_a_recovery_that_waits_holds_up_neither_its_batch_nor_later_ones() -> None:
    C = ("orders", 2)
    recovery = OneWaitingRecovery(A)
    scheduler = RecoveryScheduler(recovery)  # type: ignore[arg-type]
    try:
        scheduler.request_all([A, B], "first use")
        assert await scheduler.wait_recovered([B], 5), "its batch is not held up"
        scheduler.request(C, "first use")
        assert await scheduler.wait_recovered([C], 5), "nor a batch after it"
        assert scheduler.recovering(A) and not scheduler.partitions.of(A).recovered
        assert [sorted(call) for call in recovery.calls] == [[A, B], [C]], "A not run again"
        recovery.release.set()
        assert await scheduler.wait_recovered([A], 5)
        assert not scheduler.recovering(A)
        assert scheduler.partitions.of(A).token == "token-1"
    finally:
        await scheduler.close()


async def test_a_recovery_finished_apart_that_failed_is_retried() -> None:
    recovery = OneWaitingRecovery(A, OSError("the replay failed"))
    scheduler = RecoveryScheduler(recovery, retry_s=(0.01, 0.01))  # type: ignore[arg-type]
    try:
        scheduler.request(A, "first use")
        await asyncio.wait_for(recovery.called.wait(), 5)
        recovery.release.set()
        assert await scheduler.wait_recovered([A], 5)
        assert recovery.calls == [[A], [A]]
        assert scheduler.partitions.of(A).token == "token-2"
    finally:
        await scheduler.close()


async def test_closing_cancels_a_recovery_finishing_apart() -> None:
    recovery = OneWaitingRecovery(A)
    scheduler = RecoveryScheduler(recovery)  # type: ignore[arg-type]
    scheduler.request(A, "first use")
    await asyncio.wait_for(recovery.handed.wait(), 5)
    (finishing,) = scheduler._finishing.values()
    await scheduler.close()
    assert finishing.cancelled()
