"""The proxy as an idempotent producer toward Kafka.

Deduplication decides which records to forward; this module makes sure each forwarded
batch lands in the log exactly once and in order, or definitely not at all. The proxy
writes under its own producer id with its own per-partition sequence numbers (at most
five batches in flight per partition), so Kafka itself

- refuses batch n+1 while batch n is missing (a failed batch is never overtaken), and
- resolves an ambiguous write (timeout, dropped connection): the same batch with the
  same producer id and sequence is either appended once or recognised as a duplicate.

Outcomes are therefore binary. ``written``: the batch is in the log exactly once.
``not written``: it is not, and never will be; the caller may let the client retry.
An ambiguous write is retried, in sequence order behind its predecessors, until Kafka
gives one of those two answers, or until ``ambiguous_give_up_s``: then the result is
``unresolved`` and the caller must fence the partition and recover it from the log
(`fence`), since only the log can say what happened.

A broker is written on up to ``lanes`` connections (`dedup.links` says why). A partition
stays on one lane while it has batches in flight, so Kafka sees them in sequence order; a
partition with none in flight takes the lane with the fewest bytes in flight, and a request
whose partitions sit on several lanes goes out as one Produce request per lane.

The producer id comes from `dedup.fencing.Fencer` (a transactional id per proxy instance),
so a restarted proxy can fence every write its previous incarnation left in flight. The
fencer and the connections to the brokers are given (`ProducerIds`, `LinkFactory`): the
composition root (`dedup.service`) builds them, tests script them.

A batch may carry two hooks for its caller (`BatchToWrite.wanted`, `.settled`): the caller
learns a batch's outcome the moment it is definite, before any later batch of the partition
takes a sequence, and may withdraw a batch up to the moment it would take one. With them the
caller keeps a later request from overtaking the retry of an earlier one that failed.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
from kio.schema.errors import ErrorCode

from dedup import metrics
from dedup.fencing import ProducerIdentity
from proxy.kafka.error_codes import error_code
from proxy.kafka.produce_codec import (
    RecordBytes,
    WriterPartitionData,
    WriterProduceRequest,
    WriterTopicData,
)
from proxy.kafka.topology import Endpoint
from proxy.kafka.upstream_client import LinkClosed

log = structlog.get_logger(__name__)

MAX_IN_FLIGHT_PER_PARTITION = 5
SEQUENCE_WRAP = 1 << 31  # Kafka sequences are int32 and wrap to 0

# Kafka appended the batch, or refused it as a repeat of one it already has.
_WRITTEN = {ErrorCode.none, ErrorCode.duplicate_sequence_number}
# The broker may have appended the batch: only a retry with the same sequence can tell.
_AMBIGUOUS = {
    ErrorCode.request_timed_out,
    ErrorCode.not_enough_replicas_after_append,
    ErrorCode.network_exception,
    ErrorCode.kafka_storage_error,
    ErrorCode.unknown_server_error,
}
# The partition lost this producer's state (expiry, truncation): a new producer id is needed.
_PRODUCER_STATE_LOST = {
    ErrorCode.unknown_producer_id,
    ErrorCode.invalid_producer_epoch,
    ErrorCode.out_of_order_sequence_number,
}
# Answers to a RE-SENT batch that prove the first attempt is not in the log either: the
# leader's sequence for this producer is not where it would be had the batch been written,
# or the data itself is refused. Anything else (a stale leader, too few replicas) says
# nothing about the first attempt, which may have reached the new leader before the old
# one died: the retry goes on.
_ABSENT = {
    ErrorCode.out_of_order_sequence_number,
    ErrorCode.unknown_producer_id,
    ErrorCode.message_too_large,
    ErrorCode.record_list_too_large,
    ErrorCode.invalid_record,
    ErrorCode.corrupt_message,
    ErrorCode.invalid_topic_exception,
    ErrorCode.topic_authorization_failed,
}
# A re-sent batch refused for its epoch: another fence (this instance's own, or a new owner
# of the partition fencing this one) came first. Whether the first attempt landed before
# that fence only a replay can tell, so the write is given up at once.
_FENCED = {ErrorCode.invalid_producer_epoch, ErrorCode.producer_fenced}
# Errors a client must never see from the proxy (fatal in librdkafka, or not retried).
_HIDDEN_FROM_CLIENTS = {*_PRODUCER_STATE_LOST, ErrorCode.network_exception}


@dataclass(frozen=True, slots=True)
class WriteResult:
    written: bool
    error_code: int = 0  # for the client when not written
    base_offset: int = -1  # -1 when Kafka reported a duplicate of an earlier append
    log_append_time_ms: int = -1
    log_start_offset: int = -1
    error_message: str | None = None
    unresolved: bool = False  # gave up: maybe written; fence and recover the partition


@dataclass(frozen=True, slots=True)
class BatchToWrite:
    topic: str
    partition: int
    record_count: int
    build: Callable[[int, int, int], RecordBytes]
    """(producer id, producer epoch, base sequence) -> the record batch bytes to append (a
    large one in pieces, written as they are: `RecordPieces`)."""
    wanted: Callable[[], bool] | None = None
    """Asked as the batch is about to take its sequence: False withdraws it (not written,
    nothing sent)."""
    settled: Callable[[WriteResult], None] | None = None
    """Told the outcome the moment it is definite, before a later batch of the partition
    can take a sequence."""


WITHDRAWN = WriteResult(
    written=False,
    error_code=ErrorCode.not_enough_replicas,
    error_message="not written: an earlier write to this partition failed; retry in order",
)


@dataclass(eq=False, slots=True)
class _InFlight:
    sequence: int
    batch: RecordBytes
    resolved: asyncio.Future[bool]  # True: written, False: not written or unresolved
    previous: _InFlight | None  # the batch before it in the partition, while unresolved
    unresolved: bool = False  # given up on: maybe written


_Producer = ProducerIdentity


@dataclass(slots=True)
class _Partition:
    producer: _Producer | None = None
    next_sequence: int = 0
    in_flight: deque[_InFlight] = field(default_factory=deque)
    slots: asyncio.Semaphore = field(
        default_factory=lambda: asyncio.Semaphore(MAX_IN_FLIGHT_PER_PARTITION)
    )
    rewind_to: int | None = None  # first sequence that failed while later ones were in flight
    needs_new_producer: bool = False
    switch_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    lane: int = 0  # the connection its batches go on; changes only when none is in flight


@dataclass(frozen=True, slots=True)
class _Sent:
    """One Produce request of a `submit`: its answer (None: the send itself failed)."""

    answer: asyncio.Future[Any] | None


LeaderLookup = Callable[[str, int], Awaitable[Endpoint | None]]


class ProducerIds(Protocol):
    """Where the writer's producer id comes from (`dedup.fencing.Fencer`)."""

    async def new_epoch(self) -> ProducerIdentity: ...

    async def fence(self, partitions: Sequence[tuple[str, int]]) -> ProducerIdentity: ...


