"""Acknowledged sequences are recorded off the client's path: merged, never lost."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from dedup.persisted import PersistedRecorder
from proxy.runtime.metrics import BACKGROUND_PASS_ERRORS

pytestmark = pytest.mark.unit


class FakeState:
    """Records mark_persisted calls; the first one waits for a gate, one may fail."""

    def __init__(
        self,
        fail_first: bool = False,
        round_trip_s: float = 0.0,
        failure: Exception | None = None,
    ) -> None:
        self.calls: list[list[tuple[str, int, dict[str, int]]]] = []
        self.gate = asyncio.Event()
        self.fail_first = fail_first
        self.round_trip_s = round_trip_s
        self.failure = failure or RedisConnectionError("down")

    async def mark_persisted(
        self,
        updates: Sequence[tuple[str, int, Mapping[str, int]]],
        now_ms: int,
        tokens: Sequence[str | None] | None = None,
    ) -> list[int]:
        await self.gate.wait()
        if self.round_trip_s:
            await asyncio.sleep(self.round_trip_s)
        if self.fail_first:
            self.fail_first = False
            raise self.failure
        self.calls.append([(t, p, dict(h)) for t, p, h in updates])
        return []


def test_updates_queued_during_a_flush_share_the_next_round_trip() -> None:
    async def scenario() -> list[Any]:
        state = FakeState()
        recorder = PersistedRecorder(state, linger_s=0)  # type: ignore[arg-type]
        recorder.add("t", 0, {"a": 1})
        await asyncio.sleep(0)  # the flusher is now waiting on Redis
        recorder.add("t", 0, {"a": 5, "b": 2})
        recorder.add("t", 0, {"a": 3})
        recorder.add("t", 1, {"a": 9})
        state.gate.set()
        await recorder.flush()
        return state.calls

    assert asyncio.run(scenario()) == [
        [("t", 0, {"a": 1})],
        [("t", 0, {"a": 5, "b": 2}), ("t", 1, {"a": 9})],
    ]


@pytest.mark.parametrize(
    "failure",
    [RedisConnectionError("down"), ValueError("a defect, or an answer nobody foresaw")],
    ids=["redis", "unexpected"],
)
def test_a_failed_flush_is_retried_not_dropped(failure: Exception) -> None:
    """Not dropped, and the flusher goes on: a reader waiting for the write (a snapshot, a
    handoff) would otherwise wait forever."""

    async def scenario() -> list[Any]:
        state = FakeState(fail_first=True, failure=failure)
        recorder = PersistedRecorder(state, retry_backoff_s=0.001)  # type: ignore[arg-type]
        recorder.add("t", 0, {"a": 4})
        state.gate.set()
        await asyncio.wait_for(recorder.flush(), 5)
        return state.calls

    unexpected = BACKGROUND_PASS_ERRORS.labels("persisted-flusher")
    before = unexpected._value.get()
    assert asyncio.run(scenario()) == [[("t", 0, {"a": 4})]]
    counted = unexpected._value.get() - before
    assert counted == (0 if isinstance(failure, RedisError) else 1)


def test_acks_within_the_linger_share_one_write() -> None:
    async def scenario() -> list[Any]:
        state = FakeState()
        state.gate.set()
        recorder = PersistedRecorder(state, linger_s=0.05)  # type: ignore[arg-type]
        recorder.add("t", 0, {"a": 1})
        await asyncio.sleep(0.005)  # the flusher lingers
        recorder.add("t", 0, {"a": 2})
        recorder.add("t", 1, {"b": 7})
        await asyncio.sleep(0.2)
        return state.calls

    assert asyncio.run(scenario()) == [[("t", 0, {"a": 2}), ("t", 1, {"b": 7})]]


def test_a_reader_that_flushes_does_not_wait_for_the_linger() -> None:
    async def scenario() -> float:
        state = FakeState()
        state.gate.set()
        recorder = PersistedRecorder(state, linger_s=30)  # type: ignore[arg-type]
        recorder.add("t", 0, {"a": 1})
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.wait_for(recorder.flush(), 5)
        assert state.calls == [[("t", 0, {"a": 1})]]
        # The next write lingers again: the hurry was for that reader only.
        recorder.add("t", 0, {"a": 2})
        await asyncio.sleep(0.05)
        assert state.calls == [[("t", 0, {"a": 1})]]
        return loop.time() - started

    assert asyncio.run(scenario()) < 5


def test_a_check_takes_its_partitions_updates_and_a_flush_waits_for_them() -> None:
    async def scenario() -> None:
        state = FakeState()
        state.gate.set()
        recorder = PersistedRecorder(state, linger_s=30)  # type: ignore[arg-type]
        recorder.add("t", 0, {"a": 1})
        recorder.add("t", 1, {"b": 2})
        acked = recorder.take({("t", 0)})
        assert acked is not None and acked.updates == [("t", 0, {"a": 1})]
        assert recorder.take({("t", 0)}) is None
        flushed = asyncio.create_task(recorder.flush())
        await asyncio.sleep(0.05)
        assert state.calls == [[("t", 1, {"b": 2})]]  # the rest, written at once
        assert not flushed.done(), "t/0 is still on its way with its check"
        acked.lost = []  # the check recorded it
        recorder.taken_done(acked)
        await asyncio.wait_for(flushed, 5)
        assert state.calls == [[("t", 1, {"b": 2})]]

    asyncio.run(scenario())


def test_updates_a_failed_check_took_go_back_to_the_flusher() -> None:
    async def scenario() -> None:
        state = FakeState()
        state.gate.set()
        recorder = PersistedRecorder(state, linger_s=30)  # type: ignore[arg-type]
        recorder.add("t", 0, {"a": 1})
        acked = recorder.take({("t", 0)})
        assert acked is not None
        recorder.add("t", 0, {"a": 3})  # acknowledged meanwhile
        recorder.taken_done(acked)  # the check failed: lost is None
        await asyncio.wait_for(recorder.flush(), 5)
        assert state.calls == [[("t", 0, {"a": 3})]]

    asyncio.run(scenario())


def test_a_partition_whose_state_was_lost_is_told_after_a_check_took_its_updates() -> None:
    async def scenario() -> list[tuple[str, int, str]]:
        lost: list[tuple[str, int, str]] = []
        recorder = PersistedRecorder(FakeState(), on_lost=lambda *k: lost.append(k))  # type: ignore[arg-type]
        recorder.add("t", 0, {"a": 1}, token="tok")
        acked = recorder.take({("t", 0)})
        assert acked is not None and acked.tokens == ["tok"]
        acked.lost = [0]
        recorder.taken_done(acked)
        await asyncio.wait_for(recorder.flush(), 5)
        return lost

    assert asyncio.run(scenario()) == [("t", 0, "tok")]


def test_a_check_takes_a_copy_of_the_flushers_write_under_way() -> None:
    """The flusher's write may land after the check (another connection): the check
    records those updates too, so it never reads a just-acknowledged record as unknown."""

    async def scenario() -> None:
        state = FakeState()  # its gate is shut: the write waits
        recorder = PersistedRecorder(state, linger_s=0)  # type: ignore[arg-type]
        recorder.add("t", 0, {"a": 1})
        await asyncio.sleep(0.01)  # the flusher's write is under way
        recorder.add("t", 0, {"b": 2})
        acked = recorder.take({("t", 0)})
        assert acked is not None and acked.updates == [("t", 0, {"a": 1, "b": 2})]
        acked.lost = []
        recorder.taken_done(acked)
        state.gate.set()
        await asyncio.wait_for(recorder.flush(), 5)
        assert state.calls == [[("t", 0, {"a": 1})]]  # the flusher's own write still lands

    asyncio.run(scenario())


def test_a_flush_waits_for_what_was_added_before_it_not_after() -> None:
    """Under a steady stream of acknowledgements the queue is never empty: a reader (a
    snapshot, a reset, a handoff) must still get through."""

    async def scenario() -> bool:
        state = FakeState(round_trip_s=0.003)
        state.gate.set()
        recorder = PersistedRecorder(state, linger_s=0.005)  # type: ignore[arg-type]
        recorder.add("t", 0, {"a": 0})
        stop = asyncio.Event()

        async def stream() -> None:
            n = 1
            while not stop.is_set():
                recorder.add("t", n % 3, {"a": n})
                n += 1
                await asyncio.sleep(0.001)

        streaming = asyncio.create_task(stream())
        await asyncio.sleep(0.02)
        flushed = asyncio.create_task(recorder.flush())
        done, _ = await asyncio.wait(
            {flushed, streaming}, timeout=10, return_when=asyncio.FIRST_COMPLETED
        )
        still_streaming = not streaming.done()
        stop.set()
        await streaming
        assert flushed in done, "the flush waited for the stream to stop"
        return still_streaming

    assert asyncio.run(scenario())


def test_a_reader_that_gives_up_leaves_the_others_waiting() -> None:
    async def scenario() -> None:
        state = FakeState()  # shut: the write waits
        recorder = PersistedRecorder(state, linger_s=0)  # type: ignore[arg-type]
        recorder.add("t", 0, {"a": 1})
        patient = asyncio.create_task(recorder.flush())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(recorder.flush(), 0.05)  # gives up
        assert not patient.done()
        state.gate.set()
        await asyncio.wait_for(patient, 5)  # not cancelled with the other one
        assert state.calls == [[("t", 0, {"a": 1})]]

    asyncio.run(scenario())
