"""How long a recovery waits for transactions open in the log (`Recovery._transaction_wait_s`):
until Kafka will have aborted them, within the settings' bounds, and the fixed wait when
Kafka does not tell (the waits themselves against a real Kafka:
tests/integration/test_recovery.py)."""

from __future__ import annotations

import time

import pytest

from dedup.recovery import Recovery
from dedup.transaction_deadlines import DeadlineUnknown

pytestmark = pytest.mark.unit


class Deadlines:
    def __init__(self, answer: float | Exception) -> None:
        self.answer = answer

    async def latest(self, topic: str, partition: int, below: int) -> float:
        if isinstance(self.answer, Exception):
            raise self.answer
        return time.time() + self.answer


def recovery(deadlines: Deadlines, wait_s: float, max_s: float) -> Recovery:
    nothing: object = None  # a recovery that only decides how long to wait needs nothing else
    return Recovery(
        *([nothing] * 7),  # type: ignore[arg-type]
        deadlines,  # type: ignore[arg-type]
        max_producers=1,
        replay_transaction_wait_s=wait_s,
        replay_transaction_wait_max_s=max_s,
    )


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
    wait = await recovery(Deadlines(until_deadline), wait_s, max_s)._transaction_wait_s("t", 0, 9)
    assert wait == pytest.approx(expected, abs=0.5)


@pytest.mark.parametrize(
    "error", [DeadlineUnknown("not listed"), OSError("refused"), TimeoutError()]
)
async def test_a_deadline_kafka_does_not_tell_leaves_the_fixed_wait(error: Exception) -> None:
    assert await recovery(Deadlines(error), 60.0, 930.0)._transaction_wait_s("t", 0, 9) == 60.0
