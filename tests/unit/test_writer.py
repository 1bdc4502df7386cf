"""The idempotent writer's bookkeeping against a scripted broker (pure logic, no sockets).

The fake answers each Produce request the way a test script says: success, an error
code, or a dropped connection (the request's fate unknown). The writer gets the fake link
and a fake fencer injected, as `dedup.service` gives it the real ones. The integration
tests cover the same code against real Kafka; these pin down the sequence rules one case
at a time.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from kio.schema.errors import ErrorCode

from dedup.fencing import ProducerIdentity
from dedup.writer import SEQUENCE_WRAP, BatchToWrite, IdempotentWriter, WriteResult
from proxy.kafka.topology import Endpoint
from proxy.kafka.upstream_client import LinkClosed

pytestmark = pytest.mark.unit

BROKER = Endpoint("kafka", 9092)
DROP = "drop"  # the connection dies: the request may or may not have run
HOLD = "hold"  # no answer until the test gives one (`FakeLink.answer_held`)


@dataclass
class FakeLink:
    """Answers Produce requests from a script; records (producer id, sequence) of each send."""

    script: deque[Any] = field(default_factory=deque)
    sent: list[tuple[int, int, bytes]] = field(default_factory=list)
    producer_ids: deque[int] = field(default_factory=lambda: deque([100, 200, 300]))
    is_open: bool = True
    held: deque[tuple[asyncio.Future[Any], list[tuple[str, int]]]] = field(default_factory=deque)

    def answer_held(self, code: int) -> None:
        answer, parts = self.held.popleft()
        answer.set_result(_response(parts, code))

    def send(self, request: Any) -> asyncio.Future[Any]:
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        parts = []
        for topic in request.topic_data:
            for part in topic.partition_data:
                producer_id, sequence = _decode(bytes(part.records))
                self.sent.append((producer_id, sequence, bytes(part.records)))
                parts.append((str(topic.name), int(part.index)))
        step = self.script.popleft() if self.script else 0
        if step == DROP:
            answer.set_exception(LinkClosed("cut"))
        elif step == HOLD:
            self.held.append((answer, parts))
        else:
            answer.set_result(_response(parts, int(step)))
        return answer

    async def close(self) -> None:
        self.is_open = False


def _encode(producer_id: int, epoch: int, sequence: int) -> bytes:
    return f"{producer_id}:{sequence}".encode()


def _decode(batch: bytes) -> tuple[int, int]:
    producer_id, sequence = batch.decode().split(":")
    return int(producer_id), int(sequence)


def _response(parts: list[tuple[str, int]], code: int) -> Any:
    by_topic: dict[str, list[Any]] = {}
    for topic, index in parts:
        by_topic.setdefault(topic, []).append(
            SimpleNamespace(
                index=index,
                error_code=code,
                base_offset=42 if code == 0 else -1,
                log_append_time=None,
                log_start_offset=0,
                error_message=None,
            )
        )
    return SimpleNamespace(
        responses=[SimpleNamespace(name=t, partition_responses=p) for t, p in by_topic.items()]
    )


@dataclass
class FakeFencer:
    """Hands out the link's producer ids as InitProducerId would; records fences."""

    link: FakeLink
    fenced: list[list[tuple[str, int]]] = field(default_factory=list)

    async def new_epoch(self) -> ProducerIdentity:
        return ProducerIdentity(self.link.producer_ids.popleft(), 0)

    async def fence(self, partitions: Any) -> ProducerIdentity:
        self.fenced.append(sorted(partitions))
        return await self.new_epoch()


def scripted_writer(
    link: FakeLink,
    leader: Callable[[], Endpoint | None] = lambda: BROKER,
    give_up_s: float = 120.0,
    fencer: FakeFencer | None = None,
) -> IdempotentWriter:
    """A writer whose every connection is `link` and whose producer ids come from `fencer`."""

    async def leader_of(topic: str, partition: int) -> Endpoint | None:
        return leader()

    async def connect(endpoint: Endpoint, lane: int) -> FakeLink:
        return link

    return IdempotentWriter(
        leader_of,
        fencer or FakeFencer(link),
        connect,
        timeout_s=1.0,
        retry_backoff_s=0.001,
        ambiguous_give_up_s=give_up_s,
    )


