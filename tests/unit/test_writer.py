"""The idempotent writer's bookkeeping against a scripted broker (pure logic, no sockets).

The fake answers each Produce request the way a test script says: success, an error
code, or a dropped connection (the request's fate unknown). The integration tests cover
the same code against real Kafka; these pin down the sequence rules one case at a time.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from kio.schema.errors import ErrorCode

from dedup.fencing import ProducerIdentity
from dedup.writer import SEQUENCE_WRAP, BatchToWrite, IdempotentWriter
from proxy.kafka.topology import Endpoint
from proxy.kafka.upstream_client import LinkClosed

pytestmark = pytest.mark.unit

BROKER = Endpoint("kafka", 9092)
DROP = "drop"  # the connection dies: the request may or may not have run


@dataclass
class FakeLink:
    """Answers Produce requests from a script; records (producer id, sequence) of each send."""

    script: deque[Any] = field(default_factory=deque)
    sent: list[tuple[int, int, bytes]] = field(default_factory=list)
    producer_ids: deque[int] = field(default_factory=lambda: deque([100, 200, 300]))
    is_open: bool = True

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


class ScriptedWriter(IdempotentWriter):
    def __init__(
        self,
        link: FakeLink,
        leader: Callable[[], Endpoint | None] = lambda: BROKER,
        give_up_s: float = 120.0,
    ):
        async def leader_of(topic: str, partition: int) -> Endpoint | None:
            return leader()

        super().__init__(
            lambda: [BROKER],
            leader_of,
            "test-instance",
            timeout_s=1.0,
            retry_backoff_s=0.001,
            ambiguous_give_up_s=give_up_s,
        )
        self.link = link
        self.fencer = FakeFencer(link)  # type: ignore[assignment]

    async def _link(self, endpoint: Endpoint) -> Any:
        return self.link


def batch(count: int = 10, partition: int = 0) -> BatchToWrite:
    return BatchToWrite("t", partition, count, _encode)


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def test_sequences_follow_record_counts_and_wrap() -> None:
    async def scenario() -> list[int]:
        writer = ScriptedWriter(FakeLink())
        await writer.write(BROKER, [batch(10)], 1000)
        await writer.write(BROKER, [batch(5)], 1000)
        writer._partition("t", 0).next_sequence = SEQUENCE_WRAP - 3
        await writer.write(BROKER, [batch(5)], 1000)
        await writer.write(BROKER, [batch(1)], 1000)
        return [sequence for _, sequence, _ in writer.link.sent]

    assert run(scenario()) == [0, 10, SEQUENCE_WRAP - 3, 2]


def test_concurrent_submits_keep_their_submission_order_on_the_wire() -> None:
    async def scenario() -> list[int]:
        writer = ScriptedWriter(FakeLink())
        futures = [await writer.submit(BROKER, [batch(3)], 1000) for _ in range(5)]
        await asyncio.gather(*futures)
        return [sequence for _, sequence, _ in writer.link.sent]

    assert run(scenario()) == [0, 3, 6, 9, 12]


def test_definite_failure_rewinds_the_sequence_and_hides_out_of_order_from_clients() -> None:
    async def scenario() -> tuple[list[Any], list[int]]:
        link = FakeLink(
            script=deque([ErrorCode.not_leader_or_follower, ErrorCode.out_of_order_sequence_number])
        )
        writer = ScriptedWriter(link)
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
        writer = ScriptedWriter(link)
        (result,) = await writer.write(BROKER, [batch(10)], 1000)
        return result, link.sent

    result, sent = run(scenario())
    assert result.written
    assert len(sent) == 3 and len({entry for entry in sent}) == 1, "re-sent unchanged"


def test_ambiguous_write_behind_a_failed_one_is_not_written_and_not_resent() -> None:
    async def scenario() -> tuple[list[bool], int]:
        link = FakeLink(script=deque([ErrorCode.not_leader_or_follower, DROP]))
        writer = ScriptedWriter(link)
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
        writer = ScriptedWriter(link)
        await writer.write(BROKER, [batch(10)], 1000)
        (lost,) = await writer.write(BROKER, [batch(10)], 1000)
        assert not lost.written and lost.error_code == ErrorCode.not_enough_replicas
        await writer.write(BROKER, [batch(10)], 1000)
        return [(producer, sequence) for producer, sequence, _ in link.sent]

    assert run(scenario()) == [(100, 0), (100, 10), (200, 0)]


def test_partitions_have_their_own_sequences() -> None:
    async def scenario() -> list[tuple[int, int]]:
        link = FakeLink()
        writer = ScriptedWriter(link)
        await writer.write(BROKER, [batch(10, partition=0), batch(7, partition=1)], 1000)
        await writer.write(BROKER, [batch(1, partition=1), batch(1, partition=0)], 1000)
        return [(sequence, len(payload)) for _, sequence, payload in link.sent]

    sent = run(scenario())
    # Each request lists partitions in order: p0, p1, then p0 (10), p1 (7).
    assert [s for s, _ in sent] == [0, 0, 10, 7]


def test_a_write_ambiguous_past_the_give_up_time_is_unresolved_and_so_is_its_successor() -> None:
    async def scenario() -> tuple[list[Any], int]:
        link = FakeLink(script=deque([DROP] * 1000))  # every attempt is cut
        writer = ScriptedWriter(link, give_up_s=0.05)
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
        writer = ScriptedWriter(link)
        await writer.write(BROKER, [batch(10, partition=0), batch(3, partition=1)], 1000)
        await writer.fence([("t", 0)])
        await writer.write(BROKER, [batch(5, partition=0), batch(2, partition=1)], 1000)
        fenced = writer.fencer.fenced  # type: ignore[attr-defined]
        return [(producer, sequence) for producer, sequence, _ in link.sent], fenced

    sent, fenced = run(scenario())
    assert fenced == [[("t", 0)]]
    # p0 restarts at 0 under the fenced identity; p1 goes on under its own.
    assert sent == [(100, 0), (100, 0), (200, 0), (100, 3)]
