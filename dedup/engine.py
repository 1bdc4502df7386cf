"""The produce path with deduplication: the whole algorithm in one place.

For one client Produce request:

1. A transactional request, or one whose topics all have dedup disabled, is not touched:
   the caller forwards it to Kafka as it is.
2. Each partition's batches are read (`dedup.batches`): identity per record, bad input
   refused for that partition only.
3. One Redis round trip checks every partition (`dedup.state`): per record NOT_DUP
   (forward), DUP (drop), UNKNOWN (refuse the partition batch, nothing written, retriable).
4. The kept records are rebuilt as one batch per partition and written by the proxy's own
   idempotent producer (`dedup.writer`): written exactly once, or definitely not.
5. Written: ``persisted`` rises. Not written: once the partition's writes in flight have
   settled, ``pushed`` is reset to ``persisted`` so the client's retry is accepted again;
   requests for that partition wait meanwhile, so none overtakes the retry.
6. The client gets one answer per partition; where any record was dropped the base offset
   is -1, never a wrong one.

Before a partition's first check in this process, and whenever its state cannot be
trusted (Redis lost it, a write stayed ambiguous, an operator asked), the partition is
recovered from the log (`dedup.recovery`): fence, snapshot, replay. Meanwhile its requests
get NOT_LEADER_OR_FOLLOWER, which every client retries after refreshing metadata.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from kio.schema.errors import ErrorCode
from kio.static.primitive import i32, i64
from redis.exceptions import RedisError

from dedup import metrics
from dedup.batches import (
    BadBatch,
    IdentityHeaders,
    IncomingBatch,
    IncomingRecord,
    build_batch,
    read_batches,
)
from dedup.chunks import ChunkMeta, ChunkProgress
from dedup.partitions import AckCursor, PartitionState, _Ticket
from dedup.persisted import PersistedRecorder
from dedup.policies import Mode, PolicySnapshot, PolicyStore
from dedup.recovery import Recovery
from dedup.state import (
    DedupState,
    PartitionCheck,
    Persisted,
    Status,
    clock_ms,
    persisted_position,
)
from dedup.writer import BatchToWrite, IdempotentWriter, WriteResult
from proxy.kafka.schemas import response_type
from proxy.kafka.topology import Endpoint

log = structlog.get_logger(__name__)

SETTLE_WAIT_S = 30.0
# How long a request waits, in line, for its partition's first recovery before it is told
# NOT_LEADER_OR_FOLLOWER (retry). Waiting keeps the partition's requests in order.
FIRST_USE_WAIT_S = 10.0
RECOVERY_RETRY_S = (0.5, 30.0)  # first and longest pause before retrying a failed recovery
RECOVERY_BATCH = 256  # partitions fenced together

_Key = tuple[str, int]


@dataclass(frozen=True, slots=True)
class PartitionAnswer:
    error_code: int = 0
    base_offset: int = -1
    log_append_time_ms: int = -1
    log_start_offset: int = -1
    error_message: str | None = None


@dataclass(slots=True)
class Admission:
    """A request's place in line: it goes after ``predecessors``, and its ``turns`` let the
    requests behind it go once its sequences are assigned."""

    snapshot: PolicySnapshot
    predecessors: list[asyncio.Future[None]] = field(default_factory=list)
    turns: list[asyncio.Future[None]] = field(default_factory=list)

    def done(self) -> None:
        for turn in self.turns:
            if not turn.done():
                turn.set_result(None)


@dataclass(slots=True)
class _Work:
    """One partition of the request on its way through the steps above."""

    topic: str
    partition: int
    mode: Mode
    batches: list[IncomingBatch] = field(default_factory=list)
    keep: list[list[bool]] = field(default_factory=list)  # per batch, per record
    answer: PartitionAnswer | None = None
    dropped: int = 0
    checked: bool = False
    token: str = ""  # the partition's recovery token when it was checked
    kept: int = 0  # records left to write after the check
    ticket: _Ticket | None = None  # its place in the partition's AckCursor, once submitted
    sizes: tuple[int | None, ...] = ()  # per identity: its chunked message's bytes so far

    @property
    def identified(self) -> list[IncomingRecord]:
        return [r for batch in self.batches for r in batch.records if r.identity is not None]

    def check(self) -> PartitionCheck | None:
        """What the state checks of this partition batch; None when no record has identity."""
        records = self.identified
        if not records:
            return None
        identities = [(r.identity.producer, r.identity.sequence) for r in records if r.identity]
        chunks: list[tuple[ChunkMeta, int] | None] = []
        if any(r.chunk is not None for r in records):
            chunks = [None if r.chunk is None else (r.chunk, len(r.value or b"")) for r in records]
        return PartitionCheck(self.topic, self.partition, identities, self.token, chunks)


class DedupEngine:
    def __init__(
        self,
        state: DedupState,
        policies: PolicyStore,
        writer: IdempotentWriter,
        headers: IdentityHeaders,
        recovery: Recovery,
    ) -> None:
        self._state = state
        self._policies = policies
        self._writer = writer
        self._headers = headers
        self._recovery = recovery
        self._partitions: dict[_Key, PartitionState] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._persisted = PersistedRecorder(state, on_lost=self._state_lost)
        self._recovery_queue: dict[_Key, str] = {}  # partition -> why
        self._recovery_wakeup = asyncio.Event()
        self._recovery_task: asyncio.Task[None] | None = None
        self._recovered = asyncio.Condition()

    async def flush_persisted(self) -> None:
        """Wait until every acknowledged sequence is recorded in Redis."""
        await self._persisted.flush()

    def partitions(self) -> list[_Key]:
        """The partitions this engine has written to (or recovered) since it started."""
        return sorted(self._partitions)

    def partition_states(self) -> dict[_Key, PartitionState]:
        """Each partition's in-memory state (for the snapshotter and the admin API)."""
        return self._partitions

    async def close(self) -> None:
        if self._recovery_task is not None:
            self._recovery_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._recovery_task

    async def dedup_anywhere(self) -> bool:
        """False when every topic has dedup disabled: Produce passes through undecoded."""
        return (await self._policies.snapshot()).dedup_anywhere

    async def admit(self, request: Any) -> Admission | None:
        """Called as each Produce request arrives, in arrival order: None to forward it as
        is (transactional, or dedup disabled for every topic it writes), else its place in
        line on each of its partitions, taken before anything else can run."""
        if request.transactional_id is not None:
            return None
        snapshot = await self._policies.snapshot()
        topics = [str(topic.name) for topic in request.topic_data]
        if all(snapshot.mode_for(topic) is Mode.DISABLED for topic in topics):
            return None
        # Nothing below awaits: the places in line follow the order of arrival.
        loop = asyncio.get_running_loop()
        admission = Admission(snapshot)
        for topic in request.topic_data:
            for part in topic.partition_data:
                gate = self._state_of((str(topic.name), int(part.index)))
                if gate.last_in_line is not None and not gate.last_in_line.done():
                    admission.predecessors.append(gate.last_in_line)
                turn_done: asyncio.Future[None] = loop.create_future()
                gate.last_in_line = turn_done
                admission.turns.append(turn_done)
        return admission

    async def produce(
        self, request: Any, admission: Admission, broker: Endpoint
    ) -> dict[tuple[str, int], PartitionAnswer]:
        """Run one admitted Produce request through dedup; an answer per partition."""
        work = [
            _Work(str(topic.name), int(part.index), admission.snapshot.mode_for(str(topic.name)))
            for topic in request.topic_data
            for part in topic.partition_data
        ]
        records = [part.records for topic in request.topic_data for part in topic.partition_data]
        timeout_ms = int(request.timeout.total_seconds() * 1000)
        submitted = None
        try:
            for item, data in zip(work, records, strict=True):
                self._read(item, data)
            # Check and sequence assignment happen in arrival order per partition: a request
            # checked later must never reach the log ahead of one that arrived earlier, or
            # the earlier one's records would read as old duplicates of the later ones.
            for predecessor in admission.predecessors:
                await predecessor
            try:
                await self._check(work)
                writes, submitted = await self._submit(work, broker, timeout_ms)
            finally:
                admission.done()
            if submitted is not None:
                await self._finish_writes(writes, await submitted)
        finally:
            admission.done()  # also on any failure before the check: never block successors
            await self._release(work)
        answers = {}
        for item in work:
            assert item.answer is not None
            answers[(item.topic, item.partition)] = item.answer
        return answers

    # ------------------------------------------------------------- 2. read

    def _read(self, item: _Work, data: bytes | None) -> None:
        try:
            item.batches = read_batches(data or b"", self._headers)
        except BadBatch as bad:
            metrics.BAD_INPUT.labels(ErrorCode(bad.error_code).name).inc()
            log.warning(
                "refusing a bad partition batch",
                topic=item.topic,
                partition=item.partition,
                error=bad.message,
            )
            item.answer = PartitionAnswer(bad.error_code, error_message=bad.message)
            return
        if not item.batches:
            item.answer = PartitionAnswer(ErrorCode.corrupt_message, error_message="no records")
            return
        if item.mode is Mode.REQUIRE:
            for batch in item.batches:
                missing = [r.offset_delta for r in batch.records if r.identity is None]
                if missing:
                    message = (
                        f"topic {item.topic} requires a dedup identity: the record at offset "
                        f"delta {missing[0]} has no {self._headers.producer}/"
                        f"{self._headers.sequence} headers and its batch is not idempotent"
                    )
                    metrics.BAD_INPUT.labels("missing_identity").inc()
                    item.answer = PartitionAnswer(ErrorCode.invalid_record, error_message=message)
                    return
        item.keep = [[True] * len(batch.records) for batch in item.batches]

    # ------------------------------------------------------------- 3. check

    async def _check(self, work: list[_Work]) -> None:
        to_check = [w for w in work if w.answer is None and w.mode is not Mode.DISABLED]
        for item in to_check:
            await self._pass_gate(item)
            if item.answer is None:
                self._state_of_item(item).pending += 1
                item.checked = True
        # Each identity list walks every record of the partition: build it once.
        pairs = [(w, check) for w in to_check if w.checked and (check := w.check()) is not None]
        if not pairs:
            return
        checked = [w for w, _ in pairs]
        try:
            verdicts = await self._state.check_and_push([c for _, c in pairs], clock_ms())
        except RedisError as exc:
            # The script may or may not have run: treat it like a failed write, so the
            # partition is reset (pushed := persisted) before anything else is accepted.
            log.error("dedup state unavailable; refusing the request", error=str(exc))
            for item in checked:
                self._fail(item)
                item.answer = _not_written("dedup state unavailable")
            return
        for item, verdict in zip(checked, verdicts, strict=True):
            if verdict.lost:
                self._state_lost(item.topic, item.partition, item.token)
                item.answer = _recovering()
                continue
            if verdict.evicted:
                metrics.EVICTIONS.inc(len(verdict.evicted))
                log.info(
                    "evicted idle producers",
                    topic=item.topic,
                    partition=item.partition,
                    producers=list(verdict.evicted),
                )
            if verdict.gap:
                # Kafka's answer to a sequence gap, in kind: not written, retry. The chunk
                # before may be in a request refused while the partition recovered, or be
                # retried right now; the client re-sends both, in order.
                metrics.RECORDS.labels("unknown").inc(len(item.identified))
                item.answer = _not_written(f"{verdict.bad}; the chunk before is still to come")
                continue
            if verdict.bad is not None:
                self._refuse_bad_chunk(item, verdict.bad, verdict.bad_index)
                continue
            if verdict.refused:
                metrics.RECORDS.labels("unknown").inc(len(verdict.statuses))
                item.answer = _not_written(
                    "an earlier write of these sequences is in flight or failed; retry"
                )
                continue
            item.sizes = verdict.sizes
            statuses = iter(verdict.statuses)
            for b, batch in enumerate(item.batches):
                for r, record in enumerate(batch.records):
                    if record.identity is not None and next(statuses) is Status.DUP:
                        item.keep[b][r] = False
                        item.dropped += 1
            metrics.RECORDS.labels("dup").inc(item.dropped)
            metrics.RECORDS.labels("not_dup").inc(len(verdict.statuses) - item.dropped)

    def _refuse_bad_chunk(self, item: _Work, why: str, index: int) -> None:
        """A chunk broke the chunk rule (`dedup.chunks.accept_chunk`): bad input, nothing
        written, not retriable (the same chunk can never be accepted)."""
        record = item.identified[index]
        message = f"record at offset delta {record.offset_delta}: {why}"
        metrics.BAD_INPUT.labels("chunk").inc()
        log.warning(
            "refusing a bad chunk", topic=item.topic, partition=item.partition, error=message
        )
        item.answer = PartitionAnswer(ErrorCode.invalid_record, error_message=message)

    async def _pass_gate(self, item: _Work) -> None:
        """Wait while the partition recovers or settles a failed write."""
        state = self._state_of_item(item)
        while True:
            if not state.recovered:
                key = (item.topic, item.partition)
                self._request_recovery(key, "first use")
                # Wait here, in line. Answering "retry" at once would let a pipelined later
                # request of the same producer be checked after the recovery, ahead of this
                # one: its higher sequences would make this one's records read as old.
                if await self.wait_recovered([key], FIRST_USE_WAIT_S):
                    continue
                item.answer = _recovering()
                return
            if state.open.is_set():
                item.token = state.token
                return
            # After a failed write, wait for the reset: nothing may overtake the retry.
            try:
                await asyncio.wait_for(state.open.wait(), SETTLE_WAIT_S)
            except TimeoutError:
                item.answer = _not_written("partition is recovering from a failed write")
                return

    # ------------------------------------------------------------- 4. write

    async def _submit(
        self, work: list[_Work], broker: Endpoint, timeout_ms: int
    ) -> tuple[list[_Work], asyncio.Future[list[WriteResult]] | None]:
        writes: list[tuple[_Work, BatchToWrite]] = []
        for item in work:
            if item.answer is not None:
                continue
            kept = [
                [r for r, k in zip(batch.records, keep, strict=True) if k]
                for batch, keep in zip(item.batches, item.keep, strict=True)
            ]
            count = item.kept = sum(len(records) for records in kept)
            if count == 0:  # every record was a duplicate: success, nothing to write
                item.answer = PartitionAnswer()
                continue
            writes.append(
                (
                    item,
                    BatchToWrite(
                        item.topic, item.partition, count, _builder(item, kept, self._headers)
                    ),
                )
            )
        if not writes:
            return [], None
        items = [item for item, _ in writes]
        try:
            submitted = await self._writer.submit(broker, [w for _, w in writes], timeout_ms)
            for item in items:  # in submission order: the order of the partition's log
                if item.checked:
                    item.ticket = self._state_of_item(item).cursor.submitted()
            return items, submitted
        except (OSError, TimeoutError) as exc:
            # Nothing was sent (the writer fails before assigning sequences): tell the
            # client to refresh metadata and retry, as a broker that went away would.
            failed: asyncio.Future[list[WriteResult]] = asyncio.get_running_loop().create_future()
            failed.set_result(
                [WriteResult(False, ErrorCode.not_leader_or_follower, error_message=str(exc))]
                * len(writes)
            )
            return items, failed

    async def _finish_writes(self, items: list[_Work], results: list[WriteResult]) -> None:
        for item, result in zip(items, results, strict=True):
            written_records = 0
            end_offset = None
            if result.written:
                written_records = item.kept
                if result.base_offset >= 0:
                    end_offset = result.base_offset + written_records
                if item.checked:
                    self._persisted.add(item.topic, item.partition, _highest_kept(item), item.token)
                item.answer = PartitionAnswer(
                    base_offset=result.base_offset if item.dropped == 0 else -1,
                    log_append_time_ms=result.log_append_time_ms,
                    log_start_offset=result.log_start_offset,
                )
            else:
                self._fail(item)
                if result.unresolved:  # only the log can tell: fence, then replay
                    self._request_recovery((item.topic, item.partition), "a write stayed ambiguous")
                item.answer = PartitionAnswer(result.error_code, error_message=result.error_message)
            if item.ticket is not None:
                self._state_of_item(item).cursor.settled(item.ticket, end_offset, written_records)

    # ------------------------------------------------------------- 5. settle

    async def _release(self, work: list[_Work]) -> None:
        for item in work:
            if not item.checked:
                continue
            state = self._state_of_item(item)
            if item.ticket is not None and item.answer is None:
                # Cancelled between submit and outcome: never leave the cursor stuck.
                state.cursor.settled(item.ticket, None, 0)
            state.pending -= 1
            if state.pending == 0 and state.failed:
                state.failed = False
                if state.recovered:  # else the recovery under way rebuilds pushed anyway
                    self._spawn(self._reset(item.topic, item.partition, state))

    def _fail(self, item: _Work) -> None:
        state = self._state_of_item(item)
        state.failed = True
        state.open.clear()

    async def _reset(self, topic: str, partition: int, state: PartitionState) -> None:
        """Every write that passed the check has its outcome: forget what was pushed but
        never persisted, so the client's retry is accepted. Retried until Redis answers."""
        delay = 0.1
        while True:
            try:
                await self._persisted.flush()  # persisted must be complete before the reset
                still_held = await self._state.reset_pushed(topic, partition, state.token)
                break
            except RedisError as exc:
                log.warning("partition reset failed; retrying", topic=topic, error=str(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        if not still_held:
            self._state_lost(topic, partition, state.token)
        state.open.set()
        log.info("partition reset after a failed write", topic=topic, partition=partition)

    # ------------------------------------------------------------- recovery

    def _state_lost(self, topic: str, partition: int, token: str) -> None:
        """Redis no longer holds the state this process recovered: recover it again."""
        state = self._partitions.get((topic, partition))
        if state is None or not state.recovered or state.token != token:
            return  # already being recovered
        log.error(
            "dedup state lost (Redis flushed, restarted empty or replaced); recovering",
            topic=topic,
            partition=partition,
        )
        self._request_recovery((topic, partition), "state lost")

    def request_recovery(self, partitions: list[_Key], reason: str) -> None:
        """Recover these partitions (again): start-up, operator request."""
        for key in partitions:
            self._request_recovery(key, reason)

    async def ensure_recovered(self, partitions: list[_Key], timeout_s: float) -> bool:
        """Recover those not recovered yet, and wait: a state read (last sequence id) after
        a crash is only true once the log's tail has been replayed."""
        for key in partitions:
            if not self._state_of(key).recovered:
                self._request_recovery(key, "state read")
        return await self.wait_recovered(partitions, timeout_s)

    async def wait_recovered(self, partitions: list[_Key], timeout_s: float) -> bool:
        """Whether every one of these partitions is recovered within the timeout."""

        def done() -> bool:
            return all(self._state_of(key).recovered for key in partitions)

        async with self._recovered:
            try:
                await asyncio.wait_for(self._recovered.wait_for(done), timeout_s)
            except TimeoutError:
                return False
        return True

    def _request_recovery(self, key: _Key, reason: str) -> None:
        state = self._state_of(key)
        if key in self._recovery_queue:
            return
        if state.recovered:
            state.recovered = False
            state.open.set()  # waiters see `recovered` is False and answer at once
        self._recovery_queue[key] = reason
        metrics.RECOVERING.set(len(self._recovery_queue))
        self._recovery_wakeup.set()
        if self._recovery_task is None or self._recovery_task.done():
            self._recovery_task = asyncio.create_task(self._recover_loop(), name="recovery")

    async def _recover_loop(self) -> None:
        """Recover queued partitions in batches (one fence per batch), retrying failures."""
        pause = RECOVERY_RETRY_S[0]
        batch_limit = RECOVERY_BATCH
        while True:
            await self._recovery_wakeup.wait()
            self._recovery_wakeup.clear()
            await asyncio.sleep(0.01)  # let requests arriving together join one batch
            # A partition recovers once its own writes have settled (they are in the log
            # then, or never will be); nothing new is checked meanwhile.
            ready = [k for k in self._recovery_queue if self._state_of(k).pending == 0]
            ready = ready[:batch_limit]
            if not ready:
                if self._recovery_queue:
                    await asyncio.sleep(0.05)
                    self._recovery_wakeup.set()
                continue
            log.info(
                "recovering partitions",
                partitions=[f"{t}/{p}" for t, p in ready],
                reasons=sorted({self._recovery_queue[k] for k in ready}),
            )
            try:
                recovered, failed = await self._recovery.run(ready)
                batch_limit = RECOVERY_BATCH
            except Exception as exc:  # the fence or the end offsets: the whole batch failed
                recovered, failed = {}, {key: exc for key in ready}
                batch_limit = 1  # one bad partition (a deleted topic) must not block the rest
            for key, result in recovered.items():
                state = self._state_of(key)
                state.token = result.token
                state.cursor = AckCursor(result.end)
                state.snapshot_generation = result.next_generation
                state.snapshot_offset = None if result.snapshot is None else result.snapshot.offset
                state.snapshot_ms = None if result.snapshot is None else result.snapshot.created_ms
                state.snapshot_records = 0
                state.snapshot_due = result.snapshot is None or result.snapshot.offset < result.end
                state.failed = False
                state.recovered = True
                state.open.set()
                del self._recovery_queue[key]
                metrics.RECOVERIES.labels("ok").inc()
            for key, error in failed.items():
                metrics.RECOVERIES.labels("failed").inc()
                log.error(
                    "partition recovery failed; retrying",
                    topic=key[0],
                    partition=key[1],
                    error=f"{type(error).__name__}: {error}",
                    retry_in_s=pause,
                )
            metrics.RECOVERING.set(len(self._recovery_queue))
            async with self._recovered:
                self._recovered.notify_all()
            if failed:
                await asyncio.sleep(pause)
                pause = min(pause * 2, RECOVERY_RETRY_S[1])
            else:
                pause = RECOVERY_RETRY_S[0]
            if self._recovery_queue:
                self._recovery_wakeup.set()

    # ------------------------------------------------------------- plumbing

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _state_of_item(self, item: _Work) -> PartitionState:
        return self._state_of((item.topic, item.partition))

    def _state_of(self, key: _Key) -> PartitionState:
        state = self._partitions.get(key)
        if state is None:
            state = self._partitions[key] = PartitionState()
        return state


def _recovering() -> PartitionAnswer:
    return PartitionAnswer(
        ErrorCode.not_leader_or_follower,
        error_message="the partition's dedup state is being recovered; retry",
    )


def _not_written(message: str) -> PartitionAnswer:
    return PartitionAnswer(ErrorCode.not_enough_replicas, error_message=f"not written: {message}")


def _highest_kept(item: _Work) -> dict[str, Persisted]:
    """Per producer, the highest position written: a sequence, or for a chunk that is not
    its message's last, the message's progress (sequence, chunk id, bytes so far)."""
    highest: dict[str, Persisted] = {}
    index = -1  # of the record among those with identity (the check's order)
    for batch, keep in zip(item.batches, item.keep, strict=True):
        for record, kept in zip(batch.records, keep, strict=True):
            if record.identity is None:
                continue
            index += 1
            if not kept:
                continue
            producer, sequence = record.identity.producer, record.identity.sequence
            position: Persisted = sequence
            chunk = record.chunk
            if chunk is not None and not chunk.last:
                size = item.sizes[index]
                assert size is not None, "the check gives every kept chunk its size so far"
                position = ChunkProgress(
                    sequence, chunk.uuid, chunk.chunk_id, chunk.chunk_count, chunk.total_size, size
                )
            known = highest.get(producer)
            if known is None or persisted_position(position) > persisted_position(known):
                highest[producer] = position
    return highest


def _builder(item: _Work, kept: Sequence[Sequence[Any]], headers: IdentityHeaders) -> Any:
    """The batch bytes for the writer: one output batch per input batch, sequences in a row."""

    def build(producer_id: int, producer_epoch: int, base_sequence: int) -> bytes:
        parts = []
        sequence = base_sequence
        for batch, records in zip(item.batches, kept, strict=True):
            if not records:
                continue
            parts.append(
                build_batch(
                    records,
                    compression=batch.compression,
                    timestamp_type=batch.timestamp_type,
                    producer_id=producer_id,
                    producer_epoch=producer_epoch,
                    base_sequence=sequence,
                    add_identity_headers=item.mode is not Mode.DISABLED,
                    headers=headers,
                )
            )
            sequence = (sequence + len(records)) % (1 << 31)
        return b"".join(parts)

    return build


def produce_response(
    version: int, answers: dict[tuple[str, int], PartitionAnswer], request: Any
) -> Any:
    """The kio ProduceResponse of the client's version, partitions in request order."""
    response_cls = response_type(0, version)
    module = sys.modules[response_cls.__module__]
    topics = []
    for topic in request.topic_data:
        partitions = []
        for part in topic.partition_data:
            answer = answers[(str(topic.name), int(part.index))]
            fields: dict[str, Any] = {
                "index": i32(part.index),
                "error_code": ErrorCode(answer.error_code),
                "base_offset": i64(answer.base_offset),
            }
            if version >= 5:
                fields["log_start_offset"] = i64(answer.log_start_offset)
            if version >= 8:
                fields["record_errors"] = ()
                fields["error_message"] = answer.error_message
            partitions.append(module.PartitionProduceResponse(**fields))
        topics.append(
            module.TopicProduceResponse(name=topic.name, partition_responses=tuple(partitions))
        )
    return response_cls(responses=tuple(topics))