def batch(
    count: int = 10,
    partition: int = 0,
    *,
    wanted: Callable[[], bool] | None = None,
    settled: Callable[[WriteResult], None] | None = None,
) -> BatchToWrite:
    return BatchToWrite("t", partition, count, _encode, wanted=wanted, settled=settled)


async def settle_all() -> None:
    """Let every task that can run, run (the writer's completions)."""
    for _ in range(20):
        await asyncio.sleep(0)


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def test_sequences_follow_record_counts_and_wrap() -> None:
    async def scenario() -> list[int]:
        link = FakeLink()
        writer = scripted_writer(link)
        await writer.write(BROKER, [batch(10)], 1000)
        await writer.write(BROKER, [batch(5)], 1000)
        await writer.write(BROKER, [batch(SEQUENCE_WRAP - 18)], 1000)  # up to WRAP - 3
        await writer.write(BROKER, [batch(5)], 1000)
        await writer.write(BROKER, [batch(1)], 1000)
        return [sequence for _, sequence, _ in link.sent]

    assert run(scenario()) == [0, 10, 15, SEQUENCE_WRAP - 3, 2]


def test_concurrent_submits_keep_their_submission_order_on_the_wire() -> None:
    async def scenario() -> list[int]:
        link = FakeLink()
        writer = scripted_writer(link)
        futures = [await writer.submit(BROKER, [batch(3)], 1000) for _ in range(5)]
        await asyncio.gather(*futures)
        return [sequence for _, sequence, _ in link.sent]

    assert run(scenario()) == [0, 3, 6, 9, 12]


def test_definite_failure_rewinds_the_sequence_and_hides_out_of_order_from_clients() -> None:
    async def scenario() -> tuple[list[Any], list[int]]:
        link = FakeLink(
            script=deque([ErrorCode.not_leader_or_follower, ErrorCode.out_of_order_sequence_number])
        )
        writer = scripted_writer(link)
        first = await writer.submit(BROKER, [batch(10)], 1000)
        second = await writer.submit(BROKER, [batch(10)], 1000)
        results = [(await first)[0], (await second)[0]]
        await writer.write(BROKER, [batch(4)], 1000)
        return results, [sequence for _, sequence, _ in link.sent]

    results, sequences = run(scenario())
    assert [r.written for r in results] == [False, False]
    assert results[0].error_code == ErrorCode.not_leader_or_follower
    assert results[1].error_code == ErrorCode.not_enough_replicas  # never OUT_OF_ORDER
    assert sequences == [0, 10, 0], "after the failures the next batch reuses sequence 0"


def test_ambiguous_write_is_resent_with_the_same_bytes_until_kafka_is_definite() -> None:
    async def scenario() -> tuple[Any, list[tuple[int, int, bytes]]]:
        # The first send is cut; the re-send reaches a stale leader; then Kafka answers.
        link = FakeLink(script=deque([DROP, ErrorCode.not_leader_or_follower, 0]))
        writer = scripted_writer(link)
        (result,) = await writer.write(BROKER, [batch(10)], 1000)
        return result, link.sent

    result, sent = run(scenario())
    assert result.written
    assert len(sent) == 3 and len({entry for entry in sent}) == 1, "re-sent unchanged"


def test_ambiguous_write_behind_a_failed_one_is_not_written_and_not_resent() -> None:
    async def scenario() -> tuple[list[bool], int]:
        link = FakeLink(script=deque([ErrorCode.not_leader_or_follower, DROP]))
        writer = scripted_writer(link)
        first = await writer.submit(BROKER, [batch(10)], 1000)
        second = await writer.submit(BROKER, [batch(10)], 1000)
        written = [(await first)[0].written, (await second)[0].written]
        return written, len(link.sent)

    written, sends = run(scenario())
    assert written == [False, False]
    assert sends == 2, "Kafka refuses a batch whose predecessor is missing: no re-send needed"


