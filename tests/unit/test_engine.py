"""The produce path (`dedup.engine`) against in-memory fakes: no Kafka, no Redis.

- `FakeState` keeps pushed / persisted per producer and answers the check with the rule of
  `dedup/lua/check.lua` for plain sequences: NOT_DUP above pushed, DUP at or below
  persisted (or raised by an earlier record of the same batch), else UNKNOWN, which refuses
  the whole partition batch and changes nothing.
- `FakeWriter` appends what it is asked to write to an in-memory log, or fails, raises,
  loses or holds it, as each test scripts (`Step`). Like the real writer (Kafka's
  sequence rule), a batch sent while an earlier one of its partition is in flight fails
  if that one fails. It asks and tells the engine's hooks (`BatchToWrite.wanted`,
  `.settled`) where the real writer does.
- `FakeRecovery` rebuilds a partition from that log (the highest sequence per producer),
  as `dedup.recovery` does from Kafka's, and can be held or made to fail.

Every test runs twice, once per place the check's maps can live (``check_state``): in the
owner's memory (`dedup.sequences`, the real maps; `FakeState` then only receives the copy
of the acknowledged positions written behind) and in Redis (`FakeState`'s check). Tests
marked ``redis_check`` are about the round trip to Redis itself and run in that mode only.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import threading
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import kio.schema.produce.v11.request as produce_v11
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder
from kio.schema.errors import ErrorCode
from kio.schema.types import TopicName, TransactionalId
from kio.static.primitive import Records, i16, i32, i32Timedelta
from prometheus_client import REGISTRY
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dedup import engine as engine_module
from dedup.batches import (
    HEADER_PRODUCER,
    HEADER_SEQUENCE,
    HEADER_SIZE,
    Identity,
    IdentityHeaders,
    IncomingBatch,
    IncomingRecord,
    LazyRecords,
    MadeAhead,
    build_batch,
    read_batches,
    restamp_batch,
    use_native_scan,
)
from dedup.bindings import ProducerBindings
from dedup.engine import FIRST_USE_LOOKUPS, READ_IN_THREAD_BYTES, DedupEngine, PartitionAnswer
from dedup.fencing import FenceError
from dedup.ownership.nodes import Node
from dedup.ownership.owner import Redirect
from dedup.policies import Mode, PolicySnapshot
from dedup.produce_filter import produce_response
from dedup.recovery import Later, NotOwner, RecoveredPartition
from dedup.recovery_scheduler import RecoveryScheduler
from dedup.state import (
    Acked,
    PartitionCheck,
    PartitionVerdict,
    Persisted,
    RecoveredState,
    Status,
)
from dedup.topic_ids import UnknownTopic
from dedup.writer import WITHDRAWN, BatchToWrite, WriteResult
from proxy.kafka.produce_codec import RecordBytes, RecordPieces
from proxy.kafka.topology import Endpoint
from proxy.kafka.upstream_client import QUEUED_FROM_BYTES
from proxy.runtime.cluster import NoSuchPartition
from tests.support.bindings import prefix_bindings
from tests.support.raw import damaged

pytestmark = pytest.mark.unit

CHECK_STATES = ("memory", "redis")
_check_state = "redis"  # of the running test (the autouse fixture below)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "check_state" in metafunc.fixturenames:
        only_redis = metafunc.definition.get_closest_marker("redis_check") is not None
        only_memory = metafunc.definition.get_closest_marker("memory_check") is not None
        states = ["redis"] if only_redis else ["memory"] if only_memory else list(CHECK_STATES)
        metafunc.parametrize("check_state", states, indirect=True)


@pytest.fixture(autouse=True)
def check_state(request: pytest.FixtureRequest) -> Iterator[str]:
    """Where `running` keeps the maps for this test."""
    global _check_state
    _check_state = request.param
    yield request.param
    _check_state = "redis"


Key = tuple[str, int]
BROKER = Endpoint("kafka", 9092)
P0: Key = ("orders", 0)
P1: Key = ("orders", 1)
Q0: Key = ("other", 0)
NOW_MS = 1_700_000_000_000
RETRIABLE_NOT_WRITTEN = {ErrorCode.not_enough_replicas, ErrorCode.not_leader_or_follower}


# ----------------------------------------------------------------------------- requests


def records(producer: str, sequences: Sequence[int]) -> bytes:
    """One record batch, each record with explicit identity headers (value ``v<seq>``)."""
    return mixed([(producer, s) for s in sequences])


def mixed(parts: Sequence[tuple[str, int]], compression: int = 0) -> bytes:
    """One batch whose records name these (producer, sequence) pairs, in this order."""
    batch = [
        IncomingRecord(
            offset_delta=i,
            timestamp=NOW_MS,
            key=None,
            value=f"v{s}".encode(),
            headers=((HEADER_PRODUCER, p.encode()), (HEADER_SEQUENCE, str(s).encode())),
            identity=Identity(p, s),
        )
        for i, (p, s) in enumerate(parts)
    ]
    return build_batch(
        batch,
        compression=compression,
        timestamp_type=0,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        add_identity_headers=False,
    )


def produce_request(
    *parts: tuple[Key, bytes], transactional_id: str | None = None
) -> produce_v11.ProduceRequest:
    """Partitions in the given order; a topic named again gets an entry of its own."""
    topics: list[tuple[str, list[produce_v11.PartitionProduceData]]] = []
    for (topic, partition), data in parts:
        entry = produce_v11.PartitionProduceData(index=i32(partition), records=Records(data))
        if topics and topics[-1][0] == topic:
            topics[-1][1].append(entry)
        else:
            topics.append((topic, [entry]))
    return produce_v11.ProduceRequest(
        transactional_id=None if transactional_id is None else TransactionalId(transactional_id),
        acks=i16(-1),
        timeout=i32Timedelta.parse(datetime.timedelta(seconds=5)),
        topic_data=tuple(
            produce_v11.TopicProduceData(name=TopicName(name), partition_data=tuple(entries))
            for name, entries in topics
        ),
    )


def identities(data: bytes) -> list[tuple[str, int]]:
    return [
        (r.identity.producer, r.identity.sequence)
        for batch in read_batches(data, from_log=True)
        for r in batch.records
        if r.identity is not None
    ]


def in_order(producer: str, sequences: Sequence[int]) -> list[tuple[str, int]]:
    return [(producer, s) for s in sequences]


# ----------------------------------------------------------------------------- fakes


@dataclass
class FakeState:
    """The pushed / persisted maps and the check's rule, in memory (`ports.StateStore`)."""

    pushed: dict[Key, dict[str, int]] = field(default_factory=lambda: defaultdict(dict))
    persisted: dict[Key, dict[str, int]] = field(default_factory=lambda: defaultdict(dict))
    tokens: dict[Key, str] = field(default_factory=dict)
    checked: list[tuple[Key, list[tuple[str, int]]]] = field(default_factory=list)
    now_ms: list[int] = field(default_factory=list)
    hold_check: asyncio.Event | None = None  # the next check waits for it
    fail_check: str | None = None  # "before" / "after" the script ran: the next check raises
    # ... or "late": it raises, and its script reaches Redis only at `run_late_checks`.
    late_checks: list[Sequence[PartitionCheck]] = field(default_factory=list)
    acked_with_checks: int = 0  # check calls that recorded acknowledgements first
    forgotten: list[tuple[Key, list[str]]] = field(default_factory=list)

    async def check_and_push(
        self, checks: Sequence[PartitionCheck], now_ms: int, acked: Acked | None = None
    ) -> list[PartitionVerdict]:
        self.now_ms.append(now_ms)
        hold, self.hold_check = self.hold_check, None
        if hold is not None:
            await hold.wait()
        fail, self.fail_check = self.fail_check, None
        if fail == "before":
            raise RedisConnectionError("connection lost before the script ran")
        if acked is not None:  # recorded first, in the same round trip
            self.acked_with_checks += 1
            acked.lost = await self.mark_persisted(acked.updates, now_ms, acked.tokens)
        if fail == "late":
            self.late_checks.append(checks)
            raise RedisTimeoutError("no answer in time; the script is still on its way")
        verdicts = [self._check(check) for check in checks]
        if fail == "after":
            raise RedisConnectionError("connection lost after the script ran")
        return verdicts

    def run_late_checks(self) -> None:
        for checks in self.late_checks:
            for check in checks:
                self._check(check)
        self.late_checks.clear()

    def _check(self, check: PartitionCheck) -> PartitionVerdict:
        key = (check.topic, check.partition)
        self.checked.append((key, list(check.identities)))
        if check.token and self.tokens.get(key) != check.token:
            return PartitionVerdict((), (), lost=True)
        before = dict(self.pushed[key])
        running = dict(before)
        persisted = self.persisted[key]
        statuses = []
        for producer, sequence in check.identities:
            current = running.get(producer)
            if current is None or sequence > current:
                statuses.append(Status.NOT_DUP)
                running[producer] = sequence
            elif producer in persisted and sequence <= persisted[producer]:
                statuses.append(Status.DUP)
            elif producer not in before or sequence > before[producer]:
                statuses.append(Status.DUP)  # an earlier record of this very batch
            else:
                statuses.append(Status.UNKNOWN)
        if Status.UNKNOWN not in statuses:
            self.pushed[key] = running
        return PartitionVerdict(tuple(statuses), (), sizes=(None,) * len(statuses))

    async def reset_pushed(self, topic: str, partition: int, token: str | None = None) -> bool:
        key = (topic, partition)
        if token and self.tokens.get(key) != token:
            return False
        self.pushed[key] = dict(self.persisted[key])
        return True

    async def mark_persisted(
        self,
        updates: Sequence[tuple[str, int, Mapping[str, Persisted]]],
        now_ms: int,
        tokens: Sequence[str | None] | None = None,
    ) -> list[int]:
        lost = []
        for i, ((topic, partition, highest), token) in enumerate(
            zip(updates, tokens or [None] * len(updates), strict=True)
        ):
            key = (topic, partition)
            if token and self.tokens.get(key) != token:
                lost.append(i)
                continue
            for producer, position in highest.items():
                assert isinstance(position, int)
                persisted = max(position, self.persisted[key].get(producer, position))
                self.persisted[key][producer] = persisted
                self.pushed[key][producer] = max(persisted, self.pushed[key].get(producer, -1))
        return lost

    async def forget_producers(self, topic: str, partition: int, producers: Sequence[str]) -> bool:
        key = (topic, partition)
        self.forgotten.append((key, list(producers)))
        found = [p for p in producers if p in self.pushed[key] or p in self.persisted[key]]
        for producer in producers:
            self.pushed[key].pop(producer, None)
            self.persisted[key].pop(producer, None)
        return bool(found)

    def load(self, key: Key, token: str, highest: Mapping[str, int]) -> None:
        """What a recovery leaves: both maps from the log, a new token."""
        self.tokens[key] = token
        self.pushed[key] = dict(highest)
        self.persisted[key] = dict(highest)

    def forget(self, key: Key) -> None:
        """Redis flushed."""
        self.tokens.pop(key, None)
        self.pushed.pop(key, None)
        self.persisted.pop(key, None)


@dataclass
class Step:
    """What the fake writer does with one submit (all its batches alike)."""

    outcome: str = "written"  # "written", "failed" (definitely not) or "unresolved"
    landed: bool = False  # unresolved or lost: whether the write is in the log after all
    hold: asyncio.Event | None = None  # the outcome waits for it
    raises: Exception | None = None  # submit raises it: nothing assigned
    lost: Exception | None = None  # the outcome's future fails with it
    code: int = ErrorCode.not_leader_or_follower  # for "failed"


@dataclass
class FakeWriter:
    """An idempotent writer over an in-memory log (`ports.Writer`)."""

    log: dict[Key, list[tuple[str, int]]] = field(default_factory=lambda: defaultdict(list))
    script: deque[Step] = field(default_factory=deque)
    submitted: list[list[tuple[Key, list[tuple[str, int]]]]] = field(default_factory=list)
    built: dict[Key, list[RecordBytes]] = field(default_factory=lambda: defaultdict(list))
    withdrawn: list[Key] = field(default_factory=list)
    forgotten: list[Key] = field(default_factory=list)
    unresolved: set[Key] = field(default_factory=set)  # partitions `forget` refuses to drop
    log_start: dict[Key, int] = field(default_factory=dict)  # answered with a write; else -1
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    # Per partition, the outcomes still to come of the batches in flight, in order.
    in_flight: dict[Key, list[asyncio.Future[WriteResult]]] = field(
        default_factory=lambda: defaultdict(list)
    )

    def forget(self, topic: str, partition: int) -> bool:
        if (topic, partition) in self.unresolved:
            return False
        self.forgotten.append((topic, partition))
        return True

    async def submit(
        self, broker: Endpoint, batches: Sequence[BatchToWrite], timeout_ms: int
    ) -> asyncio.Future[list[WriteResult]]:
        step = self.script.popleft() if self.script else Step()
        if step.raises is not None:
            raise step.raises
        loop = asyncio.get_running_loop()
        planned: list[_Planned] = []
        for batch in batches:  # the real writer asks `wanted` as each takes its sequence
            key = (batch.topic, batch.partition)
            if batch.wanted is not None and not batch.wanted():
                self.withdrawn.append(key)
                planned.append(_Planned(batch, None, [], None))
                continue
            ahead = list(self.in_flight[key])
            resolved: asyncio.Future[WriteResult] = loop.create_future()
            self.in_flight[key].append(resolved)
            data = batch.build(7, 0, 0)
            self.built[key].append(data)
            planned.append(_Planned(batch, identities(bytes(data)), ahead, resolved))
        self.submitted.append(
            [((p.batch.topic, p.batch.partition), p.ids) for p in planned if p.ids is not None]
        )
        outcome: asyncio.Future[list[WriteResult]] = loop.create_future()
        task = asyncio.create_task(self._complete(step, planned, outcome))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return outcome

    async def _complete(
        self, step: Step, planned: list[_Planned], outcome: asyncio.Future[list[WriteResult]]
    ) -> None:
        if step.hold is not None:
            await step.hold.wait()
        results = []
        for entry in planned:
            if entry.ids is None or entry.resolved is None:
                results.append(WITHDRAWN)
                continue
            result = self._outcome(step, entry, await _worst(entry.ahead))
            if entry.batch.settled is not None and step.lost is None:
                entry.batch.settled(result)  # as the real writer: before a later batch goes
            entry.resolved.set_result(result)
            self.in_flight[(entry.batch.topic, entry.batch.partition)].remove(entry.resolved)
            results.append(result)
        if step.lost is not None:
            outcome.set_exception(step.lost)
        else:
            outcome.set_result(results)

    def _outcome(self, step: Step, entry: _Planned, ahead: WriteResult | None) -> WriteResult:
        key = (entry.batch.topic, entry.batch.partition)
        if ahead is not None and ahead.unresolved:  # as the real writer: give up too
            return WriteResult(False, ErrorCode.not_leader_or_follower, unresolved=True)
        if ahead is not None:  # Kafka refuses a batch whose predecessor is missing
            return WriteResult(False, ErrorCode.not_enough_replicas, error_message="gap")
        written = step.outcome == "written" and step.lost is None
        base = len(self.log[key])
        if written or step.landed:
            self.log[key] += entry.ids or []
        if written:
            return WriteResult(True, base_offset=base, log_start_offset=self.log_start.get(key, -1))
        if step.outcome == "unresolved" or step.lost is not None:
            return WriteResult(False, ErrorCode.not_leader_or_follower, unresolved=True)
        return WriteResult(False, step.code, error_message="scripted failure")


