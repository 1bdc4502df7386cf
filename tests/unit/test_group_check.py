"""`dedup.group_check`: checks queued while a round trip is under way share the next one,
in the order they were queued; every caller gets its own verdicts or the round trip's
error. The state is an in-memory stand-in (the real script's order is tested against
Redis in `tests/integration/test_dedup_state.py`)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from prometheus_client import REGISTRY
from redis.exceptions import ConnectionError as RedisConnectionError

from dedup.group_check import GroupCheck
from dedup.persisted import PersistedRecorder
from dedup.state import Acked, PartitionCheck, PartitionVerdict, Persisted, Status


@dataclass
class RecordingState:
    """Answers each check with one NOT_DUP per identity; records every call's checks."""

    calls: list[list[PartitionCheck]] = field(default_factory=list)
    acked_calls: list[Acked | None] = field(default_factory=list)
    hold: asyncio.Event | None = None  # the next call waits for it
    fail: Exception | None = None  # the next call raises it (after its hold)

    async def check_and_push(
        self, checks: Sequence[PartitionCheck], now_ms: int, acked: Acked | None = None
    ) -> list[PartitionVerdict]:
        self.calls.append(list(checks))
        self.acked_calls.append(acked)
        hold, self.hold = self.hold, None
        fail, self.fail = self.fail, None
        if hold is not None:
            await hold.wait()
        if acked is not None:
            acked.lost = []
        if fail is not None:
            raise fail
        return [PartitionVerdict((Status.NOT_DUP,) * len(c.identities), ()) for c in checks]

    async def mark_persisted(
        self,
        updates: Sequence[tuple[str, int, dict[str, Persisted]]],
        now_ms: int,
        tokens: Sequence[str | None] | None = None,
    ) -> list[int]:
        return []

    async def reset_pushed(self, topic: str, partition: int, token: str | None = None) -> bool:
        return True


class Clock:
    def clock_ms(self) -> int:
        return 1_000


def check(partition: int, *sequences: int) -> PartitionCheck:
    return PartitionCheck("orders", partition, [("p", s) for s in sequences])


def counted() -> tuple[float, float]:
    """dedup_check_round_trips_total and dedup_checked_requests_total."""
    sample = REGISTRY.get_sample_value
    return (
        sample("dedup_check_round_trips_total") or 0.0,
        sample("dedup_checked_requests_total") or 0.0,
    )


def group_of(state: RecordingState) -> tuple[GroupCheck, PersistedRecorder]:
    persisted = PersistedRecorder(state, clock=Clock(), linger_s=60)
    return GroupCheck(state, persisted, Clock()), persisted


async def under_way() -> tuple[
    RecordingState, GroupCheck, asyncio.Event, asyncio.Future[list[PartitionVerdict]]
]:
    """A group whose first round trip (one check) is under way until the event is set."""
    held = asyncio.Event()
    state = RecordingState(hold=held)
    group, _ = group_of(state)
    first = group.queue([check(0, 1)])
    await asyncio.sleep(0)
    return state, group, held, first


async def test_checks_queued_during_a_round_trip_go_together_in_the_next_in_order() -> None:
    before = counted()
    state, group, held, first = await under_way()
    later = [group.queue([check(0, 2, 3)]), group.queue([check(1, 1), check(0, 4)])]
    held.set()
    assert [len(v.statuses) for v in await first] == [1]
    assert [[len(v.statuses) for v in await f] for f in later] == [[2], [1, 1]]
    assert state.calls == [[check(0, 1)], [check(0, 2, 3), check(1, 1), check(0, 4)]]
    assert [now - then for now, then in zip(counted(), before, strict=True)] == [2, 3]


async def test_every_caller_of_a_failed_round_trip_gets_its_error() -> None:
    state, group, held, first = await under_way()
    state.fail = RedisConnectionError("lost")  # for the second round trip
    later = [group.queue([check(0, 2)]), group.queue([check(0, 3)])]
    held.set()
    await first
    for waiting in later:
        with pytest.raises(RedisConnectionError):
            await waiting
    assert len(await group.queue([check(0, 4)])) == 1, "the next round trip goes on"


async def test_a_caller_that_gave_up_leaves_the_others_their_verdicts() -> None:
    state, group, held, first = await under_way()
    gave_up, kept = group.queue([check(0, 2)]), group.queue([check(0, 3)])
    gave_up.cancel()
    held.set()
    await first
    assert [v.statuses for v in await kept] == [(Status.NOT_DUP,)]
    assert state.calls[1] == [check(0, 2), check(0, 3)], "its check ran all the same"


async def test_acknowledgements_of_the_round_trips_partitions_go_with_it() -> None:
    state = RecordingState()
    group, persisted = group_of(state)
    persisted.add("orders", 0, {"p": 5})
    persisted.add("orders", 9, {"q": 1})  # another partition: not taken
    await group.queue([check(0, 6)])
    (acked,) = state.acked_calls
    assert acked is not None
    assert [(topic, partition) for topic, partition, _ in acked.updates] == [("orders", 0)]


async def test_closing_cancels_the_round_trip_under_way_and_the_checks_queued() -> None:
    state, group, _, first = await under_way()
    queued = group.queue([check(0, 2)])
    await group.close()
    assert first.cancelled() and queued.cancelled()
    assert len(state.calls) == 1, "nothing more was sent"