def test_lost_producer_state_takes_a_new_producer_id_from_sequence_zero() -> None:
    async def scenario() -> list[tuple[int, int]]:
        link = FakeLink(script=deque([0, ErrorCode.unknown_producer_id, 0]))
        writer = scripted_writer(link)
        await writer.write(BROKER, [batch(10)], 1000)
        (lost,) = await writer.write(BROKER, [batch(10)], 1000)
        assert not lost.written and lost.error_code == ErrorCode.not_enough_replicas
        await writer.write(BROKER, [batch(10)], 1000)
        return [(producer, sequence) for producer, sequence, _ in link.sent]

    assert run(scenario()) == [(100, 0), (100, 10), (200, 0)]


def test_partitions_have_their_own_sequences() -> None:
    async def scenario() -> list[tuple[int, int]]:
        link = FakeLink()
        writer = scripted_writer(link)
        await writer.write(BROKER, [batch(10, partition=0), batch(7, partition=1)], 1000)
        await writer.write(BROKER, [batch(1, partition=1), batch(1, partition=0)], 1000)
        return [(sequence, len(payload)) for _, sequence, payload in link.sent]

    sent = run(scenario())
    # Each request lists partitions in order: p0, p1, then p0 (10), p1 (7).
    assert [s for s, _ in sent] == [0, 0, 10, 7]


def test_a_write_ambiguous_past_the_give_up_time_is_unresolved_and_so_is_its_successor() -> None:
    async def scenario() -> tuple[list[Any], int]:
        link = FakeLink(script=deque([DROP] * 1000))  # every attempt is cut
        writer = scripted_writer(link, give_up_s=0.05)
        first = await writer.submit(BROKER, [batch(10)], 1000)
        second = await writer.submit(BROKER, [batch(10)], 1000)
        results = [(await first)[0], (await second)[0]]
        return results, len(link.sent)

    results, _ = run(scenario())
    assert [r.written for r in results] == [False, False]
    assert [r.unresolved for r in results] == [True, True], "maybe written: never 'not written'"
    assert {r.error_code for r in results} == {ErrorCode.not_leader_or_follower}


def test_fence_continues_the_partitions_under_the_new_epoch_from_sequence_zero() -> None:
    async def scenario() -> tuple[list[tuple[int, int]], list[list[tuple[str, int]]]]:
        link = FakeLink()
        fencer = FakeFencer(link)
        writer = scripted_writer(link, fencer=fencer)
        await writer.write(BROKER, [batch(10, partition=0), batch(3, partition=1)], 1000)
        await writer.fence([("t", 0)])
        await writer.write(BROKER, [batch(5, partition=0), batch(2, partition=1)], 1000)
        return [(producer, sequence) for producer, sequence, _ in link.sent], fencer.fenced

    sent, fenced = run(scenario())
    assert fenced == [[("t", 0)]]
    # p0 restarts at 0 under the fenced identity; p1 goes on under its own.
    assert sent == [(100, 0), (100, 0), (200, 0), (100, 3)]


def test_a_forgotten_partition_starts_again_under_a_producer_it_never_used() -> None:
    """Forgotten (its topic deleted), a partition met again may be the same log after all
    (a broker's metadata lagged), holding the writer's producer at some sequence: it starts
    under a newer producer from sequence 0. A partition never written before takes the
    producer then current, with no other new one."""

    async def scenario() -> tuple[list[tuple[int, int]], bool]:
        link = FakeLink()
        writer = scripted_writer(link)
        await writer.write(BROKER, [batch(10, partition=0), batch(3, partition=1)], 1000)
        dropped = writer.forget("t", 0)
        await writer.write(BROKER, [batch(5, partition=0)], 1000)
        await writer.write(BROKER, [batch(2, partition=1), batch(4, partition=2)], 1000)
        return [(producer, sequence) for producer, sequence, _ in link.sent], dropped

    sent, dropped = run(scenario())
    assert dropped
    # p0 and p1 under 100; p0 again under 200 from 0; p1 goes on under 100; p2 new, 200.
    assert sent == [(100, 0), (100, 0), (200, 0), (100, 3), (200, 0)]