@dataclass
class _Planned:
    batch: BatchToWrite
    ids: list[tuple[str, int]] | None  # None: withdrawn
    ahead: list[asyncio.Future[WriteResult]]  # of its partition, in flight when it was sent
    resolved: asyncio.Future[WriteResult] | None


async def _worst(ahead: list[asyncio.Future[WriteResult]]) -> WriteResult | None:
    """The first of these outcomes that is not written (None: all written)."""
    for result in [await future for future in ahead]:
        if not result.written:
            return result
    return None


@dataclass
class FakeTopicIds:
    """Kafka's topic ids (`ports.TopicIdLookup`): each topic keeps its id until a test
    creates it again (`recreate`) or deletes it; ``hold`` makes every lookup wait."""

    ids: dict[str, str | None] = field(default_factory=dict)  # None: deleted
    asked: list[tuple[str, Endpoint | None]] = field(default_factory=list)
    failure: Exception | None = None
    hold: asyncio.Event | None = None
    _serial: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    async def of(self, topic: str, broker: Endpoint | None = None) -> str | None:
        self.asked.append((topic, broker))
        if self.hold is not None:
            await self.hold.wait()
        if self.failure is not None:
            raise self.failure
        if topic not in self.ids:
            self.ids[topic] = f"00000000-0000-0000-0000-{next(self._serial):012d}"
        found = self.ids[topic]
        if found is None:
            raise UnknownTopic(f"topic {topic} does not exist")
        return found

    async def answers(
        self, topics: Sequence[str], broker: Endpoint | None = None
    ) -> dict[str, str | Exception | None]:
        found: dict[str, str | Exception | None] = {}
        for topic in topics:
            try:
                found[topic] = await self.of(topic)
            except UnknownTopic as gone:
                found[topic] = gone
        return found

    def recreate(self, topic: str) -> None:
        self.ids[topic] = f"00000000-0000-0000-0000-{next(self._serial):012d}"

    def engine_asked(self) -> list[str]:
        """The topics the engine asked of a partition's leader (recovery asks no broker)."""
        return [topic for topic, broker in self.asked if broker is not None]


@dataclass
class FakeRecovery:
    """Rebuilds partitions from the fake log (`ports.PartitionRecovery`)."""

    state: FakeState
    writer: FakeWriter
    topic_ids: FakeTopicIds = field(default_factory=FakeTopicIds)
    calls: list[list[Key]] = field(default_factory=list)
    hold: asyncio.Event | None = None  # every run waits for it
    failing: dict[Key, int] = field(default_factory=dict)  # key -> runs left that fail it
    unfenceable: set[Key] = field(default_factory=set)  # a run holding one raises
    held: dict[Key, str] = field(default_factory=dict)  # key -> the instance holding its lease
    # Partitions another instance may have written: a log with records, or these
    written_elsewhere: set[Key] = field(default_factory=set)
    # key -> producer -> its latest run in the log's tail, as the replay reads it
    runs: dict[Key, dict[str, list[tuple[int, int, int, int]]]] = field(default_factory=dict)
    _tokens: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    async def run(
        self, partitions: Sequence[Key], later: Later
    ) -> tuple[dict[Key, RecoveredPartition], dict[Key, Exception]]:
        self.calls.append(list(partitions))
        if self.hold is not None:
            await self.hold.wait()
        if self.unfenceable & set(partitions):
            raise FenceError("the fence timed out")
        recovered: dict[Key, RecoveredPartition] = {}
        failed: dict[Key, Exception] = {}
        for key in partitions:
            if key in self.held:
                failed[key] = NotOwner(self.held[key])
                continue
            if self.failing.get(key, 0) > 0:
                self.failing[key] -= 1
                failed[key] = RuntimeError("replay failed")
                continue
            try:
                topic_id = await self.topic_ids.of(key[0])
            except UnknownTopic as gone:
                failed[key] = gone
                continue
            highest: dict[str, int] = {}
            for producer, sequence in self.writer.log[key]:
                highest[producer] = max(sequence, highest.get(producer, sequence))
            token = f"token-{next(self._tokens)}"
            self.state.load(key, token, highest)
            end = len(self.writer.log[key])
            loaded = RecoveredState({p: (s, NOW_MS) for p, s in highest.items()}, {})
            recovered[key] = RecoveredPartition(
                *key,
                token,
                end,
                None,
                0,
                end,
                len(highest),
                0.0,
                loaded,
                topic_id,
                unseen_writes=bool(end) or key in self.written_elsewhere,
                runs=self.runs.get(key, {}),
                log_start=self.writer.log_start.get(key, -1),
            )
        return recovered, failed


@dataclass
class FixedPolicies:
    policies: PolicySnapshot = field(default_factory=lambda: PolicySnapshot(Mode.ENABLED))

    async def snapshot(self) -> PolicySnapshot:
        return self.policies


@dataclass
class FakeOwners:
    """Partition ownership (`ports.Owners`): this instance owns everything but ``elsewhere``."""

    elsewhere: dict[Key, Redirect] = field(default_factory=dict)
    lapsed: set[Key] = field(default_factory=set)  # leases not renewed in time
    released: set[Key] = field(default_factory=set)  # leases no longer held
    let_go_of: list[Key] = field(default_factory=list)  # leases given up (`let_go`), in order
    # Told of a lease no longer held, as `Ownership` tells the recovery scheduler.
    on_lost: Callable[[Key], None] = lambda key: None

    def let_go(self, key: Key) -> bool:
        if key in self.released:
            return False
        self.released.add(key)
        self.let_go_of.append(key)
        self.on_lost(key)
        return True

    def ready(self) -> bool:
        return True

    def serves_here(self, key: Key) -> bool:
        return key not in self.elsewhere

    def holds(self, key: Key) -> bool:
        return key not in self.released

    def lease_valid(self, key: Key) -> bool:
        return key not in self.lapsed and key not in self.released

    def redirect(self, key: Key, holder: str | None = None) -> Redirect | None:
        if holder is not None:
            return Redirect(holder, Node(7001, Endpoint("holder", 9092)), 3)
        return self.elsewhere.get(key)

    absent: set[Key] = field(default_factory=set)  # Kafka has no such partition

    looking_up: int = 0  # lookups under way
    most_at_once: int = 0

    async def learn_leader(self, key: Key) -> tuple[int, int] | None:
        self.looking_up += 1
        self.most_at_once = max(self.most_at_once, self.looking_up)
        try:
            await asyncio.sleep(0)
        finally:
            self.looking_up -= 1
        if key in self.absent:
            raise NoSuchPartition(f"topic {key[0]} has no partition {key[1]}")
        return 1, 3


@dataclass
class FakeClock:
    now_ms: int = NOW_MS

    def clock_ms(self) -> int:
        return self.now_ms


@dataclass
class Rig:
    state: FakeState
    writer: FakeWriter
    recovery: FakeRecovery
    scheduler: RecoveryScheduler
    engine: DedupEngine
    owners: FakeOwners
    policies: FixedPolicies
    check_state: str
    topic_ids: FakeTopicIds

    async def admit(
        self, *parts: tuple[Key, bytes], connection: object | None = None
    ) -> asyncio.Task[dict[Key, PartitionAnswer]]:
        """Admit one request now (its place in line) and start it, without waiting."""
        request = produce_request(*parts)
        admission = await self.engine.admit(request, connection=connection)
        assert admission is not None
        return asyncio.create_task(self.engine.produce(request, admission, BROKER))

    async def send(
        self, *parts: tuple[Key, bytes], connection: object | None = None
    ) -> dict[Key, PartitionAnswer]:
        return await asyncio.wait_for(await self.admit(*parts, connection=connection), 5)

    async def settle(self) -> None:
        """Until the background work (resets, recoveries, persisted flushes) is done."""
        for _ in range(3):
            await asyncio.sleep(0.05)
            await self.engine.flush_persisted()


@contextlib.asynccontextmanager
async def running(
    *,
    first_use_wait_s: float = 2.0,
    retry_s: tuple[float, float] = (0.01, 0.05),
    policies: PolicySnapshot | None = None,
    max_request_decompressed_bytes: int = 128 << 20,
    persisted_linger_s: float = 0.005,
    max_producers: int = 10_000,
    max_absent_partitions: int = 10_000,
    recent_append_producers: int = 10_000,
    bindings: ProducerBindings | None = None,
) -> AsyncIterator[Rig]:
    state, writer, topic_ids = FakeState(), FakeWriter(), FakeTopicIds()
    recovery = FakeRecovery(state, writer, topic_ids)
    scheduler = RecoveryScheduler(recovery, retry_s=retry_s)
    owners = FakeOwners(on_lost=scheduler.forget)
    fixed = FixedPolicies(policies or PolicySnapshot(Mode.ENABLED))
    engine = DedupEngine(
        state,
        fixed,
        writer,
        IdentityHeaders(),
        scheduler,
        FakeClock(),
        owners,
        first_use_wait_s=first_use_wait_s,
        settle_wait_s=2.0,
        max_request_decompressed_bytes=max_request_decompressed_bytes,
        persisted_linger_s=persisted_linger_s,
        check_state="memory" if _check_state == "memory" else "redis",
        max_producers=max_producers,
        topic_ids=topic_ids,
        max_absent_partitions=max_absent_partitions,
        recent_append_producers=recent_append_producers,
        bindings=bindings,
    )
    if _check_state == "memory":  # what is checked is recorded as FakeState records it
        queue = engine._checks.queue

        def recorded(checks: Sequence[PartitionCheck]) -> Any:
            state.checked += [((c.topic, c.partition), list(c.identities)) for c in checks]
            return queue(checks)

        engine._checks.queue = recorded  # type: ignore[method-assign]
    try:
        yield Rig(
            state, writer, recovery, scheduler, engine, owners, fixed, _check_state, topic_ids
        )
    finally:
        await scheduler.close()
        await engine.close()


def checked_at(rig: Rig, key: Key) -> set[int]:
    """When the partition's checks were made, by the clock given to the engine."""
    if rig.check_state == "redis":
        return set(rig.state.now_ms)
    sequences = rig.engine.partition_states()[key].sequences
    assert sequences is not None
    return {p.last_seen_ms for p in sequences.producers().values() if p.last_seen_ms}


def ok(answer: PartitionAnswer) -> bool:
    return answer.error_code == 0


def retriable_not_written(answer: PartitionAnswer) -> bool:
    return answer.error_code in RETRIABLE_NOT_WRITTEN


# ----------------------------------------------------------------------------- answers


async def test_new_records_are_written_once_and_answered_with_their_offset() -> None:
    async with running() as rig:
        first = await rig.send((P0, records("p", [0, 1, 2])))
        second = await rig.send((P0, records("p", [3])))
        assert first[P0] == PartitionAnswer(base_offset=0)
        assert second[P0] == PartitionAnswer(base_offset=3)
        assert rig.writer.log[P0] == in_order("p", [0, 1, 2, 3])
        assert rig.recovery.calls == [[P0]], "recovered once, on first use"
        assert checked_at(rig, P0) == {NOW_MS}, "the check is stamped with the given clock"


async def test_a_batch_of_new_records_is_written_as_the_client_sent_it_restamped() -> None:
    sent = records("p", [0, 1, 2])
    async with running() as rig:
        await rig.send((P0, sent))
        [written] = rig.writer.built[P0]
        assert written == restamp_batch(sent, 7, 0, 0)
        [batch] = read_batches(written)
        assert (batch.producer_id, batch.producer_epoch, batch.base_sequence) == (7, 0, 0)
        assert [r.value for r in batch.records] == [b"v0", b"v1", b"v2"]


async def test_a_batch_of_duplicates_only_is_answered_without_decoding_its_records() -> None:
    """A blind re-send (a producer restarted): the check's verdicts say it all, and the
    original's offset is found by the batch's identities alone."""
    async with running() as rig:
        assert ok((await rig.send((P0, records("p", [0, 1, 2]))))[P0])
        with mock.patch.object(LazyRecords, "_loaded", side_effect=AssertionError("decoded")):
            again = await rig.send((P0, records("p", [0, 1, 2])))
        assert again[P0] == PartitionAnswer(base_offset=0)
        assert rig.writer.log[P0] == in_order("p", [0, 1, 2])


async def test_a_batch_with_duplicates_or_implicit_identities_is_rebuilt() -> None:
    implicit = IncomingRecord(0, NOW_MS, None, b"i", (), None)
    idempotent = build_batch(
        [implicit],
        compression=0,
        timestamp_type=0,
        producer_id=40,
        producer_epoch=1,
        base_sequence=0,
        add_identity_headers=False,
    )
    async with running() as rig:
        await rig.send((P0, records("p", [0])))
        await rig.settle()
        await rig.send((P0, records("p", [0, 1])))  # 0 dropped
        await rig.send((P1, idempotent))  # headers added
        rebuilt = [
            read_batches(rig.writer.built[P0][1])[0],
            read_batches(rig.writer.built[P1][0])[0],
        ]
        assert [[r.value for r in batch.records] for batch in rebuilt] == [[b"v1"], [b"i"]]
        assert rebuilt[1].records[0].headers == (
            (HEADER_PRODUCER, b"kafka-pid-40-1"),
            (HEADER_SEQUENCE, b"0"),
        )