class ProduceLink(Protocol):
    """A connection to a broker (`proxy.kafka.upstream_client.UpstreamClient`)."""

    @property
    def is_open(self) -> bool: ...

    def send(self, payload: Any) -> asyncio.Future[Any]: ...


LinkFactory = Callable[[Endpoint, int], Awaitable[ProduceLink]]
"""(broker, lane) -> an open connection (`dedup.links.UpstreamLinks.get`)."""


class IdempotentWriter:
    def __init__(
        self,
        leader_of: LeaderLookup,
        producer_ids: ProducerIds,
        connect: LinkFactory,
        *,
        timeout_s: float = 30.0,
        retry_backoff_s: float = 0.2,
        ambiguous_give_up_s: float = 120.0,
        may_write: Callable[[str, int], Awaitable[bool]] | None = None,
        lanes: int = 1,
    ) -> None:
        if lanes < 1:
            raise ValueError(f"lanes must be at least 1: {lanes}")
        self._leader_of = leader_of
        # Asked before a partition's first batch under a new producer epoch: does this
        # instance still own the partition? A new owner fences this instance's older
        # epochs; a batch under an epoch taken after that fence would get through.
        self._may_write = may_write
        self._producer_ids = producer_ids
        self._connect = connect
        self._timeout_s = timeout_s
        self._retry_backoff_s = retry_backoff_s
        self._give_up_s = ambiguous_give_up_s
        self._partitions: dict[tuple[str, int], _Partition] = {}
        self._producer: _Producer | None = None
        # The writer's producer when it last forgot a partition (`forget`): a partition
        # met afresh may be one forgotten, which used this producer or an older one.
        self._forgotten_under: _Producer | None = None
        self._producer_lock = asyncio.Lock()
        self._lanes = lanes
        # The link of each lane as last connected: a request on an open one awaits nothing
        # before its sequences are assigned.
        self._links: dict[tuple[Endpoint, int], ProduceLink] = {}
        # Per broker, the bytes sent on each lane and not answered yet.
        self._lane_bytes: dict[Endpoint, list[int]] = {}

    # ---------------------------------------------------------------- writing

    async def write(
        self, broker: Endpoint, batches: Sequence[BatchToWrite], timeout_ms: int
    ) -> list[WriteResult]:
        """Append each batch to its partition through ``broker``; one result per batch."""
        return await (await self.submit(broker, batches, timeout_ms))

    async def submit(
        self, broker: Endpoint, batches: Sequence[BatchToWrite], timeout_ms: int
    ) -> asyncio.Future[list[WriteResult]]:
        """Assign sequences and send now; the returned future gives one result per batch.

        When this returns, the batches hold their place in each partition's sequence, so a
        caller that submits in some order gets that order in the log. Raises only before
        anything was assigned: OSError (no connection), a `ProducerIds` error (FenceError),
        whatever a batch's ``build`` raises; ValueError for two batches of one partition
        (Kafka would keep only the last of them).
        """
        keys = [(batch.topic, batch.partition) for batch in batches]
        if len(keys) == 1:  # the usual write: one partition
            ordered = [0]
        else:
            if len(set(keys)) < len(keys):
                raise ValueError("one batch per partition and request: Kafka keeps only the last")
            ordered = sorted(range(len(batches)), key=keys.__getitem__)
        partitions = [self._partition(*keys[i]) for i in ordered]
        acquired: list[_Partition] = []
        try:
            for partition in partitions:  # sorted acquisition: no deadlock between requests
                await partition.slots.acquire()
                acquired.append(partition)
            refused = set()
            for n, partition in enumerate(partitions):
                if partition.producer is not None and not partition.needs_new_producer:
                    continue  # the usual case, without a call
                if not await self._ensure_producer(partition, keys[ordered[n]]):
                    refused.add(n)
            links: dict[int, ProduceLink] = {}
            while True:  # the lanes, once every one they name is connected
                lanes = self._lanes_of(broker, partitions)
                connected = False
                for lane in sorted(set(lanes) - links.keys()):
                    link = self._links.get((broker, lane))
                    if link is None or not link.is_open:
                        link = self._links[(broker, lane)] = await self._connect(broker, lane)
                        connected = True
                    links[lane] = link
                if not connected:  # nothing awaited: the lanes are still the partitions'
                    break
            # From here to send() nothing awaits: sequences are assigned in wire order.
            # Every batch is built before any takes its sequence, so one that fails to
            # build leaves nothing half assigned.
            planned = [
                (partitions[n].next_sequence, None)
                if n in refused
                else self._plan(partitions[n], batches[i])
                for n, i in enumerate(ordered)
            ]
            by_lane: dict[int, list[tuple[BatchToWrite, RecordBytes]]] = {}
            for n, (i, (_, data)) in enumerate(zip(ordered, planned, strict=True)):
                if data is not None:
                    by_lane.setdefault(lanes[n], []).append((batches[i], data))
            requests = {
                lane: self._produce_request(items, timeout_ms) for lane, items in by_lane.items()
            }
        except BaseException:
            for partition in acquired:
                partition.slots.release()
            raise
        entries: list[_InFlight | None] = []
        for n, (i, (sequence, data)) in enumerate(zip(ordered, planned, strict=True)):
            if data is None:
                entries.append(None)
                continue
            partitions[n].lane = lanes[n]
            entries.append(self._assign(partitions[n], batches[i], sequence, data))
        sent = [
            self._send(links[lane], broker, lane, request, by_lane[lane])
            for lane, request in requests.items()
            if request is not None
        ]
        return asyncio.get_running_loop().create_task(
            self._complete(batches, ordered, partitions, entries, sent, timeout_ms)
        )

    def _lanes_of(self, broker: Endpoint, partitions: Sequence[_Partition]) -> list[int]:
        """The lane of each partition: its own while it has batches in flight; for the
        others, the lane of the first that has, else the broker's least loaded lane (one
        request, where the partitions allow)."""
        pinned = [partition.lane for partition in partitions if partition.in_flight]
        if pinned:
            free = pinned[0]
        else:
            loads = self._loads(broker)
            free = loads.index(min(loads))
        return [partition.lane if partition.in_flight else free for partition in partitions]

    def _loads(self, broker: Endpoint) -> list[int]:
        loads = self._lane_bytes.get(broker)
        if loads is None:
            loads = self._lane_bytes[broker] = [0] * self._lanes
        return loads

    def _send(
        self,
        link: ProduceLink,
        broker: Endpoint,
        lane: int,
        request: WriterProduceRequest,
        items: Sequence[tuple[BatchToWrite, RecordBytes]],
    ) -> _Sent:
        """Send one Produce request; its bytes count on the lane until it is answered."""
        try:
            answer = link.send(request)
        except Exception:  # LinkClosed above all: maybe sent, maybe not
            return _Sent(None)  # resolved like any ambiguous write
        loads = self._loads(broker)
        size = sum(len(data) for _, data in items)
        loads[lane] += size

        def answered(_: asyncio.Future[Any]) -> None:
            loads[lane] -= size

        answer.add_done_callback(answered)
        return _Sent(answer)

    async def _complete(
        self,
        batches: Sequence[BatchToWrite],
        ordered: list[int],
        partitions: list[_Partition],
        entries: list[_InFlight | None],
        sent: Sequence[_Sent],
        timeout_ms: int,
    ) -> list[WriteResult]:
        try:
            # A partition left out of `results` is re-sent. One request is the usual case:
            # no gather (a task per answer) for it.
            if len(sent) == 1:
                results = await self._read_answer(sent[0].answer, timeout_ms)
            else:
                results = {}
                for answered in await asyncio.gather(
                    *(self._read_answer(request.answer, timeout_ms) for request in sent)
                ):
                    results.update(answered)
            outcomes: dict[int, WriteResult] = {}
            for n, i in enumerate(ordered):
                batch, entry = batches[i], entries[n]
                if entry is None:
                    outcomes[i] = WITHDRAWN
                    continue
                outcome = results.get((batch.topic, batch.partition))
                outcomes[i] = await self._settle_safely(batch, partitions[n], entry, outcome)
            return [outcomes[i] for i in range(len(batches))]
        finally:
            for partition in partitions:
                partition.slots.release()

    async def _read_answer(
        self, answer: asyncio.Future[Any] | None, timeout_ms: int
    ) -> dict[tuple[str, int], WriteResult]:
        """`_await_answer`, with nothing for a request whose fate is unknown."""
        if answer is None:
            return {}
        try:
            return await self._await_answer(answer, timeout_ms) or {}
        except Exception:  # an answer that cannot be read says nothing: re-send
            log.exception("reading a produce answer failed; resolving as ambiguous")
            return {}

    async def _settle_safely(
        self,
        batch: BatchToWrite,
        partition: _Partition,
        entry: _InFlight,
        outcome: WriteResult | None,
    ) -> WriteResult:
        """`_settle`, and on any surprise give up (maybe written): an entry left unresolved
        would hold every later batch and every fence of the partition forever."""
        try:
            return await self._settle(batch, partition, entry, outcome)
        except Exception:
            log.exception("settling a write failed", topic=batch.topic, partition=batch.partition)
            if entry.resolved.done():  # settled before the surprise: only its hook failed
                return WriteResult(written=entry.resolved.result())
            result = self._give_up(batch, partition, entry, attempts=0)
            _tell(batch, result)
            self._finish(partition, entry, written=False)
            return result

    async def _ensure_producer(self, partition: _Partition, key: tuple[str, int]) -> bool:
        """Give the partition a producer id it can start at sequence 0 with, if it needs one.
        False: this instance may not write the partition any more (`may_write`)."""
        if partition.producer is not None and not partition.needs_new_producer:
            return True
        async with partition.switch_lock:
            if partition.producer is not None and not partition.needs_new_producer:
                return True
            # Switch only when nothing is in flight: a late retry under the old producer id
            # would otherwise land after batches written under the new one.
            while partition.in_flight:
                await asyncio.gather(*(entry.resolved for entry in list(partition.in_flight)))
            fresh = await self._fresh_producer(partition.producer)
            if self._may_write is not None and not await self._may_write(*key):
                log.warning(
                    "not writing a partition this instance no longer owns",
                    topic=key[0],
                    partition=key[1],
                )
                return False
            partition.producer = fresh
            partition.next_sequence = 0
            partition.rewind_to = None
            partition.needs_new_producer = False
            return True

    def _plan(self, partition: _Partition, batch: BatchToWrite) -> tuple[int, RecordBytes | None]:
        """The sequence the batch would take and its bytes; None: the caller withdrew it."""
        if batch.wanted is not None and not batch.wanted():
            return partition.next_sequence, None
        assert partition.producer is not None
        sequence = partition.next_sequence
        producer = partition.producer
        return sequence, batch.build(producer.producer_id, producer.epoch, sequence)

    def _assign(
        self, partition: _Partition, batch: BatchToWrite, sequence: int, data: RecordBytes
    ) -> _InFlight:
        partition.next_sequence = (sequence + batch.record_count) % SEQUENCE_WRAP
        previous = partition.in_flight[-1] if partition.in_flight else None
        entry = _InFlight(sequence, data, asyncio.get_running_loop().create_future(), previous)
        partition.in_flight.append(entry)
        return entry

    async def _settle(
        self,
        batch: BatchToWrite,
        partition: _Partition,
        entry: _InFlight,
        outcome: WriteResult | None,
    ) -> WriteResult:
        """Turn one partition's answer into a definite result and keep sequences right."""
        if outcome is None or outcome.error_code in _AMBIGUOUS:
            outcome = await self._resolve_ambiguous(batch, partition, entry)
        elif not outcome.written and outcome.error_code in _PRODUCER_STATE_LOST:
            previous_failed = await self._predecessor_failed(partition, entry)
            if not previous_failed:  # not just the echo of an earlier failure: state is gone
                partition.needs_new_producer = True
                log.warning(
                    "partition lost the proxy's producer state; taking a new producer id",
                    topic=batch.topic,
                    partition=batch.partition,
                    error=ErrorCode(outcome.error_code).name,
                )
        if not outcome.written and outcome.error_code in _HIDDEN_FROM_CLIENTS:
            outcome = WriteResult(
                written=False,
                error_code=ErrorCode.not_enough_replicas,
                error_message="not written; retry",
            )
        # The caller hears first; from `_finish` on, a later batch may take a sequence.
        _tell(batch, outcome)
        self._finish(partition, entry, outcome.written)
        return outcome

    async def _predecessor_failed(self, partition: _Partition, entry: _InFlight) -> bool:
        """Whether the batch sent just before this one (same partition) is not in the log."""
        previous = entry.previous
        return previous is not None and not await previous.resolved and not previous.unresolved

    def _predecessor_unresolved(self, entry: _InFlight) -> bool:
        return entry.previous is not None and entry.previous.unresolved

    async def _resolve_ambiguous(
        self, batch: BatchToWrite, partition: _Partition, entry: _InFlight
    ) -> WriteResult:
        """Re-send the same bytes, in order behind earlier batches, until Kafka is definite."""
        if await self._predecessor_failed(partition, entry):
            # Kafka refuses a batch whose predecessor is missing: this one cannot be there.
            return WriteResult(written=False, error_code=ErrorCode.not_enough_replicas)
        if self._predecessor_unresolved(entry):
            return self._give_up(batch, partition, entry, attempts=0)
        attempt = 0
        give_up_at = asyncio.get_running_loop().time() + self._give_up_s
        while True:
            attempt += 1
            await asyncio.sleep(min(self._retry_backoff_s * attempt, 5.0))
            if asyncio.get_running_loop().time() > give_up_at:
                return self._give_up(batch, partition, entry, attempt)
            leader = await self._leader_of(batch.topic, batch.partition)
            if leader is None:
                continue
            try:
                link = await self._connect(leader, partition.lane)  # in flight: its lane
                single = self._produce_request([(batch, entry.batch)], int(self._timeout_s * 1000))
                assert single is not None
                results = await self._await_answer(link.send(single), int(self._timeout_s * 1000))
            except (OSError, TimeoutError):
                results = None
            outcome = results.get((batch.topic, batch.partition)) if results else None
            if outcome is not None and outcome.error_code in _FENCED:
                return self._give_up(batch, partition, entry, attempt)
            if outcome is not None and (outcome.written or outcome.error_code in _ABSENT):
                if attempt > 1 or outcome.written:
                    log.info(
                        "ambiguous write resolved",
                        topic=batch.topic,
                        partition=batch.partition,
                        sequence=entry.sequence,
                        written=outcome.written,
                        attempts=attempt,
                    )
                return outcome
            if attempt % 10 == 0:
                log.warning(
                    "write still ambiguous; retrying",
                    topic=batch.topic,
                    partition=batch.partition,
                    sequence=entry.sequence,
                    attempts=attempt,
                )

    def _give_up(
        self, batch: BatchToWrite, partition: _Partition, entry: _InFlight, attempts: int
    ) -> WriteResult:
        log.error(
            "write still ambiguous; giving up, the partition must be fenced and recovered",
            topic=batch.topic,
            partition=batch.partition,
            sequence=entry.sequence,
            attempts=attempts,
        )
        entry.unresolved = True
        # No later batch may follow this sequence chain: what Kafka holds is known only
        # after a fence and a replay.
        partition.needs_new_producer = True
        return WriteResult(
            written=False,
            error_code=ErrorCode.not_leader_or_follower,
            error_message="not known whether written; the partition is recovering",
            unresolved=True,
        )

    def _finish(self, partition: _Partition, entry: _InFlight, written: bool) -> None:
        if not entry.resolved.done():
            entry.resolved.set_result(written)
        entry.previous = None  # resolved: the chain behind it is no longer needed
        partition.in_flight.remove(entry)
        if not written:
            partition.rewind_to = (
                entry.sequence if partition.rewind_to is None else partition.rewind_to
            )
        if not partition.in_flight and partition.rewind_to is not None:
            # Every batch after the first failure failed too (Kafka refuses gaps), so the
            # sequence continues where that failure left it.
            partition.next_sequence = partition.rewind_to
            partition.rewind_to = None

    # ---------------------------------------------------------------- Kafka requests

    def _produce_request(
        self, items: Sequence[tuple[BatchToWrite, RecordBytes]], timeout_ms: int
    ) -> WriterProduceRequest | None:
        """The Produce request for these batches; None when there is none to send."""
        if not items:
            return None
        if len(items) == 1:  # the usual write: one partition
            batch, data = items[0]
            partition = WriterPartitionData(batch.partition, data)
            return WriterProduceRequest(timeout_ms, (WriterTopicData(batch.topic, (partition,)),))
        topics: dict[str, list[WriterPartitionData]] = {}
        for batch, data in items:
            # Pieces as they are: the request is written unjoined (`RecordPieces`).
            topics.setdefault(batch.topic, []).append(WriterPartitionData(batch.partition, data))
        return WriterProduceRequest(
            timeout_ms,
            tuple(WriterTopicData(name, tuple(parts)) for name, parts in topics.items()),
        )

    async def _await_answer(
        self, answer: asyncio.Future[Any], timeout_ms: int
    ) -> dict[tuple[str, int], WriteResult] | None:
        """Per-partition results, or None when the request's fate is unknown."""
        # The deadline fails the answer itself (`_expire`), a timer and nothing more per
        # request (asyncio.timeout costs some ten calls). Unlike wait_for on Python 3.11,
        # it loses no cancellation that arrives with the answer (CPython gh-86296).
        deadline = asyncio.get_running_loop().call_later(
            timeout_ms / 1000 + self._timeout_s, _expire, answer
        )
        try:
            response = await answer
        except (LinkClosed, OSError, TimeoutError):
            return None
        finally:
            deadline.cancel()
        results: dict[tuple[str, int], WriteResult] = {}
        for topic in response.responses:
            for part in topic.partition_responses:
                try:
                    code = error_code(part.error_code)
                except ValueError:  # newer than kio: say nothing, so the write is re-sent
                    continue
                append_time = part.log_append_time
                results[(str(topic.name), int(part.index))] = WriteResult(
                    written=code in _WRITTEN,
                    error_code=0 if code in _WRITTEN else int(code),
                    base_offset=int(part.base_offset) if code == ErrorCode.none else -1,
                    log_append_time_ms=-1
                    if append_time is None
                    else int(append_time.timestamp() * 1000),
                    log_start_offset=int(part.log_start_offset),
                    error_message=part.error_message,
                )
        return results

    async def _fresh_producer(self, previous: _Producer | None) -> _Producer:
        """A producer id this partition has not used yet (Kafka starts it at sequence 0)."""
        async with self._producer_lock:
            if self._producer is None or self._producer == previous:
                self._producer = await self._producer_ids.new_epoch()
            return self._producer

    async def fence(self, partitions: Sequence[tuple[str, int]]) -> None:
        """Make every earlier write to these partitions final (see `dedup.fencing`): once
        their own writes have settled, bump the epoch, mark it into each partition, and
        continue them under the new epoch from sequence 0. Raises FenceError."""
        states = [self._partition(topic, partition) for topic, partition in partitions]
        for state in states:
            while state.in_flight:
                await asyncio.gather(*(entry.resolved for entry in list(state.in_flight)))
        async with self._producer_lock:
            self._producer = await self._producer_ids.fence(partitions)
            for state in states:
                state.producer = self._producer
                state.next_sequence = 0
                state.rewind_to = None
                state.needs_new_producer = False

    def _partition(self, topic: str, partition: int) -> _Partition:
        key = (topic, partition)
        state = self._partitions.get(key)
        if state is None:
            state = self._partitions[key] = _Partition()
            metrics.WRITER_PARTITIONS.set(len(self._partitions))
            if self._forgotten_under is not None:
                # Maybe one forgotten, whose log may still hold a producer up to that one
                # at some sequence (a topic given up on a lagging broker's word): start
                # under a newer producer, from sequence 0, as after a lost producer state.
                state.producer = self._forgotten_under
                state.needs_new_producer = True
        return state

    def forget(self, topic: str, partition: int) -> bool:
        """Drop what is kept of a partition Kafka no longer has (its topic deleted), unless
        a write of it is still unresolved; whether it was dropped. Its next write, should
        the topic come back, starts under a producer it never used, from sequence 0."""
        key = (topic, partition)
        state = self._partitions.get(key)
        if state is None:
            return True
        if state.in_flight or state.switch_lock.locked():
            return False
        del self._partitions[key]
        metrics.WRITER_PARTITIONS.set(len(self._partitions))
        self._forgotten_under = self._producer
        return True


def _expire(answer: asyncio.Future[Any]) -> None:
    """Kafka did not answer in time: whether the request was appended is unknown."""
    if not answer.done():
        answer.set_exception(TimeoutError("Kafka did not answer the Produce request in time"))


def _tell(batch: BatchToWrite, outcome: WriteResult) -> None:
    if batch.settled is None:
        return
    try:
        batch.settled(outcome)
    except Exception:  # the caller's hook must not leave the partition's sequence stuck
        log.exception("a write's settled hook failed", topic=batch.topic)