def test_a_partition_with_a_write_unresolved_is_not_forgotten() -> None:
    async def scenario() -> tuple[bool, bool, list[tuple[int, int]]]:
        link = FakeLink(script=deque([HOLD]))
        writer = scripted_writer(link)
        pending = await writer.submit(BROKER, [batch(10)], 1000)
        assert link.held, "sent by submit, its answer held"
        busy = writer.forget("t", 0)
        link.answer_held(0)
        await pending
        await writer.write(BROKER, [batch(1)], 1000)
        return busy, writer.forget("t", 0), [(p, s) for p, s, _ in link.sent]

    busy, idle, sent = run(scenario())
    assert not busy, "its write is still in flight"
    assert idle
    assert sent == [(100, 0), (100, 10)], "kept: it went on in sequence"


# ----------------------------------------------------------------------------- the caller's hooks


def test_a_failure_is_told_to_the_caller_and_a_batch_it_withdraws_takes_no_sequence() -> None:
    """The engine's guard against overtaking: B was decided while A was in flight; A
    fails; B, submitted after A's failure, is withdrawn (nothing sent, no sequence), so the
    next batch takes A's sequence and A's retry comes first."""

    async def scenario() -> tuple[list[Any], list[int]]:
        link = FakeLink(script=deque([HOLD]))
        writer = scripted_writer(link)
        told: list[WriteResult] = []
        first = await writer.submit(BROKER, [batch(10, settled=told.append)], 1000)
        link.answer_held(ErrorCode.not_leader_or_follower)
        await settle_all()
        assert [r.written for r in told] == [False], "told as soon as it is definite"
        second = await writer.submit(BROKER, [batch(10, wanted=lambda: not told)], 1000)
        retry = await writer.submit(BROKER, [batch(10)], 1000)
        results = [(await first)[0], (await second)[0], (await retry)[0]]
        return results, [sequence for _, sequence, _ in link.sent]

    results, sequences = run(scenario())
    assert [r.written for r in results] == [False, False, True]
    assert results[1].error_code == ErrorCode.not_enough_replicas  # retriable
    assert sequences == [0, 0], "the withdrawn batch sent nothing; the retry reuses 0"


def test_a_withdrawn_batch_does_not_hold_back_the_others_of_its_request() -> None:
    async def scenario() -> tuple[list[bool], list[tuple[int, int]]]:
        link = FakeLink()
        writer = scripted_writer(link)
        results = await writer.write(
            BROKER, [batch(5, partition=0, wanted=lambda: False), batch(3, partition=1)], 1000
        )
        await writer.write(BROKER, [batch(2, partition=0)], 1000)
        return [r.written for r in results], [(p, s) for p, s, _ in link.sent]

    written, sent = run(scenario())
    assert written == [False, True]
    assert sent == [(100, 0), (100, 0)], "p1 at 0, then p0 still at 0"


# ----------------------------------------------------------------------------- never stuck


def test_two_batches_of_one_partition_in_one_request_are_refused_before_anything_is_sent() -> None:
    """Kafka would append only the last of them, yet answer for both."""

    async def scenario() -> tuple[str, list[int]]:
        link = FakeLink()
        writer = scripted_writer(link)
        with pytest.raises(ValueError) as refused:
            await writer.submit(BROKER, [batch(5), batch(3)], 1000)
        await writer.write(BROKER, [batch(2)], 1000)
        return str(refused.value), [sequence for _, sequence, _ in link.sent]

    message, sequences = run(scenario())
    assert "one batch per partition" in message
    assert sequences == [0]