async def test_uniform_batches_of_new_records_are_written_without_decoding_a_record() -> None:
    """The usual batches (one producer, sequences in a row; or implicit identities) are
    checked as runs and written restamped or rewritten in Rust: no record is decoded into a
    Python object unless one has to be dropped."""
    implicit = build_batch(
        [IncomingRecord(i, NOW_MS, None, b"i%d" % i, (), None) for i in range(3)],
        compression=0,
        timestamp_type=0,
        producer_id=40,
        producer_epoch=1,
        base_sequence=0,
        add_identity_headers=False,
    )
    decoded: list[int] = []
    real = LazyRecords._loaded

    def spy(self: LazyRecords) -> Any:
        if not self.loaded:
            decoded.append(len(self))
        return real(self)

    with mock.patch.object(LazyRecords, "_loaded", spy):
        async with running() as rig:
            await rig.send((P0, records("p", [0, 1, 2])), (P1, implicit))
            assert decoded == []
            await rig.settle()
            answer = await rig.send((P0, records("p", [2, 3])))  # 2 is a duplicate
            assert answer[P0] == PartitionAnswer(base_offset=2), "2 is just before 3"
            assert decoded == [2], "decoded only to drop the duplicate"
            assert rig.writer.log[P0] == in_order("p", [0, 1, 2, 3])
            assert identities(rig.writer.built[P1][0]) == [
                ("kafka-pid-40-1", 0),
                ("kafka-pid-40-1", 1),
                ("kafka-pid-40-1", 2),
            ]


