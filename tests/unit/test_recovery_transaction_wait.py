"""How long a recovery waits for transactions open in the log (`Recovery._transaction_wait_s`):
until Kafka will have aborted them, within the settings' bounds, and the fixed wait when
Kafka does not tell; and the one lookup of those deadlines that the waiting partitions of a
recovery share (`Recovery._deadlines_of`). The waits themselves against a real Kafka:
tests/integration/test_recovery.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import pytest

from dedup.recovery import Recovery
from dedup.transaction_deadlines import DeadlineUnknown

pytestmark = pytest.mark.unit

Key = tuple[str, int]


class Deadlines:
    """Kafka's deadlines, seconds from now per partition (or why unknown); each lookup
    recorded, and held until ``release`` is set."""

    def __init__(self, answers: Mapping[Key, float | DeadlineUnknown]) -> None:
        self.answers = answers
        self.asked: list[dict[Key, int]] = []
        self.release = asyncio.Event()
        self.release.set()

    async def latest(self, below: Mapping[Key, int]) -> dict[Key, float | DeadlineUnknown]:
        self.asked.append(dict(below))
        await self.release.wait()
        now = time.time()
        return {
            key: answer if isinstance(answer, DeadlineUnknown) else now + answer
            for key, answer in self.answers.items()
            if key in below
        }


def recovery(deadlines: Deadlines | None, wait_s: float = 60.0, max_s: float = 930.0) -> Recovery:
    nothing: object = None  # a recovery that only decides how long to wait needs nothing else
    return Recovery(
        *([nothing] * 7),  # type: ignore[arg-type]
        deadlines,  # type: ignore[arg-type]
        max_producers=1,
        replay_transaction_wait_s=wait_s,
        replay_transaction_wait_max_s=max_s,
    )


async def in_(seconds: float) -> float:
    return time.time() + seconds


async def failing(error: Exception) -> float:
    raise error


@pytest.mark.parametrize(
    ("until_deadline", "wait_s", "max_s", "expected"),
    [
        (300.0, 60.0, 930.0, 300.0),  # Kafka's deadline, beyond the fixed wait
        (2000.0, 60.0, 930.0, 930.0),  # no longer than the longest wait
        (10.0, 60.0, 930.0, 60.0),  # never shorter than the fixed wait
        (300.0, 5.0, 1.0, 5.0),  # a longest wait below the fixed one: the fixed one
    ],
)
async def test_the_wait_runs_to_kafkas_deadline_within_the_bounds(
    until_deadline: float, wait_s: float, max_s: float, expected: float
) -> None:
    wait = await recovery(None, wait_s, max_s)._transaction_wait_s("t", 0, in_(until_deadline))
    assert wait == pytest.approx(expected, abs=0.5)


@pytest.mark.parametrize(
    "error", [DeadlineUnknown("not listed"), OSError("refused"), TimeoutError()]
)
async def test_a_deadline_kafka_does_not_tell_leaves_the_fixed_wait(error: Exception) -> None:
    assert await recovery(None)._transaction_wait_s("t", 0, failing(error)) == 60.0


async def test_the_waiting_partitions_of_a_recovery_share_one_lookup() -> None:
    """A client that died inside a transaction over many partitions: Kafka is asked once
    for all of them; each partition gets its own deadline, or its own reason why not; and
    one partition's recovery cancelled leaves the others theirs."""
    deadlines = Deadlines({("t", 0): 300.0, ("t", 1): 600.0, ("u", 0): DeadlineUnknown("no")})
    deadlines.release.clear()
    ends = {("t", 0): 5, ("t", 1): 7, ("u", 0): 9}
    of = recovery(deadlines)._deadlines_of(ends)
    waits = {key: asyncio.create_task(of(key)) for key in ends}
    await asyncio.sleep(0.01)
    waits[("t", 1)].cancel()
    await asyncio.sleep(0.01)
    deadlines.release.set()
    assert await waits[("t", 0)] == pytest.approx(time.time() + 300, abs=1)
    with pytest.raises(DeadlineUnknown):
        await waits[("u", 0)]
    with pytest.raises(asyncio.CancelledError):
        await waits[("t", 1)]
    assert deadlines.asked == [ends], "one lookup, every waiting partition's end in it"
    assert await of(("t", 1)) == pytest.approx(time.time() + 600, abs=1), "answered still"


async def test_a_recovery_with_no_partition_waiting_asks_nothing() -> None:
    deadlines = Deadlines({})
    recovery(deadlines)._deadlines_of({})
    await asyncio.sleep(0)
    assert deadlines.asked == []