def test_a_batch_that_fails_to_build_leaves_nothing_assigned_and_no_slot_taken() -> None:
    """Before: the batches built before it kept their sequence, in flight forever, and
    their slot: the partition's fence (recovery) then waited forever."""

    def broken(producer_id: int, epoch: int, sequence: int) -> bytes:
        raise ValueError("cannot build")

    async def scenario() -> tuple[list[tuple[int, int]], list[list[tuple[str, int]]]]:
        link = FakeLink()
        fencer = FakeFencer(link)
        writer = scripted_writer(link, fencer=fencer)
        for _ in range(6):  # more than MAX_IN_FLIGHT_PER_PARTITION: no slot may leak
            with pytest.raises(ValueError):
                await writer.submit(
                    BROKER, [batch(5, partition=0), BatchToWrite("t", 1, 3, broken)], 1000
                )
        await asyncio.wait_for(writer.write(BROKER, [batch(5, partition=0)], 1000), 5)
        await asyncio.wait_for(writer.fence([("t", 0)]), 5)
        return [(p, s) for p, s, _ in link.sent], fencer.fenced

    sent, fenced = run(scenario())
    assert sent == [(100, 0)], "nothing of the failed submits was sent or assigned"
    assert fenced == [[("t", 0)]]


def test_a_surprise_while_resolving_an_ambiguous_write_gives_up_instead_of_hanging() -> None:
    """Before: the entry stayed in flight unresolved, and every later fence of the
    partition (its recovery) waited for it forever."""
    calls = [0]

    def leader() -> Endpoint | None:
        calls[0] += 1
        raise RuntimeError("metadata went wrong")

    async def scenario() -> tuple[WriteResult, list[list[tuple[str, int]]]]:
        link = FakeLink(script=deque([DROP]))
        fencer = FakeFencer(link)
        writer = scripted_writer(link, leader=leader, fencer=fencer)
        (result,) = await asyncio.wait_for(writer.write(BROKER, [batch(10)], 1000), 5)
        await asyncio.wait_for(writer.fence([("t", 0)]), 5)
        return result, fencer.fenced

    result, fenced = run(scenario())
    assert calls[0] == 1
    assert (result.written, result.unresolved) == (False, True), "maybe written: recover"
    assert fenced == [[("t", 0)]]


def test_an_error_code_unknown_to_kio_is_resolved_by_resending_not_left_hanging() -> None:
    async def scenario() -> tuple[WriteResult, int]:
        link = FakeLink(script=deque([999, 0]))  # a code from a newer Kafka, then success
        writer = scripted_writer(link)
        (result,) = await asyncio.wait_for(writer.write(BROKER, [batch(10)], 1000), 5)
        return result, len(link.sent)

    result, sends = run(scenario())
    assert result.written
    assert sends == 2


def laned_writer(links: list[FakeLink]) -> IdempotentWriter:
    """A writer with one fake connection per lane; producer ids come from lane 0's."""

    async def leader_of(topic: str, partition: int) -> Endpoint | None:
        return BROKER

    async def connect(endpoint: Endpoint, lane: int) -> FakeLink:
        return links[lane]

    return IdempotentWriter(
        leader_of,
        FakeFencer(links[0]),
        connect,
        timeout_s=1.0,
        retry_backoff_s=0.001,
        lanes=len(links),
    )


def partitions_sent(link: FakeLink) -> list[tuple[int, int]]:
    """(producer id, sequence) of each batch the link carried."""
    return [(producer, sequence) for producer, sequence, _ in link.sent]


def test_a_partition_keeps_its_lane_while_in_flight_and_the_others_take_the_least_loaded() -> None:
    async def scenario() -> list[FakeLink]:
        links = [FakeLink(script=deque([HOLD, HOLD, HOLD])), FakeLink(), FakeLink()]
        writer = laned_writer(links)
        first = await writer.submit(BROKER, [batch(10, partition=0)], 1000)  # held on lane 0
        # Partition 0 has a batch in flight on lane 0: its next one follows it there,
        # although lanes 1 and 2 carry nothing.
        second = await writer.submit(BROKER, [batch(5, partition=0)], 1000)
        # Partition 1 has nothing in flight: it takes the least loaded lane.
        await writer.write(BROKER, [batch(3, partition=1)], 1000)
        links[0].answer_held(0)
        links[0].answer_held(0)
        assert all(r.written for r in [*(await first), *(await second)])
        # Partition 2 goes where lane 0 is loaded; partition 0, with nothing in flight
        # any more, may leave lane 0 now.
        third = await writer.submit(BROKER, [batch(1, partition=2)], 1000)
        await writer.write(BROKER, [batch(2, partition=0)], 1000)
        links[0].answer_held(0)
        assert (await third)[0].written
        return links

    lane0, lane1, lane2 = run(scenario())
    assert partitions_sent(lane0) == [(100, 0), (100, 10), (100, 0)]  # p0, p0, p2
    assert partitions_sent(lane1) == [(100, 0), (100, 15)]  # p1, then p0 moved
    assert lane2.sent == []