async def test_a_large_batch_goes_to_the_writer_in_pieces_its_records_uncopied() -> None:
    sent = records("p", range(QUEUED_FROM_BYTES // 40))
    assert len(sent) > QUEUED_FROM_BYTES
    async with running() as rig:
        assert ok((await rig.send((P0, sent)))[P0])
        [written] = rig.writer.built[P0]
    assert isinstance(written, RecordPieces), "not joined on the event loop"
    assert bytes(written) == restamp_batch(sent, 7, 0, 0)
    records_view = written.pieces[-1]
    assert isinstance(records_view, memoryview) and records_view.obj is sent


async def test_a_large_batch_of_implicit_identities_gets_its_headers_in_the_reader_thread() -> None:
    count = READ_IN_THREAD_BYTES // 1000 + 10
    large = build_batch(
        [IncomingRecord(i, NOW_MS, None, bytes(1000), (), None) for i in range(count)],
        compression=0,
        timestamp_type=0,
        producer_id=41,
        producer_epoch=0,
        base_sequence=5,
        add_identity_headers=False,
    )
    threads: list[str] = []
    real = engine_module.made_ahead

    def spy(*args: Any) -> MadeAhead:
        threads.append(threading.current_thread().name)
        made = real(*args)
        assert made.identity_records is not None
        return made

    with mock.patch.object(engine_module, "made_ahead", spy):
        async with running() as rig:
            await rig.send((P0, large))
            assert len(threads) == 1 and threads[0] != threading.main_thread().name
            [written] = rig.writer.built[P0]
            assert identities(written) == [("kafka-pid-41-0", 5 + i) for i in range(count)]
    # Its CRC32C, from the records' CRC made in the thread, is the batch's.
    check: Any = DefaultRecordBatch(bytes(written))
    assert check.validate_crc()


async def test_large_partition_data_is_read_off_the_event_loop() -> None:
    """While a large batch is read, the loop runs other work, and while a compressed one is
    (what it decompresses to is unknown); a small one is read inline (a thread hop costs
    more than it saves)."""
    loop_thread = threading.get_ident()
    ticks = 0
    seen: list[tuple[int, bool]] = []  # per read: its size, and whether the loop ran during it

    def reading(data: bytes, headers: IdentityHeaders, **kwargs: Any) -> list[IncomingBatch]:
        start = ticks
        batches = read_batches(data, headers, **kwargs)
        if threading.get_ident() != loop_thread:  # wait for a tick: it comes if the loop runs
            deadline = time.monotonic() + 5
            while ticks == start and time.monotonic() < deadline:
                time.sleep(0.001)
        seen.append((len(data), ticks > start))
        return batches

    async def ticking() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.001)
            ticks += 1

    large = records("p", range(READ_IN_THREAD_BYTES // 40))
    assert len(large) > READ_IN_THREAD_BYTES
    small = records("p", [10**6])
    compressed = mixed([("p", 10**6 + 1)], compression=1)
    ticker = asyncio.create_task(ticking())
    try:
        with mock.patch("dedup.engine.read_batches", reading):
            async with running() as rig:
                answers = await rig.send((P0, large))
                assert ok(answers[P0])
                assert ok((await rig.send((P0, small)))[P0])
                assert ok((await rig.send((P0, compressed)))[P0])
    finally:
        ticker.cancel()
    assert seen == [(len(large), True), (len(small), False), (len(compressed), True)]


async def test_a_request_decompressing_past_its_bound_refuses_the_partitions_past_it() -> None:
    one = records("p", range(50))
    size = len(one) - HEADER_SIZE  # uncompressed: its records are what it decompresses to
    async with running(max_request_decompressed_bytes=size * 3 // 2) as rig:
        answers = await rig.send((P0, one), (P1, records("q", range(50))))
        assert ok(answers[P0])
        assert answers[P1].error_code == ErrorCode.message_too_large
        assert "max_request_decompressed_bytes" in (answers[P1].error_message or "")
        assert P1 not in rig.writer.log, "nothing of the refused partition was written"
        again = await rig.send((P1, records("q", range(50))))  # a request of its own fits
        assert ok(again[P1])


async def test_reads_in_threads_keep_the_order_of_the_partition_line() -> None:
    """A large request admitted first is read in a thread; a small one behind it is read
    at once, yet checked and written after it."""
    large = records("p", range(READ_IN_THREAD_BYTES // 40))
    async with running() as rig:
        first = await rig.admit((P0, large))
        second = await rig.admit((P0, records("p", [10**6])))
        answers = await asyncio.wait_for(asyncio.gather(first, second), 30)
        assert all(ok(a[P0]) for a in answers)
        assert [ids[0][1][-1][1] for ids in rig.writer.submitted] == [
            READ_IN_THREAD_BYTES // 40 - 1,
            10**6,
        ]


@pytest.fixture(params=["rust_scan", "python_readers"])
def record_scan(request: pytest.FixtureRequest) -> Iterator[str]:
    """The batches read by the Rust scan (identities found as a whole) or, with
    `native_record_scan = false`, by the Python readers (record by record)."""
    use_native_scan(request.param == "rust_scan")
    try:
        yield request.param
    finally:
        use_native_scan(True)


async def test_a_resent_batch_is_dropped_and_answered_with_its_originals_offset(
    record_scan: str,
) -> None:
    """As Kafka's broker answers a duplicate batch: with the offset the original got."""

    def answered() -> tuple[float, float]:
        name = "dedup_duplicate_batches_total"
        return counted(name, {"offset": "original"}), counted(name, {"offset": "none"})

    async with running() as rig:
        await rig.send((P0, records("p", [0, 1])))
        await rig.send((P0, records("p", [2])))
        await rig.settle()
        original, none = answered()
        again = await rig.send((P0, records("p", [0, 1])))
        assert again[P0] == PartitionAnswer(base_offset=0)
        assert (await rig.send((P0, records("p", [2]))))[P0] == PartitionAnswer(base_offset=2)
        assert rig.writer.log[P0] == in_order("p", [0, 1, 2])
        assert len(rig.writer.submitted) == 2, "nothing to write: the writer is not called"
        # Within one batch written: its records are at consecutive offsets.
        assert (await rig.send((P0, records("p", [1]))))[P0] == PartitionAnswer(base_offset=1)
        # Across two batches written in a row: from the first one's offsets.
        assert (await rig.send((P0, records("p", [1, 2]))))[P0] == PartitionAnswer(base_offset=1)
        # Not a run of sequences: no base offset holds for both.
        assert (await rig.send((P0, records("p", [0, 2]))))[P0] == PartitionAnswer(base_offset=-1)
        assert (await rig.send((P0, records("p", [0, 1, 0]))))[P0] == PartitionAnswer(
            base_offset=-1
        ), "a written batch and more"
        assert answered() == (original + 4, none + 2)


async def test_a_duplicate_is_answered_with_the_log_start_offset_kafka_gave_last() -> None:
    """As Kafka's broker answers a duplicate batch: with the log's current start offset,
    here the one Kafka's latest answer to a write on the partition gave."""
    async with running() as rig:
        assert (await rig.send((P0, records("p", [0]))))[P0] == PartitionAnswer(base_offset=0)
        await rig.settle()
        # Before any answer with a log start offset: -1, as before.
        assert (await rig.send((P0, records("p", [0]))))[P0] == PartitionAnswer(base_offset=0)
        rig.writer.log_start[P0] = 1  # retention deleted the first record meanwhile
        written = await rig.send((P0, records("p", [1, 2])))
        assert written[P0] == PartitionAnswer(base_offset=1, log_start_offset=1)
        await rig.settle()
        resent = [(await rig.send((P0, records("p", s))))[P0] for s in ([1, 2], [0], [0, 2])]
        assert resent == [
            PartitionAnswer(base_offset=1, log_start_offset=1),
            PartitionAnswer(base_offset=0, log_start_offset=1),
            PartitionAnswer(base_offset=-1, log_start_offset=1),  # not a run: no base
        ]
        # Another partition's start is its own.
        assert (await rig.send((P1, records("p", [0]))))[P1] == PartitionAnswer(base_offset=0)
        assert (await rig.send((P1, records("p", [0]))))[P1] == PartitionAnswer(base_offset=0)


async def test_a_duplicate_after_a_recovery_carries_the_log_start_offset_it_read() -> None:
    """Records deleted from the log's head are seen by the next write, or by the recovery
    of the partition when it is taken again (with the log's end): a duplicate answered
    after either carries the log start offset it read."""
    async with running() as rig:
        await rig.send((P0, records("p", [0, 1])))
        await rig.settle()
        rig.writer.log_start[P0] = 1  # DeleteRecords meanwhile
        before = (await rig.send((P0, records("p", [0, 1]))))[P0]
        assert before == PartitionAnswer(base_offset=0), "no write or recovery saw it yet"
        rig.scheduler.forget(P0)  # the lease lost, then taken again
        rig.recovery.runs[P0] = {"p": [(0, 2, 0, -1)]}
        after = (await rig.send((P0, records("p", [0, 1]))))[P0]
        assert after == PartitionAnswer(base_offset=0, log_start_offset=1)


async def test_a_batch_written_before_the_partition_was_taken_again_is_answered_from_the_log() -> (
    None
):
    """The answer was lost with the hold that wrote the batch (a crash, a restart). The
    recovery that opened this hold read each producer's latest run in the log's tail: a
    re-send within it is answered from it, as Kafka's new leader answers from the producer
    state it replicated. What the tail does not hold (before the snapshot) is answered -1."""
    async with running() as rig:
        await rig.send((P0, records("p", [0, 1])))
        await rig.send((P0, records("q", [0])))
        await rig.settle()
        rig.scheduler.forget(P0)  # the lease lost, then taken again
        rig.recovery.runs[P0] = {"p": [(0, 2, 0, 77)]}  # what the replay read: not q's
        resent = [
            (await rig.send((P0, records(producer, sequences))))[P0]
            for producer, sequences in [("p", [0, 1]), ("p", [1]), ("q", [0]), ("p", [1, 2])]
        ]
        assert resent == [
            PartitionAnswer(base_offset=0, log_append_time_ms=77),
            PartitionAnswer(base_offset=1, log_append_time_ms=77),
            PartitionAnswer(base_offset=-1),
            PartitionAnswer(base_offset=-1),  # 2 is new: written, a batch with a drop
        ]
        assert rig.writer.log[P0] == [*in_order("p", [0, 1]), ("q", 0), ("p", 2)]


async def test_a_resent_batch_is_answered_offset_minus_one_beyond_what_is_kept() -> None:
    """The latest 5 runs of each producer, for the latest producers to write only."""
    async with running(recent_append_producers=2) as rig:
        for sequence in range(6):  # p's batches at 0, 2, ... 10, each with r's after it
            await rig.send((P0, records("p", [sequence])))
            await rig.send((P0, records("r", [sequence])))
        await rig.settle()
        oldest, kept = [(await rig.send((P0, records("p", [s]))))[P0] for s in (0, 1)]
        assert (oldest, kept) == (PartitionAnswer(), PartitionAnswer(base_offset=2))
        await rig.send((P0, records("q", [0])))  # at 12; (p, P0) is the least recent to write
        await rig.send((P1, records("p", [0])))  # ... then (r, P0)
        await rig.settle()
        resent = [
            (await rig.send((key, records(producer, [sequence]))))[key]
            for key, producer, sequence in [(P0, "p", 5), (P0, "r", 5), (P0, "q", 0), (P1, "p", 0)]
        ]
        assert resent == [
            PartitionAnswer(),
            PartitionAnswer(),
            PartitionAnswer(base_offset=12),
            PartitionAnswer(base_offset=0),
        ]


async def test_a_blind_resend_of_batches_written_in_a_row_is_answered_with_their_offsets() -> None:
    """A producer restarted from its checkpoint sends again more than Kafka's 5 batches.
    Written with nothing between them, its batches are one run of the log: each re-send is
    answered with its original's offset, however far back."""
    async with running() as rig:
        for base in range(0, 40, 4):  # 10 batches of 4, at offsets 0-39
            await rig.send((P0, records("p", range(base, base + 4))))
        await rig.settle()
        resent = [(await rig.send((P0, records("p", range(b, b + 4)))))[P0] for b in (0, 2, 36)]
        assert resent == [PartitionAnswer(base_offset=b) for b in (0, 2, 36)]
        assert len(rig.writer.log[P0]) == 40, "nothing written again"


async def test_a_batch_mixing_duplicates_and_new_records_writes_only_the_new() -> None:
    async with running() as rig:
        await rig.send((P0, records("p", [0, 1])))
        await rig.settle()
        mixed = await rig.send((P0, records("p", [1, 2, 3])))
        assert ok(mixed[P0]) and mixed[P0].base_offset == 1, "1 is just before 2 and 3"
        assert rig.writer.log[P0] == in_order("p", [0, 1, 2, 3])


async def test_the_written_part_of_a_batch_with_duplicates_is_remembered_where_it_went() -> None:
    """A batch whose first records were duplicates and the rest written: the rest is where
    a later re-send finds it, and where it follows its dropped ones in the log, one run
    with them, so that a re-send of the whole batch is answered with its first offset."""
    async with running() as rig:
        await rig.send((P0, records("p", [0, 1])))  # at 0-1
        await rig.send((P0, records("p", [1, 2, 3])))  # 2-3 at 2-3, right after 1
        await rig.send((P0, records("q", [0])))  # at 4
        await rig.send((P0, records("p", [3, 4, 5])))  # 4-5 at 5-6, q's record between
        await rig.settle()
        resent = [
            (await rig.send((P0, records("p", s))))[P0]
            for s in ([0, 1, 2, 3], [2, 3], [4, 5], [5], [3, 4])
        ]
        assert resent == [
            PartitionAnswer(base_offset=0),
            PartitionAnswer(base_offset=2),
            PartitionAnswer(base_offset=5),
            PartitionAnswer(base_offset=6),
            PartitionAnswer(base_offset=-1),  # 3 at 3, 4 at 5: no base is right
        ]
        log = [*in_order("p", [0, 1, 2, 3]), ("q", 0), *in_order("p", [4, 5])]
        assert rig.writer.log[P0] == log


async def test_a_resend_right_after_the_ack_is_a_duplicate_not_a_retry() -> None:
    """The acknowledgement is not in Redis yet (the flusher lingers), but the check of the
    partition sees it: the maps in memory took it at once; a check in Redis records it
    first, in its own round trip."""
    async with running(persisted_linger_s=30) as rig:
        assert ok((await rig.send((P0, records("p", [0, 1]))))[P0])
        again = await rig.send((P0, records("p", [0, 1])))
        assert again[P0] == PartitionAnswer(base_offset=0), again[P0]
        assert rig.state.acked_with_checks == (1 if rig.check_state == "redis" else 0)
        assert rig.writer.log[P0] == in_order("p", [0, 1])
        await asyncio.wait_for(rig.engine.flush_persisted(), 5)  # nothing left behind


async def test_unknown_records_are_refused_retriable_and_nothing_is_written() -> None:
    async with running() as rig:
        await rig.send((P0, records("p", [0])))
        in_flight = asyncio.Event()
        rig.writer.script.append(Step(hold=in_flight))
        first = await rig.admit((P0, records("p", [1, 2])))
        await asyncio.sleep(0.05)  # written, not yet acknowledged: pushed, not persisted
        resent = await rig.send((P0, records("p", [1, 2])))
        assert resent[P0].error_code == ErrorCode.not_enough_replicas
        assert len(rig.writer.submitted) == 2, "the UNKNOWN batch never reached the writer"
        in_flight.set()
        assert (await first)[P0] == PartitionAnswer(base_offset=1)
        await rig.settle()
        retried = await rig.send((P0, records("p", [1, 2])))
        assert retried[P0] == PartitionAnswer(base_offset=1)
        assert rig.writer.log[P0] == in_order("p", [0, 1, 2])


async def test_transactional_requests_and_topics_with_dedup_disabled_are_left_to_kafka() -> None:
    disabled = PolicySnapshot(Mode.ENABLED, topics={"raw": Mode.DISABLED})
    async with running(policies=disabled) as rig:
        data = records("p", [0])
        transactional = produce_request((P0, data), transactional_id="tx")
        assert await rig.engine.admit(transactional) is None
        assert await rig.engine.admit(produce_request((("raw", 0), data))) is None
        assert await rig.engine.admit(produce_request((P0, data))) is not None


def transactional_batch(headers: Sequence[tuple[str, bytes]]) -> bytes:
    """A transactional batch of one record with these headers."""
    builder = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=0,
        is_transactional=True,
        producer_id=7,
        producer_epoch=0,
        base_sequence=0,
        batch_size=1 << 20,
    )
    builder.append(0, timestamp=NOW_MS, key=None, value=b"v", headers=list(headers))
    return bytes(builder.build())


async def test_a_transaction_naming_another_principals_producer_is_answered_whole_here() -> None:
    """Transactional requests are forwarded unchecked, except that an authenticated client's
    may not name a producer bound to another principal (a committed one counts at the next
    replay): refused where it does, the rest answered not written, nothing forwarded."""
    bindings = prefix_bindings({"orders-": "User:orders"})
    disabled = PolicySnapshot(Mode.ENABLED, topics={"raw": Mode.DISABLED})
    named = transactional_batch([(HEADER_PRODUCER, b"orders-1"), (HEADER_SEQUENCE, b"4")])
    plain = transactional_batch([])
    async with running(policies=disabled, bindings=bindings) as rig:
        refuse = rig.engine.refuse_foreign_names_in_transaction
        request = produce_request(
            (P0, named), (P1, plain), (("raw", 0), named), transactional_id="tx"
        )
        assert await refuse(request, "User:orders") is None
        assert await refuse(request, None) is None  # not authenticated: not checked
        answers = await refuse(request, "User:other")
        assert answers is not None
        assert answers[P0].error_code == ErrorCode.topic_authorization_failed
        assert "belongs to User:orders" in (answers[P0].error_message or "")
        for key in (P1, ("raw", 0)):
            assert answers[key].error_code == ErrorCode.not_enough_replicas, key
        # A name the replay would not count (not UTF-8, empty) is not refused.
        unreadable = transactional_batch([(HEADER_PRODUCER, b"\xff"), (HEADER_PRODUCER, b"")])
        assert (
            await refuse(produce_request((P0, unreadable), transactional_id="tx"), "User:x") is None
        )
        # A batch that cannot be read is refused, as outside a transaction.
        broken = produce_request((P0, named[:-3]), transactional_id="tx")
        answers = await refuse(broken, "User:orders")
        assert answers is not None and answers[P0].error_code == ErrorCode.corrupt_message
        # Not transactional: the engine's own check, after admit.
        assert await refuse(produce_request((P0, records("orders-1", [0]))), "User:x") is None
        assert rig.writer.log == {}


async def test_a_transactions_partitions_share_the_requests_decompressed_bound() -> None:
    """An authenticated client's transactional batches are read for the names they carry
    within `max_request_decompressed_bytes`, shared by the request's partitions as outside
    a transaction: so one request cannot make the proxy decompress without end."""
    bindings = prefix_bindings({"orders-": "User:orders"})
    named = transactional_batch([(HEADER_PRODUCER, b"orders-1"), (HEADER_SEQUENCE, b"4")])
    size = len(named) - HEADER_SIZE  # uncompressed: its records are what it decompresses to
    async with running(max_request_decompressed_bytes=size * 3 // 2, bindings=bindings) as rig:
        refuse = rig.engine.refuse_foreign_names_in_transaction
        one = produce_request((P0, named), transactional_id="tx")
        assert await refuse(one, "User:orders") is None, "one partition is within the bound"
        two = produce_request((P0, named), (P1, named), transactional_id="tx")
        answers = await refuse(two, "User:orders")
        assert answers is not None, "the second partition is past the request's bound"
        assert answers[P1].error_code == ErrorCode.message_too_large
        assert "max_request_decompressed_bytes" in (answers[P1].error_message or "")
        assert answers[P0].error_code == ErrorCode.not_enough_replicas, "refused whole"
        assert rig.writer.log == {}


# ----------------------------------------------------------------------------- order


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(start_order=st.permutations(range(5)))
def test_pipelined_requests_are_checked_and_written_in_arrival_order(
    start_order: list[int],
) -> None:
    """However the tasks happen to be scheduled, each partition's requests are checked
    and written in the order they arrived (the first even waits for the recovery)."""

    async def scenario() -> None:
        async with running() as rig:
            requests = [
                produce_request((P0, records("p", [2 * n, 2 * n + 1])), (P1, records("q", [n])))
                for n in range(5)
            ]
            admissions = [await rig.engine.admit(request) for request in requests]
            tasks: dict[int, asyncio.Task[dict[Key, PartitionAnswer]]] = {}
            for n in start_order:
                admission = admissions[n]
                assert admission is not None
                tasks[n] = asyncio.create_task(rig.engine.produce(requests[n], admission, BROKER))
            answers = [await asyncio.wait_for(tasks[n], 5) for n in range(5)]
            assert [a[P0].base_offset for a in answers] == [0, 2, 4, 6, 8]
            assert [a[P1].base_offset for a in answers] == [0, 1, 2, 3, 4]
            assert [ids for key, ids in rig.state.checked if key == P0] == [
                in_order("p", [2 * n, 2 * n + 1]) for n in range(5)
            ]
            assert rig.writer.log[P0] == in_order("p", range(10))
            assert rig.writer.log[P1] == in_order("q", range(5))

    asyncio.run(scenario())


@pytest.mark.redis_check
async def test_a_later_request_is_not_checked_while_an_earlier_one_waits_for_redis() -> None:
    async with running() as rig:
        await rig.send((P0, records("p", [0])))
        slow_redis = asyncio.Event()
        rig.state.hold_check = slow_redis
        first = await rig.admit((P0, records("p", [1])))
        second = await rig.admit((P0, records("p", [2])))
        await asyncio.sleep(0.05)
        assert [ids for _, ids in rig.state.checked] == [in_order("p", [0])]
        slow_redis.set()
        assert [(await t)[P0].base_offset for t in (first, second)] == [1, 2]
        assert rig.writer.log[P0] == in_order("p", [0, 1, 2])


@pytest.mark.redis_check
async def test_checks_queued_while_one_waits_for_redis_share_the_next_round_trip() -> None:
    """A client's pipelined requests are checked together in one round trip (each after the
    one before it, as Redis runs a round trip's scripts in order) and written in order."""
    async with running() as rig:
        await rig.send((P0, records("p", [0])))
        calls_before = len(rig.state.now_ms)
        slow_redis = asyncio.Event()
        rig.state.hold_check = slow_redis
        held = await rig.admit((P1, records("q", [0])))  # its round trip waits for Redis
        await asyncio.sleep(0.05)
        later = [await rig.admit((P0, records("p", [n, n + 1]))) for n in (1, 3, 5, 7)]
        await asyncio.sleep(0.05)
        slow_redis.set()
        answers = [(await asyncio.wait_for(t, 5))[P0] for t in later]
        assert (await held)[P1] == PartitionAnswer(base_offset=0)
        assert len(rig.state.now_ms) - calls_before == 2, "one round trip for the four"
        assert [a.base_offset for a in answers] == [1, 3, 5, 7]
        assert rig.writer.log[P0] == in_order("p", range(9))


@pytest.mark.redis_check
async def test_a_refusal_refuses_the_requests_checked_with_it_and_undoes_their_push() -> None:
    """Checked in the same round trip as a request that is then refused (retriable), a
    later request is refused too (it was sent before that answer), and what its check
    pushed is undone: the client's retry of it is written at once."""
    async with running() as rig:
        await rig.send((P0, records("p", [0])))
        await rig.settle()
        answer_held = asyncio.Event()
        rig.writer.script.append(Step(hold=answer_held))
        first = await rig.admit((P0, records("p", [1])))
        await asyncio.sleep(0.05)  # submitted, its answer held: p/1 pushed, not persisted
        slow_redis = asyncio.Event()
        rig.state.hold_check = slow_redis
        held = await rig.admit((P1, records("q", [0])))
        await asyncio.sleep(0.05)
        resent = await rig.admit((P0, records("p", [1])))  # UNKNOWN: p/1 is in flight
        after = await rig.admit((P0, records("p", [2])))  # NOT_DUP in the same round trip
        await asyncio.sleep(0.05)
        slow_redis.set()
        assert (await asyncio.wait_for(held, 5))[P1] == PartitionAnswer(base_offset=0)
        answer_held.set()
        assert (await asyncio.wait_for(first, 5))[P0] == PartitionAnswer(base_offset=1)
        assert retriable_not_written((await asyncio.wait_for(resent, 5))[P0])
        assert retriable_not_written((await asyncio.wait_for(after, 5))[P0])
        await rig.settle()
        assert ok((await rig.send((P0, records("p", [1]))))[P0])  # a duplicate now
        assert (await rig.send((P0, records("p", [2]))))[P0] == PartitionAnswer(base_offset=2)
        assert rig.writer.log[P0] == in_order("p", [0, 1, 2])


# ----------------------------------------------------------------------------- failed writes


async def test_a_failed_write_resets_the_partition_so_the_retry_is_written() -> None:
    async with running() as rig:
        await rig.send((P0, records("p", [0])))
        rig.writer.script.append(Step(outcome="failed"))
        failed = await rig.send((P0, records("p", [1, 2])))
        assert failed[P0].error_code == ErrorCode.not_leader_or_follower
        retried = await rig.send((P0, records("p", [1, 2])))
        assert retried[P0] == PartitionAnswer(base_offset=1)
        assert rig.writer.log[P0] == in_order("p", [0, 1, 2])


async def test_a_request_in_flight_behind_a_failed_write_fails_with_it_and_both_retry() -> None:
    async with running() as rig:
        await rig.send((P0, records("p", [0])))
        await rig.settle()
        fails = asyncio.Event()
        rig.writer.script.append(Step(outcome="failed", hold=fails))
        first = await rig.admit((P0, records("p", [1, 2])))
        second = await rig.admit((P0, records("p", [3, 4])))
        await asyncio.sleep(0.05)
        assert len(rig.writer.submitted) == 3, "both in flight"
        fails.set()
        answers = [await asyncio.wait_for(t, 5) for t in (first, second)]
        assert retriable_not_written(answers[0][P0]) and retriable_not_written(answers[1][P0])
        assert (await rig.send((P0, records("p", [1, 2]))))[P0] == PartitionAnswer(base_offset=1)
        assert (await rig.send((P0, records("p", [3, 4]))))[P0] == PartitionAnswer(base_offset=3)
        assert rig.writer.log[P0] == in_order("p", range(5))


async def test_a_request_reaching_the_partition_after_an_earlier_one_failed_is_refused() -> None:
    """The later request waits on another partition of its own (a first use) while the
    earlier one fails. Before: once the partition was reset it was written, ahead of the
    failed one's retry, which then read as an old duplicate: answered success, never
    written (records 1 and 2 lost)."""
    async with running() as rig:
        await rig.send((P0, records("p", [0])))
        await rig.settle()
        rig.recovery.hold = replaying = asyncio.Event()  # P1's first use waits
        rig.writer.script.append(Step(outcome="failed", hold=(fails := asyncio.Event())))
        first = await rig.admit((P0, records("p", [1, 2])))
        second = await rig.admit((P1, records("q", [0])), (P0, records("p", [3, 4])))
        await asyncio.sleep(0.05)
        fails.set()
        assert retriable_not_written((await asyncio.wait_for(first, 5))[P0])
        await rig.settle()  # the partition is reset meanwhile
        replaying.set()
        answers = await asyncio.wait_for(second, 5)
        assert answers[P1] == PartitionAnswer(base_offset=0)
        assert retriable_not_written(answers[P0]), "sent before the failure was known"
        assert rig.writer.log[P0] == in_order("p", [0])
        # The client retries both, in order: both are written, nothing is lost.
        assert (await rig.send((P0, records("p", [1, 2]))))[P0] == PartitionAnswer(base_offset=1)
        assert (await rig.send((P0, records("p", [3, 4]))))[P0] == PartitionAnswer(base_offset=3)
        assert rig.writer.log[P0] == in_order("p", range(5))


@pytest.mark.redis_check
async def test_a_failure_told_while_a_later_request_is_in_its_check_refuses_that_one() -> None:
    """The writer tells the failure before a later batch can take a sequence: the later
    request, checked meanwhile, is refused when its verdict comes back (it never reaches
    the writer, let alone the log ahead of the retry), and what its check pushed is
    undone, so the retries are accepted."""
    async with running() as rig:
        await rig.send((P0, records("p", [0])))
        await rig.settle()
        answer_held = asyncio.Event()
        rig.writer.script.append(Step(outcome="failed", hold=answer_held))
        first = await rig.admit((P0, records("p", [1])))
        await asyncio.sleep(0.05)  # submitted; its answer is held
        slow_redis = asyncio.Event()
        rig.state.hold_check = slow_redis
        second = await rig.admit((P0, records("p", [2])))
        await asyncio.sleep(0.05)  # the second is in its check
        answer_held.set()  # the first fails: the writer tells the engine at once
        await asyncio.sleep(0)
        slow_redis.set()
        answers = [await asyncio.wait_for(t, 5) for t in (first, second)]
        assert retriable_not_written(answers[0][P0]) and retriable_not_written(answers[1][P0])
        sent = [ids for submit in rig.writer.submitted for _, ids in submit]
        assert sent == [in_order("p", [0]), in_order("p", [1])], "the second never got there"
        assert rig.writer.withdrawn == []
        assert (await rig.send((P0, records("p", [1]))))[P0] == PartitionAnswer(base_offset=1)
        assert (await rig.send((P0, records("p", [2]))))[P0] == PartitionAnswer(base_offset=2)
        assert rig.writer.log[P0] == in_order("p", [0, 1, 2])


async def test_a_refusal_refuses_neither_other_partitions_nor_requests_sent_after_it() -> None:
    async with running() as rig:
        await rig.send((P0, records("p", [0])), (P1, records("q", [0])))
        rig.writer.script.append(Step(outcome="failed"))
        await rig.send((P0, records("p", [1])))
        on_other = await rig.send((P1, records("q", [1])))
        retry = await rig.send((P0, records("p", [1])))
        assert on_other[P1] == PartitionAnswer(base_offset=1)
        assert retry[P0] == PartitionAnswer(base_offset=1), "admitted after the answer went out"


def kafka_batch(
    base_sequence: int,
    count: int,
    producer_id: int = 40,
    explicit: str | None = None,
    epoch: int = 1,
) -> bytes:
    """A Kafka idempotent producer's batch (producer id, epoch, base sequence): implicit
    identities, or with `explicit` the records name that producer in headers, sequence
    = Kafka's sequence + 1000 (the identity the proxy reads is then the header's)."""
    batch = [
        IncomingRecord(
            i,
            NOW_MS,
            None,
            b"k%d" % (base_sequence + i),
            ()
            if explicit is None
            else (
                (HEADER_PRODUCER, explicit.encode()),
                (HEADER_SEQUENCE, str(1000 + base_sequence + i).encode()),
            ),
            None if explicit is None else Identity(explicit, 1000 + base_sequence + i),
        )
        for i in range(count)
    ]
    return build_batch(
        batch,
        compression=0,
        timestamp_type=0,
        producer_id=producer_id,
        producer_epoch=epoch,
        base_sequence=base_sequence,
        add_identity_headers=False,
    )


async def test_a_kafka_producer_goes_on_past_the_wrap_of_its_sequences() -> None:
    """Kafka's sequences wrap from 2^31-1 to 0 (2^31 records per producer session). Before,
    the records after the wrap read as duplicates of the first ones: dropped, lost."""
    producer, wrap = "kafka-pid-40-1", 1 << 31
    async with running() as rig:
        first = await rig.send((P0, kafka_batch(wrap - 4, 2)))
        across = await rig.send((P0, kafka_batch(wrap - 2, 4)))  # Kafka's M-2, M-1, 0, 1
        after = await rig.send((P0, kafka_batch(2, 2)))
        assert [a[P0] for a in (first, across, after)] == [
            PartitionAnswer(base_offset=0),
            PartitionAnswer(base_offset=2),
            PartitionAnswer(base_offset=6),
        ]
        assert rig.writer.log[P0] == in_order(producer, range(wrap - 4, wrap + 4))
        retried = await rig.send((P0, kafka_batch(2, 2)))
        assert retried[P0] == PartitionAnswer(base_offset=6), "a retry is still a duplicate"
        # A new owner knows where the producer is from the log's headers: here, the
        # partition is let go of (what this owner knew of it forgotten) and taken again.
        rig.scheduler.forget(P0)
        assert (await rig.send((P0, kafka_batch(4, 2))))[P0] == PartitionAnswer(base_offset=8)
        # A duplicate. Written under the partition's earlier hold: answered offset -1.
        assert (await rig.send((P0, kafka_batch(2, 2))))[P0] == PartitionAnswer(base_offset=-1)
        assert rig.writer.log[P0] == in_order(producer, range(wrap - 4, wrap + 6))


async def test_a_kafka_producers_request_sent_behind_a_refused_one_waits_for_its_retry() -> None:
    """What the proxy's ordering cannot see otherwise (the README's "A retry answer and a
    request that arrives after it was decided"): a Kafka idempotent producer's request that
    reaches the proxy after an earlier one of the producer was refused would be written
    ahead of that one's retry, which would then read as old duplicates. Kafka's producers
    number their batches without holes, so the hole tells: refused, retriable, as Kafka's
    OUT_OF_ORDER_SEQUENCE_NUMBER would, and both retries are written, in order."""
    producer = "kafka-pid-40-1"
    async with running() as rig:
        await rig.send((P0, kafka_batch(0, 2)))
        await rig.settle()
        rig.writer.script.append(Step(outcome="failed"))
        first = await rig.send((P0, kafka_batch(2, 2)))
        assert retriable_not_written(first[P0])
        second = await rig.send((P0, kafka_batch(4, 2)))  # sent before `first` was read
        assert retriable_not_written(second[P0])
        assert second[P0].error_message == (
            "not written: sequence 4 of Kafka producer 40 (epoch 1) skips ahead of 2: "
            "a request it sent before this one is still to come"
        )
        assert rig.writer.log[P0] == in_order(producer, [0, 1])
        assert (await rig.send((P0, kafka_batch(2, 2))))[P0] == PartitionAnswer(base_offset=2)
        assert (await rig.send((P0, kafka_batch(4, 2))))[P0] == PartitionAnswer(base_offset=4)
        assert rig.writer.log[P0] == in_order(producer, range(6))


async def test_a_batch_skipping_ahead_is_refused_alone_as_kafka_refuses_it() -> None:
    """A Kafka producer's batch that skips ahead of its sequence is refused, retriable, and
    nothing behind it with it: another producer's request goes on, and so does the batch
    its own producer was to send next, as at Kafka's broker. Before, every request admitted
    behind it on the partition was refused too, so a client could make every other
    producer there re-send, by sending batches under producer ids of its own that skip
    ahead (the README's "Retries forced on other producers")."""
    async with running() as rig:
        await rig.send((P0, kafka_batch(0, 2)))
        await rig.send((P0, kafka_batch(0, 2, producer_id=41)))
        await rig.settle()
        skipping = await rig.admit((P0, kafka_batch(5, 2)))  # producer 40 expects 2
        other = await rig.admit((P0, kafka_batch(2, 2, producer_id=41)))
        own_next = await rig.admit((P0, kafka_batch(2, 2)))
        answers = [(await asyncio.wait_for(t, 5))[P0] for t in (skipping, other, own_next)]
        assert retriable_not_written(answers[0])
        assert "skips ahead of 2" in str(answers[0].error_message)
        assert answers[1:] == [PartitionAnswer(base_offset=4), PartitionAnswer(base_offset=6)]
        ours, theirs = "kafka-pid-40-1", "kafka-pid-41-1"
        assert rig.writer.log[P0] == [
            *in_order(ours, [0, 1]),
            *in_order(theirs, [0, 1, 2, 3]),
            *in_order(ours, [2, 3]),
        ]


def refused_behind() -> dict[str, float]:
    """`dedup_refused_behind_total` by reach, as the process counted it so far."""
    return {
        reach: REGISTRY.get_sample_value("dedup_refused_behind_total", {"reach": reach}) or 0.0
        for reach in ("partition", "connection", "producers")
    }


async def test_a_batch_that_cannot_be_read_holds_back_only_its_connections_requests() -> None:
    """A batch refused as damaged (retriable: its client sends it again) names no producer
    the proxy can trust. The requests its client sent behind it on the same connection are
    refused too, so none overtakes its re-send; requests of other connections go on."""
    async with running() as rig:
        await rig.send((P0, records("p", [0])))
        await rig.settle()
        before = refused_behind()
        bad = await rig.admit((P0, damaged(records("p", [1]))), connection="a")
        same_connection = await rig.admit((P0, records("p", [2])), connection="a")
        other_connection = await rig.admit((P0, records("q", [0])), connection="b")
        answers = [
            (await asyncio.wait_for(t, 5))[P0] for t in (bad, same_connection, other_connection)
        ]
        assert answers[0].error_code == ErrorCode.corrupt_message
        assert retriable_not_written(answers[1])
        assert answers[2] == PartitionAnswer(base_offset=1)
        assert refused_behind() == {**before, "connection": before["connection"] + 1}
        # The client sends both again, in order: both are written.
        again = await rig.send((P0, records("p", [1])), connection="a")
        assert again[P0] == PartitionAnswer(base_offset=2)
        again = await rig.send((P0, records("p", [2])), connection="a")
        assert again[P0] == PartitionAnswer(base_offset=3)
        assert rig.writer.log[P0] == [*in_order("p", [0]), ("q", 0), *in_order("p", [1, 2])]


async def test_a_retry_of_records_in_flight_holds_back_only_its_producers_requests() -> None:
    """Records re-sent while their first write is still under way are refused (retriable:
    in flight). The requests admitted behind them that name their producer are refused
    too, so none overtakes their retry; another producer's request goes on. Before, every
    request behind was refused, so a client re-sending too soon (or on purpose, again and
    again) made every other producer on the partition re-send."""
    async with running() as rig:
        await rig.send((P0, records("p", [0])))
        await rig.settle()
        before = refused_behind()
        in_flight = asyncio.Event()
        rig.writer.script.append(Step(hold=in_flight))
        first = await rig.admit((P0, records("p", [1, 2])))
        await asyncio.sleep(0.05)  # written, not yet acknowledged: pushed, not persisted
        resent = await rig.admit((P0, records("p", [1, 2])), connection="a")
        own_next = await rig.admit((P0, records("p", [3])), connection="b")
        other = await rig.admit((P0, records("q", [0])), connection="a")
        answer = (await asyncio.wait_for(resent, 5))[P0]
        assert retriable_not_written(answer) and "in flight" in str(answer.error_message)
        in_flight.set()
        answers = [(await asyncio.wait_for(t, 5))[P0] for t in (first, own_next, other)]
        assert answers[0] == PartitionAnswer(base_offset=1)
        assert retriable_not_written(answers[1])
        assert answers[2] == PartitionAnswer(base_offset=3)
        assert refused_behind() == {**before, "producers": before["producers"] + 1}
        await rig.settle()
        # The client sends both again, in order: the first reads as a duplicate now.
        again = await rig.send((P0, records("p", [1, 2])))
        assert again[P0] == PartitionAnswer(base_offset=1)
        assert (await rig.send((P0, records("p", [3]))))[P0] == PartitionAnswer(base_offset=4)
        assert rig.writer.log[P0] == [*in_order("p", [0, 1, 2]), ("q", 0), *in_order("p", [3])]


async def test_a_batch_that_cannot_be_read_on_no_known_connection_holds_back_every_request() -> (
    None
):
    async with running() as rig:
        await rig.send((P0, records("p", [0])))
        await rig.settle()
        before = refused_behind()
        bad = await rig.admit((P0, damaged(records("p", [1]))))
        behind = await rig.admit((P0, records("q", [0])), connection="b")
        assert (await asyncio.wait_for(bad, 5))[P0].error_code == ErrorCode.corrupt_message
        assert retriable_not_written((await asyncio.wait_for(behind, 5))[P0])
        assert refused_behind() == {**before, "partition": before["partition"] + 1}
        assert rig.writer.log[P0] == in_order("p", [0])


async def test_the_gap_rule_holds_for_explicit_identities_and_a_first_request() -> None:
    """The rule follows Kafka's numbering of the batches, not the identities read from
    them: a Kafka producer that sends explicit identities (`dedup.client.DedupProducer`) is
    held to it too, and so is one whose very first request was refused."""
    async with running() as rig:
        rig.writer.script.append(Step(outcome="failed"))
        first = await rig.send((P0, kafka_batch(0, 2, explicit="app")))
        assert retriable_not_written(first[P0])
        second = await rig.send((P0, kafka_batch(2, 2, explicit="app")))
        assert retriable_not_written(second[P0]) and "skips ahead of 0" in str(
            second[P0].error_message
        )
        assert rig.writer.log[P0] == []
        assert (await rig.send((P0, kafka_batch(0, 2, explicit="app"))))[P0].error_code == 0
        assert (await rig.send((P0, kafka_batch(2, 2, explicit="app"))))[P0].error_code == 0
        assert rig.writer.log[P0] == in_order("app", range(1000, 1004))


async def test_a_first_request_refused_before_the_lease_is_not_overtaken_by_the_next() -> None:
    """Seen in a group under load: a producer's first request to a new partition, refused
    before the owner held the lease (here: a broker that does not know the new topic yet),
    was not recorded, so its next request, arriving once the lease was held, was written
    ahead of the retry, whose records then read as duplicates: acknowledged, never written."""
    async with running() as rig:
        rig.owners.released.add(P0)  # the lease is taken by the partition's recovery
        rig.owners.absent.add(P0)
        first = await rig.send((P0, kafka_batch(0, 2, explicit="app")))
        assert first[P0].error_code == ErrorCode.unknown_topic_or_partition
        rig.owners.absent.discard(P0)
        rig.owners.released.discard(P0)
        second = await rig.send((P0, kafka_batch(2, 2, explicit="app")))  # sent meanwhile
        assert retriable_not_written(second[P0]) and "skips ahead of 0" in str(
            second[P0].error_message
        )
        assert (await rig.send((P0, kafka_batch(0, 2, explicit="app"))))[P0].error_code == 0
        assert (await rig.send((P0, kafka_batch(2, 2, explicit="app"))))[P0].error_code == 0
        assert rig.writer.log[P0] == in_order("app", range(1000, 1004))


async def test_a_refusal_before_the_lease_is_forgotten_if_another_instance_may_have_written() -> (
    None
):
    """Refused here before the lease, the batch may have been written by an instance that
    held the partition meanwhile: what follows it is then no gap here."""
    async with running() as rig:
        rig.owners.released.add(P0)
        rig.owners.absent.add(P0)
        first = await rig.send((P0, kafka_batch(0, 2, explicit="app")))
        assert first[P0].error_code == ErrorCode.unknown_topic_or_partition
        rig.owners.absent.discard(P0)
        rig.owners.released.discard(P0)
        rig.recovery.written_elsewhere.add(P0)
        assert (await rig.send((P0, kafka_batch(2, 2, explicit="app"))))[P0].error_code == 0


async def test_requests_redirected_to_another_owner_leave_no_expectation_behind() -> None:
    """While another instance owns the partition, its producers go on there: what this one
    refused (redirected) must not hold them back when it takes the partition again."""
    async with running() as rig:
        assert (await rig.send((P0, kafka_batch(0, 2))))[P0].error_code == 0
        rig.scheduler.forget(P0)  # the lease went to another instance
        rig.owners.released.add(P0)
        rig.owners.elsewhere[P0] = Redirect("other", Node(7002, Endpoint("other", 9092)), 3)
        redirected = await rig.send((P0, kafka_batch(2, 2)))
        assert redirected[P0].error_code == ErrorCode.not_leader_or_follower
        # The other owner wrote 2..499 (the log holds them); this one takes the partition
        # back, and knows the producer from the log alone.
        rig.writer.log[P0].extend(("kafka-pid-40-1", sequence) for sequence in range(2, 500))
        rig.owners.released.clear()
        del rig.owners.elsewhere[P0]
        assert (await rig.send((P0, kafka_batch(500, 2))))[P0].error_code == 0


async def test_a_batch_refused_for_good_leaves_no_gap_behind_it() -> None:
    """Refused for good (here Kafka's MESSAGE_TOO_LARGE), a batch is never sent again, so
    the producer's next batch is no gap; answered retry, it would be."""
    async with running() as rig:
        rig.writer.script.append(Step(outcome="failed", code=ErrorCode.message_too_large))
        refused = await rig.send((P0, kafka_batch(0, 2)))
        assert refused[P0].error_code == ErrorCode.message_too_large
        assert (await rig.send((P0, kafka_batch(2, 2))))[P0].error_code == 0
        assert rig.writer.log[P0] == in_order("kafka-pid-40-1", [2, 3])


async def test_a_kafka_producer_mixing_identities_is_never_refused_for_a_gap() -> None:
    """Kafka's sequence runs through every batch of the producer, whichever identity each
    record carries: batches with identity headers between implicit ones leave no hole."""
    async with running() as rig:
        for base, explicit in ((0, None), (2, "app"), (4, None), (6, "app"), (8, None)):
            answer = await rig.send((P0, kafka_batch(base, 2, explicit=explicit)))
            assert answer[P0].error_code == 0, (base, answer[P0])
        assert [p for p, _ in rig.writer.log[P0]] == ["kafka-pid-40-1"] * 2 + ["app"] * 2 + [
            "kafka-pid-40-1"
        ] * 2 + ["app"] * 2 + ["kafka-pid-40-1"] * 2


async def test_the_gap_rule_knows_what_this_owner_saw_and_then_what_the_log_says() -> None:
    """A producer met for the first time may start anywhere, as with Kafka; a new epoch is
    a new producer; after a handoff or loss (`forget`), producers are known from the log
    alone, as Kafka's new leader knows them from its replica."""
    async with running() as rig:
        assert (await rig.send((P0, kafka_batch(500, 2))))[P0].error_code == 0
        assert retriable_not_written((await rig.send((P0, kafka_batch(510, 2))))[P0])
        assert (await rig.send((P0, kafka_batch(9, 2, epoch=2))))[P0].error_code == 0
        rig.scheduler.forget(P0)  # the lease lost or handed over, then taken again
        # Meanwhile the other owner wrote 502..509: the log says the producer is at 509.
        rig.writer.log[P0].extend(("kafka-pid-40-1", sequence) for sequence in range(502, 510))
        await rig.settle()
        assert retriable_not_written((await rig.send((P0, kafka_batch(512, 2))))[P0])
        assert (await rig.send((P0, kafka_batch(510, 2))))[P0].error_code == 0
        assert (await rig.send((P0, kafka_batch(512, 2))))[P0].error_code == 0


async def test_a_fence_error_from_the_writer_leaves_the_partition_accepting_the_retry() -> None:
    """Before: the error escaped the engine with pushed raised and nothing in flight; no
    reset followed, so the retry read as UNKNOWN and was refused forever."""
    async with running() as rig:
        await rig.send((P0, records("p", [0])))
        rig.writer.script.append(Step(raises=FenceError("no transaction coordinator")))
        refused = await rig.send((P0, records("p", [1])))
        assert refused[P0].error_code == ErrorCode.not_enough_replicas
        retried = await rig.send((P0, records("p", [1])))
        assert retried[P0] == PartitionAnswer(base_offset=1)
        assert rig.writer.log[P0] == in_order("p", [0, 1])


@pytest.mark.parametrize(
    "step",
    [
        Step(raises=RuntimeError("a bug in the writer")),
        Step(raises=ValueError("a batch that does not build")),
        Step(lost=RuntimeError("the outcome was lost"), landed=False),
        Step(lost=RuntimeError("the outcome was lost"), landed=True),
        Step(outcome="unresolved", landed=False),
        Step(outcome="unresolved", landed=True),
    ],
    ids=[
        "raises",
        "raises-value-error",
        "lost",
        "lost-but-landed",
        "ambiguous",
        "ambiguous-landed",
    ],
)
async def test_any_writer_failure_is_answered_retriable_and_the_retry_is_written_once(
    step: Step,
) -> None:
    """Where the write's fate is unknown, the partition is recovered from the log, which
    tells whether the retry is new or a duplicate."""
    async with running() as rig:
        await rig.send((P0, records("p", [0])))
        rig.writer.script.append(step)
        refused = await rig.send((P0, records("p", [1, 2])))
        assert retriable_not_written(refused[P0])
        retried = await rig.send((P0, records("p", [1, 2])))
        assert ok(retried[P0])
        assert rig.writer.log[P0] == in_order("p", [0, 1, 2])
        recovered_again = len(rig.recovery.calls) > 1
        assert recovered_again == (step.lost is not None or step.outcome == "unresolved")


@pytest.mark.redis_check
@pytest.mark.parametrize("when", ["before", "after"])
async def test_redis_failing_the_check_refuses_and_the_retry_is_accepted_after_the_reset(
    when: str,
) -> None:
    async with running() as rig:
        await rig.send((P0, records("p", [0])))
        rig.state.fail_check = when  # the script did not run, or ran and the reply was lost
        refused = await rig.send((P0, records("p", [1])))
        assert refused[P0].error_code == ErrorCode.not_enough_replicas
        retried = await rig.send((P0, records("p", [1])))
        assert retried[P0] == PartitionAnswer(base_offset=1)


@pytest.mark.redis_check
async def test_a_check_that_reached_redis_after_its_caller_gave_up_does_not_block_the_retry() -> (
    None
):
    """A check timed out, the partition was reset, then the script ran (held in the
    network): pushed is above persisted with nothing in flight. The retry reads UNKNOWN
    once; it must not for ever."""
    async with running() as rig:
        await rig.send((P0, records("p", [0])))
        rig.state.fail_check = "late"
        refused = await rig.send((P0, records("p", [1, 2])))
        assert refused[P0].error_code == ErrorCode.not_enough_replicas
        await rig.settle()  # the reset after the failed check
        rig.state.run_late_checks()  # pushed[p] = 2 now, and nothing is on its way
        first_retry = await rig.send((P0, records("p", [1, 2])))
        assert retriable_not_written(first_retry[P0])
        await rig.settle()
        retried = await rig.send((P0, records("p", [1, 2])))
        assert retried[P0] == PartitionAnswer(base_offset=1)
        assert rig.writer.log[P0] == in_order("p", [0, 1, 2])


@pytest.mark.redis_check
async def test_state_lost_in_redis_recovers_the_partition_and_the_retry_is_accepted() -> None:
    async with running() as rig:
        await rig.send((P0, records("p", [0, 1])))
        await rig.settle()
        rig.state.forget(P0)
        lost = await rig.send((P0, records("p", [2])))
        assert lost[P0].error_code == ErrorCode.not_leader_or_follower
        resent = await rig.send((P0, records("p", [1, 2])))
        assert ok(resent[P0]) and resent[P0].base_offset == -1
        assert rig.writer.log[P0] == in_order("p", [0, 1, 2]), "1 read back from the log"


# ----------------------------------------------------------------------------- maps in memory


@pytest.mark.memory_check
async def test_with_the_maps_in_memory_no_check_goes_to_redis() -> None:
    async with running() as rig:
        rig.state.fail_check = "before"  # were the check in Redis, it would fail
        assert (await rig.send((P0, records("p", [0, 1]))))[P0] == PartitionAnswer(base_offset=0)
        again = await rig.send((P0, records("p", [1, 2])))
        assert ok(again[P0]) and again[P0].base_offset == 1, "1 is just before 2"
        assert rig.state.now_ms == [], "no check script ran"
        await rig.settle()
        assert rig.state.persisted[P0] == {"p": 2}, "Redis has the acknowledged copy"


@pytest.mark.memory_check
async def test_redis_losing_its_copy_recovers_the_partition_from_the_log() -> None:
    """Redis flushed: the maps here are still right, so the next request is written; the
    copy written behind finds the token gone, and the partition is recovered from the log,
    as with the maps in Redis."""
    async with running() as rig:
        await rig.send((P0, records("p", [0, 1])))
        await rig.settle()
        rig.state.forget(P0)
        assert (await rig.send((P0, records("p", [2]))))[P0] == PartitionAnswer(base_offset=2)
        await rig.settle()
        assert len(rig.recovery.calls) == 2, "first use, then the lost copy"
        resent = await rig.send((P0, records("p", [1, 2, 3])))
        assert ok(resent[P0]) and resent[P0].base_offset == -1
        assert rig.writer.log[P0] == in_order("p", [0, 1, 2, 3])


@pytest.mark.memory_check
async def test_disabling_dedup_drops_the_maps_and_enabling_it_recovers_from_the_log() -> None:
    """Records written while a topic's dedup is off go round the check; once it is on
    again the partition is recovered, so a re-send of them is a duplicate."""
    async with running() as rig:
        await rig.send((P0, records("p", [0])))
        assert rig.engine.partition_states()[P0].sequences is not None
        rig.policies.policies = PolicySnapshot(Mode.ENABLED, topics={P0[0]: Mode.DISABLED})
        assert await rig.engine.admit(produce_request((P0, records("p", [1])))) is None
        assert rig.engine.partition_states()[P0].sequences is None
        rig.writer.log[P0].append(("p", 1))  # written straight to Kafka meanwhile
        rig.policies.policies = PolicySnapshot(Mode.ENABLED)
        again = await rig.send((P0, records("p", [1, 2])))
        assert ok(again[P0]) and again[P0].base_offset == -1
        assert rig.writer.log[P0] == in_order("p", [0, 1, 2])
        assert rig.recovery.calls == [[P0], [P0]]


@pytest.mark.memory_check
async def test_a_lease_not_renewed_in_time_stops_the_check_until_it_is_renewed() -> None:
    """Past the lease's time another instance may have taken the partition: the maps here
    no longer answer (a producer reset made there would not be seen)."""
    async with running() as rig:
        assert ok((await rig.send((P0, records("p", [0]))))[P0])
        rig.owners.lapsed.add(P0)
        refused = await rig.send((P0, records("p", [1])))
        assert refused[P0].error_code == ErrorCode.not_enough_replicas
        assert "lease" in (refused[P0].error_message or "")
        rig.owners.lapsed.clear()  # renewed
        assert (await rig.send((P0, records("p", [1]))))[P0] == PartitionAnswer(base_offset=1)
        assert rig.writer.log[P0] == in_order("p", [0, 1])


@pytest.mark.memory_check
async def test_a_partition_whose_lease_is_no_longer_held_is_taken_again_by_a_recovery() -> None:
    """Before: a lease dropped while its partition was being recovered left the partition
    recovered with no lease, refused for ever."""
    async with running() as rig:
        assert ok((await rig.send((P0, records("p", [0]))))[P0])
        rig.owners.released.add(P0)
        refused = await rig.send((P0, records("p", [1])))
        assert refused[P0].error_code == ErrorCode.not_leader_or_follower
        rig.owners.released.clear()  # the recovery took it again
        await rig.settle()
        assert (await rig.send((P0, records("p", [1]))))[P0] == PartitionAnswer(base_offset=1)
        assert rig.recovery.calls == [[P0], [P0]]


@pytest.mark.memory_check
async def test_the_lease_is_asked_again_after_every_partition_of_the_request_passed_its_gate() -> (
    None
):
    """A request's other partition waits at its gate (a first use): meanwhile the first
    partition's lease lapses, so it is not checked when the request's turn comes."""
    async with running() as rig:
        assert ok((await rig.send((P0, records("p", [0]))))[P0])
        rig.recovery.hold = replaying = asyncio.Event()  # P1's first use waits
        both = await rig.admit((P0, records("p", [1])), (P1, records("q", [0])))
        await asyncio.sleep(0.05)
        rig.owners.lapsed.add(P0)
        replaying.set()
        answers = await asyncio.wait_for(both, 5)
        assert answers[P0].error_code == ErrorCode.not_enough_replicas
        assert answers[P1] == PartitionAnswer(base_offset=0)
        assert rig.writer.log[P0] == in_order("p", [0])


@pytest.mark.memory_check
async def test_producers_evicted_from_the_maps_are_forgotten_in_redis_too() -> None:
    async with running(max_producers=2) as rig:
        for producer in ("a", "b", "c"):
            assert ok((await rig.send((P0, records(producer, [0]))))[P0])
            await rig.settle()
        sequences = rig.engine.partition_states()[P0].sequences
        assert sequences is not None and sorted(sequences.producers()) == ["b", "c"]
        assert rig.state.forgotten == [(P0, ["a"])]
        assert "a" not in rig.state.persisted[P0]


# ----------------------------------------------------------------------------- one request


@pytest.mark.parametrize("same_topic_entry", [True, False], ids=["one-entry", "topic-twice"])
async def test_a_partition_named_twice_keeps_its_last_data_like_kafka_and_never_hangs(
    same_topic_entry: bool,
) -> None:
    """Kafka's broker keeps one entry per partition, the last (KafkaApis'
    handleProduceRequest), and answers it; before, the request waited on its own place in
    line forever, and so did every later request for that partition."""
    async with running() as rig:
        first, last, other = (
            (P0, records("p", [0])),
            (P0, records("p", [1])),
            (Q0, records("q", [0])),
        )
        if same_topic_entry:
            request = produce_request(first, last, other)
        else:  # the topic listed twice, each entry naming partition 0
            request = produce_request(first, other, last)
        assert len(request.topic_data) == (2 if same_topic_entry else 3)
        admission = await rig.engine.admit(request)
        assert admission is not None
        answers = await asyncio.wait_for(rig.engine.produce(request, admission, BROKER), 5)
        assert answers == {P0: PartitionAnswer(base_offset=0), Q0: PartitionAnswer(base_offset=0)}
        assert rig.writer.log[P0] == in_order("p", [1])
        # The client gets one entry per partition and per topic, as from Kafka.
        response: Any = produce_response(9, answers, request)
        entries = [
            (str(t.name), int(p.index)) for t in response.responses for p in t.partition_responses
        ]
        assert sorted(entries) == sorted([P0, Q0])
        later = await rig.send((P0, records("p", [2])))
        assert later[P0] == PartitionAnswer(base_offset=1)


# ----------------------------------------------------------------------------- recovery


async def test_a_partition_whose_recovery_fails_is_retried_while_the_others_open() -> None:
    async with running() as rig:
        rig.recovery.failing[P1] = 3
        both = await rig.admit((P0, records("p", [0])), (P1, records("q", [0])))
        other = await rig.send((("other", 0), records("r", [0])))
        assert other[("other", 0)] == PartitionAnswer(base_offset=0)
        answers = await asyncio.wait_for(both, 5)
        assert answers[P0] == PartitionAnswer(base_offset=0)
        assert answers[P1] == PartitionAnswer(base_offset=0), "retried until it recovered"
        assert sum(P1 in call for call in rig.recovery.calls) == 4


async def test_a_partition_whose_recovery_keeps_failing_is_reported_with_its_error() -> None:
    async with running(retry_s=(0.05, 0.05)) as rig:
        rig.recovery.failing[P1] = 1_000
        refused = await rig.send((P1, records("q", [0])))
        assert retriable_not_written(refused[P1])
        assert ok((await rig.send((P0, records("p", [0]))))[P0]), "the other one opens"
        failing = rig.scheduler.failing()
        assert list(failing) == [P1]
        assert failing[P1]["failures"] >= 1 and failing[P1]["last_error"]
        rig.recovery.failing[P1] = 0
        assert ok((await rig.send((P1, records("q", [0]))))[P1])
        assert rig.scheduler.failing() == {}


async def test_one_partition_failing_its_whole_recovery_batch_does_not_starve_the_rest() -> None:
    """Before: after the batch failed, the bad partition (first in the queue) was retried
    alone, again and again; the others were never tried."""
    async with running() as rig:
        bad = ("deleted", 0)
        rig.recovery.unfenceable.add(bad)
        rig.engine.request_recovery([bad, P0, P1], "proxy start")
        assert await rig.engine.wait_recovered([P0, P1], 3)
        assert not rig.scheduler.partitions.of(bad).recovered
        rig.recovery.unfenceable.clear()
        assert await rig.engine.wait_recovered([bad], 3), "and it is still retried"


async def test_a_partition_first_used_while_another_backs_off_is_recovered_at_once() -> None:
    """Before: the retry pause of a failing partition held back every recovery queued
    after it; a first use during a long pause was answered 'retry' after the wait."""
    async with running(retry_s=(30.0, 30.0), first_use_wait_s=2.0) as rig:
        bad = ("deleted", 0)
        rig.recovery.failing[bad] = 1_000
        rig.engine.request_recovery([bad], "proxy start")
        await asyncio.sleep(0.1)  # failed once, now in a 30 s pause
        loop = asyncio.get_running_loop()
        started = loop.time()
        answers = await rig.send((P0, records("p", [0])))
        assert answers[P0] == PartitionAnswer(base_offset=0)
        assert loop.time() - started < 1.0


async def test_first_use_waits_in_line_for_the_recovery_then_writes_in_order() -> None:
    async with running(first_use_wait_s=2.0) as rig:
        replaying = asyncio.Event()
        rig.recovery.hold = replaying
        first = await rig.admit((P0, records("p", [0])))
        second = await rig.admit((P0, records("p", [1])))
        await asyncio.sleep(0.2)
        assert rig.state.checked == []
        replaying.set()
        assert [(await t)[P0].base_offset for t in (first, second)] == [0, 1]


async def test_first_use_wait_running_out_tells_the_request_and_those_behind_it_to_retry() -> None:
    async with running(first_use_wait_s=0.1) as rig:
        replaying = asyncio.Event()
        rig.recovery.hold = replaying
        first = await rig.admit((P0, records("p", [0])))
        second = await rig.admit((P0, records("p", [1])))
        answers = [await asyncio.wait_for(t, 5) for t in (first, second)]
        assert answers[0][P0].error_code == ErrorCode.not_leader_or_follower
        assert retriable_not_written(answers[1][P0]), "behind a refused one: refused too"
        assert rig.state.checked == [] and rig.writer.log[P0] == []
        replaying.set()
        assert (await rig.send((P0, records("p", [0]))))[P0] == PartitionAnswer(base_offset=0)
        assert (await rig.send((P0, records("p", [1]))))[P0] == PartitionAnswer(base_offset=1)


# -------------------------------------------------------------------------- a topic created again


def recreate(rig: Rig, topic: str) -> None:
    """The topic deleted and created again under its name: a new id, an empty log."""
    rig.topic_ids.recreate(topic)
    for key in [key for key in rig.writer.log if key[0] == topic]:
        rig.writer.log[key] = []


async def test_a_topic_created_again_takes_its_records_instead_of_reading_them_as_old() -> None:
    """Before: the state of the deleted topic dropped the new topic's records as its
    duplicates, answered success, and nothing was written."""
    async with running() as rig:
        assert ok((await rig.send((P0, records("p", [0, 1, 2]))))[P0])
        recreate(rig, P0[0])
        refused = await rig.send((P0, records("p", [0, 1, 2])))
        assert refused[P0].error_code == ErrorCode.not_leader_or_follower
        assert rig.writer.log[P0] == [], "nothing dropped, nothing written"
        again = await rig.send((P0, records("p", [0, 1, 2])))
        assert again[P0] == PartitionAnswer(base_offset=0)
        assert rig.writer.log[P0] == in_order("p", [0, 1, 2])
        assert rig.recovery.calls == [[P0], [P0]], "rebuilt from the new topic's log"


async def test_the_topic_id_is_asked_of_the_leader_only_when_records_are_dropped() -> None:
    async with running() as rig:
        assert ok((await rig.send((P0, records("p", [0, 1]))))[P0])
        assert ok((await rig.send((P0, records("p", [2]))))[P0])
        assert rig.topic_ids.engine_asked() == [], "nothing dropped: nothing asked"
        dup = await rig.send((P0, records("p", [1, 2, 3])))
        assert dup[P0] == PartitionAnswer(base_offset=1), "the same topic: dropped as before"
        assert rig.topic_ids.asked[-1] == (P0[0], BROKER)
        assert rig.writer.log[P0] == in_order("p", [0, 1, 2, 3])


async def test_requests_behind_one_refused_for_a_topic_created_again_are_refused_too() -> None:
    """The request behind holds new sequences of the old state: written ahead of the
    retry, they would make the retry's records read as old in the new topic."""
    async with running() as rig:
        assert ok((await rig.send((P0, records("p", [0, 1, 2]))))[P0])
        asking = rig.topic_ids.hold = asyncio.Event()
        first = await rig.admit((P0, records("p", [0, 1, 2])))
        second = await rig.admit((P0, records("p", [3, 4])))
        await asyncio.sleep(0.1)
        recreate(rig, P0[0])
        asking.set()
        answers = [await asyncio.wait_for(task, 5) for task in (first, second)]
        assert all(retriable_not_written(a[P0]) for a in answers), answers
        assert rig.writer.log[P0] == []
        assert ok((await rig.send((P0, records("p", [0, 1, 2]))))[P0])
        assert ok((await rig.send((P0, records("p", [3, 4]))))[P0])
        assert rig.writer.log[P0] == in_order("p", [0, 1, 2, 3, 4])


async def test_a_topic_id_that_cannot_be_confirmed_refuses_and_undoes_the_check() -> None:
    async with running() as rig:
        assert ok((await rig.send((P0, records("p", [0, 1, 2]))))[P0])
        rig.topic_ids.failure = TimeoutError()
        refused = await rig.send((P0, records("p", [2, 3])))
        assert refused[P0].error_code == ErrorCode.not_enough_replicas
        assert rig.writer.log[P0] == in_order("p", [0, 1, 2])
        rig.topic_ids.failure = None
        await rig.settle()
        accepted = await rig.send((P0, records("p", [2, 3])))
        assert accepted[P0] == PartitionAnswer(base_offset=2), "3 is new again: pushed undone"
        assert rig.writer.log[P0] == in_order("p", [0, 1, 2, 3])
        assert rig.recovery.calls == [[P0]], "the state itself was not in doubt"


async def test_a_state_read_after_the_topic_was_created_again_is_of_the_new_topic() -> None:
    """A producer resumes from its last sequence id: read of the old topic, it would skip
    the new topic's first records."""
    async with running() as rig:
        assert ok((await rig.send((P0, records("p", [0, 1, 2]))))[P0])
        assert await rig.engine.ensure_recovered([P0], 2)
        assert rig.recovery.calls == [[P0]], "the same topic: nothing to do"
        recreate(rig, P0[0])
        assert await rig.engine.ensure_recovered([P0], 2)
        assert rig.recovery.calls == [[P0], [P0]]
        state = rig.engine.partition_states()[P0]
        assert state.topic_id == rig.topic_ids.ids[P0[0]]
        assert (await rig.send((P0, records("p", [0]))))[P0] == PartitionAnswer(base_offset=0)


async def test_the_owner_finds_a_topic_created_again_without_any_request() -> None:
    """The service's watch (`confirm_topics`, every topic_id_check_s): an idle partition's
    state, and Redis's copy other instances read, become the new topic's."""
    async with running() as rig:
        assert ok((await rig.send((P0, records("p", [0, 1, 2]))))[P0])
        assert ok((await rig.send((("other", 0), records("p", [0]))))[("other", 0)])
        await rig.engine.confirm_topics()
        assert rig.recovery.calls == [[P0], [("other", 0)]], "the same topics: nothing to do"
        rig.topic_ids.ids["other"] = None  # deleted, not created again: left as it is
        recreate(rig, P0[0])
        await rig.engine.confirm_topics()
        assert await rig.engine.wait_recovered([P0], 2)
        assert rig.recovery.calls[2:] == [[P0]]
        assert rig.engine.partition_states()[P0].topic_id == rig.topic_ids.ids[P0[0]]


async def test_a_partition_kafka_does_not_have_is_answered_unknown_without_a_recovery() -> None:
    """Before, it took a lease and a recovery that failed and was retried for ever."""
    async with running() as rig:
        rig.owners.absent.add(P1)
        answers = await rig.send((P0, records("p", [0])), (P1, records("p", [0])))
        assert ok(answers[P0])
        assert answers[P1].error_code == ErrorCode.unknown_topic_or_partition
        assert answers[P1].error_message == "topic orders has no partition 1"
        assert [key for run in rig.recovery.calls for key in run] == [P0], "P1 never recovered"
        assert not rig.scheduler.recovering(P1)
        rig.owners.absent.clear()  # created since (or a lagging broker caught up)
        assert ok((await rig.send((P1, records("p", [0]))))[P1])


async def test_a_requests_partitions_met_for_the_first_time_are_recovered_together() -> None:
    """Not one after another at each partition's gate: a producer's first request to a
    topic of many partitions would wait for as many recoveries in a row."""
    keys = [("orders", p) for p in range(6)]
    async with running() as rig:
        answers = await rig.send(*((key, records("p", [0])) for key in keys))
        assert all(ok(answers[key]) for key in keys)
        assert [sorted(run) for run in rig.recovery.calls] == [keys], "one recovery run"


async def test_a_topics_first_used_partitions_are_looked_up_all_at_once() -> None:
    """A topic's lookups share one Metadata request (`UpstreamCluster.partition_leader`):
    only the number of topics looked up at once is bounded, not of partitions."""
    keys = [("orders", p) for p in range(3 * FIRST_USE_LOOKUPS)]
    async with running() as rig:
        answers = await rig.send(*((key, records("p", [0])) for key in keys))
        assert all(ok(answers[key]) for key in keys)
        assert rig.owners.most_at_once == len(keys)


async def test_only_the_latest_partitions_kafka_does_not_have_keep_a_state() -> None:
    """A client naming partitions that do not exist cannot grow the proxy without bound:
    the states of the oldest go, the latest keep their place in line."""
    ghosts = [("ghosts", p) for p in range(7)]
    async with running(max_absent_partitions=3) as rig:
        rig.owners.absent.update(ghosts)
        for ghost in ghosts:
            answer = (await rig.send((ghost, records("p", [0]))))[ghost]
            assert answer.error_code == ErrorCode.unknown_topic_or_partition
        assert ok((await rig.send((P0, records("p", [0]))))[P0])
        kept = set(rig.engine.partition_states())
        assert kept == {P0, *ghosts[-3:]}, "the three latest and the real partition"
        again = (await rig.send((ghosts[0], records("p", [0]))))[ghosts[0]]
        assert again.error_code == ErrorCode.unknown_topic_or_partition
        assert set(rig.engine.partition_states()) == {P0, *ghosts[-2:], ghosts[0]}


async def test_a_partition_kafka_does_not_have_keeps_its_state_while_a_request_is_on_it() -> None:
    """Let go while its request was still finishing (its turn over, waiting on the write of
    another partition), a state would be made anew behind it, numbered afresh."""
    ghosts = [("ghosts", p) for p in range(4)]
    async with running(max_absent_partitions=1) as rig:
        rig.owners.absent.update(ghosts)
        assert ok((await rig.send((P0, records("p", [0]))))[P0])
        held = asyncio.Event()
        rig.writer.script.append(Step(hold=held))
        first = await rig.admit((ghosts[0], records("g", [0])), (P0, records("p", [1])))
        await asyncio.sleep(0.05)  # refused, its turn over; P0's write held
        for ghost in ghosts[1:]:
            assert not ok((await rig.send((ghost, records("g", [0]))))[ghost])
        state = rig.engine.partition_states()[ghosts[0]]
        held.set()
        answers = await first
        assert answers[ghosts[0]].error_code == ErrorCode.unknown_topic_or_partition
        assert ok(answers[P0])
        assert rig.engine.partition_states().get(ghosts[0]) is state, "the same state"
        assert (state.admitted, state.released) == (1, 1)
        assert ok((await rig.send((P0, records("p", [2]))))[P0])
        assert not ok((await rig.send((ghosts[3], records("g", [0]))))[ghosts[3]])
        assert ghosts[0] not in rig.engine.partition_states(), "let go once it was done"


async def test_a_deleted_topic_is_answered_unknown_and_rebuilt_once_it_is_back() -> None:
    async with running(retry_s=(0.01, 0.01)) as rig:
        assert ok((await rig.send((P0, records("p", [0, 1, 2]))))[P0])
        rig.topic_ids.ids[P0[0]] = None
        rig.writer.log[P0] = []
        gone = await rig.send((P0, records("p", [2])))
        assert gone[P0].error_code == ErrorCode.unknown_topic_or_partition
        rig.topic_ids.recreate(P0[0])
        back = await rig.send((P0, records("p", [0])))
        assert back[P0] == PartitionAnswer(base_offset=0)
        assert rig.writer.log[P0] == in_order("p", [0])


def counted(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


async def test_a_deleted_topics_partition_is_let_go_by_the_topic_watch() -> None:
    """The topic watch (`confirm_topics`) finds the topic of a partition held here deleted:
    the partition's lease is given up, once, and nothing is recovered or retried for it.
    Created again, the topic's first use takes the partition anew, from its new log."""
    async with running() as rig:
        assert ok((await rig.send((P0, records("p", [0, 1]))))[P0])
        before = counted("dedup_topic_deleted_total")
        rig.topic_ids.ids[P0[0]] = None
        rig.owners.absent.add(P0)  # as Kafka's metadata says too
        rig.writer.log[P0] = []
        runs = len(rig.recovery.calls)
        await rig.engine.confirm_topics()
        await rig.engine.confirm_topics()  # the next pass: given up already
        assert rig.owners.let_go_of == [P0]
        assert counted("dedup_topic_deleted_total") == before + 1
        assert len(rig.engine._recent) == 0, "the offsets of a log that is gone are kept"
        assert not rig.engine.partition_states()[P0].recovered
        await asyncio.sleep(0.1)
        assert len(rig.recovery.calls) == runs and rig.scheduler.failing() == {}
        gone = await rig.send((P0, records("p", [2])))
        assert gone[P0].error_code == ErrorCode.unknown_topic_or_partition
        rig.topic_ids.recreate(P0[0])
        rig.owners.absent.clear()
        rig.owners.released.clear()  # its recovery takes the lease again
        back = await rig.send((P0, records("p", [0])))
        assert back[P0] == PartitionAnswer(base_offset=0)
        assert rig.writer.log[P0] == in_order("p", [0])


async def test_a_deleted_topics_partition_leaves_the_writer_once_it_is_among_the_oldest() -> None:
    """A partition written here and let go (its topic deleted) is remembered as absent;
    once newer absent ones push it out, the writer forgets it too, and nothing written
    is forgotten: a topic deleted after another cannot grow the proxy without bound."""
    ghosts = [("ghosts", p) for p in range(2)]
    other: Key = ("payments", 0)
    async with running(max_absent_partitions=2) as rig:
        assert ok((await rig.send((P0, records("p", [0, 1]))))[P0])
        assert ok((await rig.send((other, records("q", [0]))))[other])
        rig.topic_ids.ids[P0[0]] = None
        rig.owners.absent.add(P0)
        await rig.engine.confirm_topics()
        assert rig.owners.let_go_of == [P0]
        rig.owners.absent.update(ghosts)
        assert not ok((await rig.send((ghosts[0], records("g", [0]))))[ghosts[0]])
        assert rig.writer.forgotten == [], "two absent partitions are kept"
        assert not ok((await rig.send((ghosts[1], records("g", [0]))))[ghosts[1]])
        assert rig.writer.forgotten == [P0]
        assert P0 not in rig.engine.partition_states()
        assert ok((await rig.send((other, records("q", [1]))))[other]), "the others write on"
        assert rig.writer.log[other] == in_order("q", [0, 1])


async def test_a_partition_whose_write_is_unresolved_leaves_the_writer_later() -> None:
    """The writer keeps a partition while a write of it is unresolved (`forget` says no):
    the partition stays among the absent ones and is offered again as newer ones push it
    out, until the writer lets go of it."""
    ghosts = [("ghosts", p) for p in range(6)]
    async with running(max_absent_partitions=2) as rig:
        assert ok((await rig.send((P0, records("p", [0, 1]))))[P0])
        rig.topic_ids.ids[P0[0]] = None
        rig.owners.absent.add(P0)
        await rig.engine.confirm_topics()
        rig.owners.absent.update(ghosts)
        rig.writer.unresolved.add(P0)
        for ghost in ghosts[:2]:
            assert not ok((await rig.send((ghost, records("g", [0]))))[ghost])
        assert rig.writer.forgotten == [], "P0 is kept while its write is unresolved"
        rig.writer.unresolved.clear()
        for ghost in ghosts[2:]:
            assert not ok((await rig.send((ghost, records("g", [0]))))[ghost])
        assert P0 in rig.writer.forgotten, "offered again, and let go"
        assert P0 not in rig.engine.partition_states()


async def test_the_recovery_of_a_deleted_topics_partition_is_not_retried() -> None:
    """A request finds the topic deleted: the partition's recovery fails for that reason
    and is not tried again (before, every 30 s for as long as the proxy ran), and its lease
    is given up at once, not at the topic watch's next look; the topic's next use, once
    created again, recovers it."""
    async with running(retry_s=(0.01, 0.01)) as rig:
        assert ok((await rig.send((P0, records("p", [0, 1, 2]))))[P0])
        before = counted("dedup_recoveries_total", {"result": "topic_deleted"})
        deleted_before = counted("dedup_topic_deleted_total")
        rig.topic_ids.ids[P0[0]] = None
        gone = await rig.send((P0, records("p", [2])))
        assert gone[P0].error_code == ErrorCode.unknown_topic_or_partition
        await asyncio.sleep(0.05)
        runs = len(rig.recovery.calls)
        await asyncio.sleep(0.2)  # 20 retry pauses
        assert len(rig.recovery.calls) == runs
        assert rig.scheduler.failing() == {} and not rig.scheduler.recovering(P0)
        assert counted("dedup_recoveries_total", {"result": "topic_deleted"}) == before + 1
        assert rig.owners.let_go_of == [P0]
        assert counted("dedup_topic_deleted_total") == deleted_before + 1


# ----------------------------------------------------------------------------- a property

FAULTS = [
    "none",
    "write-failed",
    "fence-error",
    "writer-raises",
    "ambiguous",
    "ambiguous-landed",
    "outcome-lost",
    "outcome-lost-landed",
    "redis-before",
    "redis-after",
    "state-flushed",
]


def _inject(rig: Rig, fault: str) -> None:
    steps = {
        "write-failed": Step(outcome="failed"),
        "fence-error": Step(raises=FenceError("fence timed out")),
        "writer-raises": Step(raises=RuntimeError("bug")),
        "ambiguous": Step(outcome="unresolved"),
        "ambiguous-landed": Step(outcome="unresolved", landed=True),
        "outcome-lost": Step(lost=RuntimeError("lost")),
        "outcome-lost-landed": Step(lost=RuntimeError("lost"), landed=True),
    }
    if fault in steps:
        rig.writer.script.append(steps[fault])
    elif fault.startswith("redis-"):
        rig.state.fail_check = fault.removeprefix("redis-")
    elif fault == "state-flushed":
        rig.state.forget(P0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=6),
    faults=st.lists(st.sampled_from(FAULTS), max_size=10),
)
def test_a_producer_retrying_through_any_failures_gets_each_record_in_the_log_once_in_order(
    sizes: list[int], faults: list[str]
) -> None:
    """One producer sends its batches one at a time and retries each until it is
    acknowledged; whatever fails on the way, the log ends up with every record exactly
    once, in order."""

    async def scenario() -> None:
        async with running(first_use_wait_s=1.0) as rig:
            pending = deque(faults)
            start = 0
            for size in sizes:
                sequences = list(range(start, start + size))
                start += size
                for _attempt in range(50):
                    if pending:
                        _inject(rig, pending.popleft())
                    answers = await rig.send((P0, records("p", sequences)))
                    if ok(answers[P0]):
                        break
                    assert retriable_not_written(answers[P0]), answers[P0]
                    await asyncio.sleep(0.01)
                else:
                    pytest.fail(f"sequences {sequences} never acknowledged")
            assert rig.writer.log[P0] == in_order("p", range(start))

    asyncio.run(scenario())


# ----------------------------------------------------------------------------- ownership


async def test_a_partition_another_instance_should_own_is_redirected_there_unwritten() -> None:
    async with running() as rig:
        owner = Redirect("b", Node(2001, Endpoint("b-host", 9193)), 5)
        rig.owners.elsewhere[P0] = owner
        answer = (await rig.send((P0, records("p", [0]))))[P0]
        assert answer.error_code == ErrorCode.not_leader_or_follower
        assert answer.redirect == owner
        assert rig.writer.log[P0] == [] and rig.recovery.calls == [], "neither taken nor written"
        del rig.owners.elsewhere[P0]  # the owner moved here
        assert ok((await rig.send((P0, records("p", [0]))))[P0])
        assert rig.writer.log[P0] == in_order("p", [0])


async def test_a_partition_whose_lease_another_holds_goes_to_the_holder_then_here() -> None:
    async with running() as rig:
        rig.recovery.held[P0] = "a"
        answer = (await rig.send((P0, records("p", [0]))))[P0]
        assert answer.error_code == ErrorCode.not_leader_or_follower
        assert answer.redirect is not None and answer.redirect.owner == "a"
        again = (await rig.send((P0, records("p", [0]))))[P0]
        assert again.redirect is not None, "the holder is believed a moment, not asked again"
        assert rig.recovery.calls == [[P0]]
        del rig.recovery.held[P0]  # released
        await asyncio.sleep(1.1)
        assert ok((await rig.send((P0, records("p", [0]))))[P0])
        assert rig.writer.log[P0] == in_order("p", [0])
        assert rig.recovery.calls == [[P0], [P0]]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(-(2**63), 2**63 - 1)),
        min_size=1,
        max_size=12,
        unique=True,
    )
)
def test_what_is_recorded_acknowledged_is_each_producers_highest_sequence_written(
    parts: list[tuple[str, int]],
) -> None:
    """Records in any order, of several producers: all new, so all written (the usual
    case, taken without a look at each record), or some duplicates of an earlier batch."""

    async def scenario() -> None:
        async with running() as rig:
            earlier = parts[: len(parts) // 3]
            if earlier:
                assert ok((await rig.send((P0, mixed(earlier))))[P0])
                await rig.settle()  # acknowledged and recorded: a re-send is a duplicate
            assert ok((await rig.send((P0, mixed(parts))))[P0])
            await rig.settle()
            expected: dict[str, int] = {}
            for producer, sequence in parts:
                expected[producer] = max(sequence, expected.get(producer, sequence))
            assert rig.state.persisted[P0] == expected

    asyncio.run(scenario())


async def test_a_handoff_during_the_recovery_waits_for_it_then_settles_clean() -> None:
    """As in a rolling restart: a partition taken a moment ago moves on before its
    recovery is done. Before: the handoff was unclean at once, and the next owner fenced."""
    async with running() as rig:
        replaying = asyncio.Event()
        rig.recovery.hold = replaying
        rig.engine.request_recovery([P0], "first use")
        handoff = asyncio.create_task(rig.engine.settle_for_handoff(P0, 5))
        await asyncio.sleep(0.2)
        assert not handoff.done()
        replaying.set()
        assert await asyncio.wait_for(handoff, 5) is True


async def test_a_handoff_is_unclean_when_the_recovery_does_not_finish_in_time() -> None:
    async with running() as rig:
        rig.recovery.hold = asyncio.Event()
        rig.engine.request_recovery([P0], "first use")
        assert await rig.engine.settle_for_handoff(P0, 0.2) is False
        assert await rig.engine.settle_for_handoff(("never-seen", 0), 5) is False


async def test_a_handoff_settles_the_writes_in_flight_first() -> None:
    async with running() as rig:
        assert ok((await rig.send((P0, records("p", [0]))))[P0])
        gate = asyncio.Event()
        rig.writer.script.append(Step(hold=gate))
        in_flight = await rig.admit((P0, records("p", [1])))
        await asyncio.sleep(0.1)
        handoff = asyncio.create_task(rig.engine.settle_for_handoff(P0, 5))
        await asyncio.sleep(0.2)
        assert not handoff.done(), "a write admitted before the handoff is still in flight"
        gate.set()
        assert ok((await in_flight)[P0])
        assert await asyncio.wait_for(handoff, 5) is True


def test_a_redirect_reaches_the_client_as_kip_951_leader_and_endpoint() -> None:
    owner = Redirect("b", Node(2001, Endpoint("b-host", 9193)), 5)
    answers = {P0: PartitionAnswer(ErrorCode.not_leader_or_follower, redirect=owner)}
    response: Any = produce_response(10, answers, produce_request((P0, records("p", [0]))))
    (part,) = response.responses[0].partition_responses
    assert (int(part.current_leader.leader_id), int(part.current_leader.leader_epoch)) == (2001, 5)
    (endpoint,) = response.node_endpoints
    assert (int(endpoint.node_id), endpoint.host, int(endpoint.port)) == (2001, "b-host", 9193)
    older: Any = produce_response(9, answers, produce_request((P0, records("p", [0]))))
    assert int(older.responses[0].partition_responses[0].error_code) == 6