def test_a_request_whose_partitions_sit_on_two_lanes_goes_as_one_request_per_lane() -> None:
    async def scenario() -> tuple[list[WriteResult], list[FakeLink]]:
        links = [FakeLink(script=deque([HOLD, HOLD])), FakeLink(script=deque([HOLD, HOLD]))]
        writer = laned_writer(links)
        held = [
            await writer.submit(BROKER, [batch(10, partition=0)], 1000),  # lane 0
            await writer.submit(BROKER, [batch(20, partition=1)], 1000),  # lane 1: less loaded
        ]
        both = await writer.submit(BROKER, [batch(1, partition=0), batch(2, partition=1)], 1000)
        for link in links:
            link.answer_held(0)
            link.answer_held(0)
        for future in held:
            await future
        return await both, links

    results, (lane0, lane1) = run(scenario())
    assert [r.written for r in results] == [True, True]
    assert partitions_sent(lane0) == [(100, 0), (100, 10)], "partition 0, in order"
    assert partitions_sent(lane1) == [(100, 0), (100, 20)], "partition 1, in order"


def test_an_ambiguous_write_is_resent_on_its_partitions_lane() -> None:
    async def scenario() -> tuple[WriteResult, list[FakeLink]]:
        links = [FakeLink(script=deque([HOLD])), FakeLink(script=deque([DROP, 0]))]
        writer = laned_writer(links)
        held = await writer.submit(BROKER, [batch(10, partition=0)], 1000)  # loads lane 0
        (result,) = await writer.write(BROKER, [batch(5, partition=1)], 1000)  # lane 1, cut
        links[0].answer_held(0)
        await held
        return result, links

    result, (lane0, lane1) = run(scenario())
    assert result.written
    assert partitions_sent(lane0) == [(100, 0)]
    assert partitions_sent(lane1) == [(100, 0), (100, 0)], "the re-send stays on lane 1"


def test_lanes_must_be_at_least_one() -> None:
    link = FakeLink()
    with pytest.raises(ValueError, match="lanes"):
        IdempotentWriter(lambda t, p: BROKER, FakeFencer(link), lambda e, lane: link, lanes=0)  # type: ignore[arg-type,return-value]


def test_an_answer_that_never_comes_is_unknown_once_the_deadline_passes() -> None:
    async def scenario() -> tuple[Any, bool, float]:
        writer = scripted_writer(FakeLink())  # timeout_s 1.0, added to the request's own
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        started = time.monotonic()
        result = await writer._await_answer(answer, timeout_ms=0)
        return result, answer.done(), time.monotonic() - started

    result, answer_done, took = run(scenario())
    assert result is None  # the request's fate is unknown: resolved as ambiguous
    assert answer_done  # a late answer from Kafka finds it settled and is skipped
    assert 0.9 <= took < 10


def test_a_cancellation_that_arrives_with_the_answer_is_not_lost() -> None:
    """The case Python 3.11's wait_for gets wrong (CPython gh-86296)."""

    async def scenario() -> bool:
        writer = scripted_writer(FakeLink())
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        waiting = asyncio.create_task(writer._await_answer(answer, 1000))
        await asyncio.sleep(0)  # it waits on the answer now
        answer.set_result(_response([("t", 0)], 0))
        waiting.cancel()
        try:
            await waiting
        except asyncio.CancelledError:
            return True
        return False

    assert run(scenario())
