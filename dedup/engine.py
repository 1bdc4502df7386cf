"""The produce path with deduplication: the whole algorithm in one place.

For one client Produce request:

1. A transactional request, or one whose topics all have dedup disabled, is not touched:
   the caller forwards it to Kafka as it is (a transactional one from an authenticated
   client once the producer names it carries are checked against their principals: a
   committed one counts at a recovery). Every other request takes its place in line on
   each of its partitions as it arrives; on a partition, requests are checked and written in
   that order, so a later one never reaches the log ahead of an earlier one.
2. Each partition's batches are read (`dedup.batches`): identity per record, bad input
   refused for that partition only. A partition named twice in one request keeps only its
   last data, as Kafka's broker does.
3. Every partition is checked: per record NOT_DUP (forward), DUP (drop), UNKNOWN (refuse
   the partition batch, nothing written, retriable). Implicit sequences are counted on
   past Kafka's wrap at 2^31 first (`dedup.implicit_wraps`); records are dropped only once
   Kafka confirms the topic is the one the state was rebuilt from (`dedup.topic_ids`).
   The owner keeps the maps in memory (`dedup.sequences`, `dedup.local_check`: the check
   costs no round trip), or with ``check_state = "redis"`` one Redis round trip checks
   every partition (`dedup.state`),
   checks queued while one is on its way sharing the next (`dedup.group_check`). Checks run
   in the order of the line; their verdicts are judged in it too.
4. The kept records are rebuilt as one batch per partition and written by the proxy's own
   idempotent producer (`dedup.writer`): written exactly once, or definitely not.
5. Written: ``persisted`` rises. Not written: once the partition's writes in flight have
   settled, ``pushed`` is reset to ``persisted`` so the client's retry is accepted again;
   requests for that partition wait meanwhile. A request not written for a reason the
   client retries also refuses (retriable, nothing written) every request admitted on that
   partition before its answer went out: the client sent those without knowing, and
   written they would overtake its retry, whose records would then read as old duplicates.
6. The client gets one answer per partition. A batch dropped whole is answered, as Kafka
   answers a duplicate batch, with the offset the original got where the partition's
   latest appends say (`dedup.recent_appends`: written here, read by the recovery, or
   carried by its snapshot), one partly dropped with its first record's offset where its
   records are in a row in the log; else -1, only where no base offset is right (a client
   built on librdkafka, which numbers a batch's reports from the base, is answered minus
   the record count instead: `dedup.produce_filter`). An unexpected
   failure is answered too: retriable, and the partition is left accepting the retry
   (reset, or recovered when a write's fate is lost).

Before a partition's first check in this process, and whenever its state cannot be
trusted (Redis lost it, a write stayed ambiguous, an operator asked), the partition is
recovered from the log (`dedup.recovery`, queued by `dedup.recovery_scheduler`): fence,
snapshot, replay. A request for a partition being recovered waits for it in its place in
line, up to FIRST_USE_WAIT_S; if the recovery has not finished by then the request is
answered NOT_LEADER_OR_FOLLOWER (nothing written), which every client retries after
refreshing metadata.

Everything the engine talks to is a small Protocol (`dedup.ports`) given by the composition
root (`dedup.service`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

import structlog
from kio.schema.errors import ErrorCode
from redis.exceptions import RedisError

from dedup import metrics
from dedup.batches import (
    BadBatch,
    BatchRun,
    IdentityHeaders,
    IncomingBatch,
    IncomingRecord,
    MadeAhead,
    ReadLimits,
    build_batch,
    forwardable,
    made_ahead,
    read_batches,
    restamped,
    rewritten_with_identity_headers,
)
from dedup.bindings import ProducerBindings
from dedup.chunks import ChunkMeta, ChunkProgress
from dedup.group_check import GroupCheck
from dedup.local_check import LocalCheck
from dedup.ownership.owner import Redirect, leaders_by_topic
from dedup.partitions import Key, PartitionState, Reach, _Ticket
from dedup.persisted import PersistedRecorder
from dedup.policies import Mode, PolicySnapshot
from dedup.ports import Clock, Owners, Policies, StateStore, TopicIdLookup, Writer
from dedup.recent_appends import Append, RecentAppends
from dedup.recovery import RecoveredPartition
from dedup.recovery_scheduler import RecoveryScheduler
from dedup.replay import parse_producer
from dedup.sequence_gaps import SequenceGaps
from dedup.state import (
    PartitionCheck,
    PartitionVerdict,
    Persisted,
    RunIdentities,
    Status,
    check_runs,
    persisted_position,
)
from dedup.topic_ids import UnknownTopic
from dedup.writer import BatchToWrite, WriteResult
from proxy.kafka.error_codes import retriable
from proxy.kafka.produce_codec import RecordBytes
from proxy.kafka.topology import Endpoint
from proxy.kafka.upstream_client import records_for_request
from proxy.runtime.cluster import NoSuchPartition

log = structlog.get_logger(__name__)

# Partitions Kafka said it does not have whose place in line is kept (about 3 KB each)
MAX_ABSENT_PARTITIONS = 10_000
# Topics whose leaders are looked up at once for a request's partitions met for the first
# time: the lookups of a topic's partitions share a Metadata request, and topics looked up
# together share one too, up to 100 a request (`UpstreamCluster`), so at most 4 requests
FIRST_USE_LOOKUPS = 400

SETTLE_WAIT_S = 30.0  # how long a request waits for the reset after a failed write
# How long a request waits, in line, for its partition's recovery before it is told
# NOT_LEADER_OR_FOLLOWER (retry). Waiting keeps the partition's requests in order.
FIRST_USE_WAIT_S = 10.0
# Partition data larger than this, or compressed (what it decompresses to is unknown until
# then), is read in a worker thread, so that other connections' requests go on meanwhile
# (the GIL is handed over every few milliseconds; 256 KiB of small records take the reader
# some 5 ms); smaller data is read on the event loop, cheaper than the hop to a thread
# (some 50 µs).
READ_IN_THREAD_BYTES = 256 << 10
_ATTRIBUTES_LOW_BYTE = 22  # of a record batch: its compression codec in the low 3 bits


LEASE_NOT_RENEWED = (
    "this instance could not renew its lease on the partition in time (Redis unreachable?)"
)

# Where the pushed / persisted maps are kept: in the owner's memory, or in Redis.
CheckState = Literal["memory", "redis"]

# The partitions whose check is queued, and their verdicts to come (None: nothing checked).
_Checking = tuple[list["_Work"], "asyncio.Future[list[PartitionVerdict]] | None"]


@dataclass(frozen=True, slots=True)
class PartitionAnswer:
    error_code: int = 0
    base_offset: int = -1
    log_append_time_ms: int = -1
    log_start_offset: int = -1
    error_message: str | None = None
    redirect: Redirect | None = None  # NOT_LEADER_OR_FOLLOWER: the owner to go to (KIP-951)


@dataclass(slots=True)
class Admission:
    """A request's place in line: it goes after ``predecessors``, and its ``turns`` let the
    requests behind it go once its sequences are assigned."""

    snapshot: PolicySnapshot
    principal: str | None = None  # the client's, when it authenticated (names bind to it)
    connection: object | None = None  # the client connection it came on, when known
    predecessors: list[asyncio.Future[None]] = field(default_factory=list)
    turns: list[asyncio.Future[None]] = field(default_factory=list)
    # The same line, one step earlier: a request queues its check once the requests ahead
    # of it queued theirs (`dedup.group_check`), before their verdicts are back.
    queued_before: list[asyncio.Future[None]] = field(default_factory=list)
    queued: list[asyncio.Future[None]] = field(default_factory=list)
    numbers: dict[Key, int] = field(default_factory=dict)  # its number in each partition's line
    # The request's records by partition, as admit read them (the last data named counts).
    parts: dict[Key, bytes | None] = field(default_factory=dict)

    def checks_queued(self) -> None:
        for queued in self.queued:
            if not queued.done():
                queued.set_result(None)

    def done(self) -> None:
        self.checks_queued()
        for turn in self.turns:
            if not turn.done():
                turn.set_result(None)


@dataclass(slots=True)
class _Work:
    """One partition of the request on its way through the steps above."""

    topic: str
    partition: int
    mode: Mode
    # Its partition's state, the same object from admit to release: a state is dropped
    # only once every request admitted to it has ended (`_remember_absent`).
    state: PartitionState
    number: int = 0  # in the partition's line
    batches: list[IncomingBatch] = field(default_factory=list)
    keep: list[list[bool]] = field(default_factory=list)  # per batch, per record
    answer: PartitionAnswer | None = None
    dropped: int = 0
    checked: bool = False
    token: str = ""  # the partition's recovery token when it was checked
    kept: int = 0  # records left to write after the check
    ticket: _Ticket | None = None  # its place in the partition's AckCursor, once submitted
    sizes: tuple[int | None, ...] = ()  # per identity: its chunked message's bytes so far
    behind: bool = False  # refused because one ahead of it in line was not written
    # What its own refusal, if retriable, holds back behind it (`Reach`), and the client
    # connection it came on (a `Reach.CONNECTION` refusal holds back that connection's).
    reach: Reach = Reach.PARTITION
    connection: object | None = None
    in_turn: bool = False  # every request ahead of it in line is written or refused
    checked_as: PartitionCheck | None = None  # what the state checked, once it did
    # Per batch, what the reader thread made of it (`made_ahead`: large or compressed
    # batches); empty when the batches were read on the loop, and made when written.
    prepared: list[MadeAhead] = field(default_factory=list)

    @property
    def key(self) -> Key:
        return self.topic, self.partition

    @property
    def identified(self) -> list[IncomingRecord]:
        return [r for batch in self.batches for r in batch.records if r.identity is not None]

    def runs(self) -> list[BatchRun] | None:
        """Every batch's identities as a whole (`BatchRun`), or None if some batch's are
        to be read record by record."""
        runs = [batch.run for batch in self.batches]
        return None if not runs or None in runs else cast(list[BatchRun], runs)

    def producers(self) -> set[str]:
        """The producers this partition batch names."""
        runs = self.runs()
        if runs is not None:
            return {run.producer for run in runs}
        return {r.identity.producer for r in self.identified if r.identity is not None}

    def check(self) -> PartitionCheck | None:
        """What the state checks of this partition batch; None when no record has identity."""
        runs = self.runs()
        if runs is not None:  # the usual batch: no Python object per record
            whole = RunIdentities([part for run in runs for part in run.runs()])
            return PartitionCheck(self.topic, self.partition, whole, self.token)
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
        state: StateStore,
        policies: Policies,
        writer: Writer,
        headers: IdentityHeaders,
        recoveries: RecoveryScheduler,
        clock: Clock,
        owners: Owners,
        *,
        first_use_wait_s: float = FIRST_USE_WAIT_S,
        settle_wait_s: float = SETTLE_WAIT_S,
        persisted_linger_s: float = 0.005,
        limits: ReadLimits | None = None,
        max_request_decompressed_bytes: int = 128 << 20,
        bindings: ProducerBindings | None = None,
        check_state: CheckState = "redis",
        max_producers: int = 10_000,
        max_sequence_jump: int = 0,
        topic_ids: TopicIdLookup | None = None,
        max_absent_partitions: int = MAX_ABSENT_PARTITIONS,
        recent_append_producers: int = 10_000,
    ) -> None:
        self._state = state
        self._topic_ids = topic_ids  # None: a topic's id is never confirmed (unit tests)
        self._limits = limits or ReadLimits()
        self._max_request_decompressed_bytes = max_request_decompressed_bytes
        self._bindings = bindings  # None: producer names are not bound to principals
        self._policies = policies
        self._writer = writer
        self._headers = headers
        self._recoveries = recoveries
        self._clock = clock
        self._owners = owners
        self._first_use_wait_s = first_use_wait_s
        self._settle_wait_s = settle_wait_s
        self._partitions = recoveries.partitions
        recoveries.on_topic_deleted = self._let_go
        # Partitions Kafka said it does not have, oldest first (`_remember_absent`)
        self._absent: OrderedDict[Key, None] = OrderedDict()
        self._max_absent = max_absent_partitions
        # Where the latest batches went, to answer a batch sent again as Kafka does.
        self._recent = RecentAppends(recent_append_producers)
        self._background: set[asyncio.Task[None]] = set()
        self._persisted = PersistedRecorder(
            state, on_lost=recoveries.state_lost, clock=clock, linger_s=persisted_linger_s
        )
        # The owner's maps in memory (Redis a copy of what was acknowledged, written behind),
        # or the maps in Redis, checked there.
        self._local: LocalCheck | None = None
        self._policies_seen: PolicySnapshot | None = None  # the last read `note_policies` saw
        self._checks: LocalCheck | GroupCheck
        if check_state == "memory":
            self._checks = self._local = LocalCheck(
                self._partitions,
                clock,
                max_producers=max_producers,
                max_sequence_jump=max_sequence_jump,
            )
        else:
            self._checks = GroupCheck(state, self._persisted, clock)
        recoveries.on_opened = self._opened

    async def flush_persisted(self) -> None:
        """Wait until every acknowledged sequence is recorded in Redis."""
        await self._persisted.flush()

    def partitions(self) -> list[Key]:
        """The partitions this engine has written to (or recovered) since it started."""
        return sorted(self._partitions)

    def partition_states(self) -> dict[Key, PartitionState]:
        """Each partition's in-memory state (for the snapshotter and the admin API)."""
        return self._partitions

    async def close(self) -> None:
        """Stop the resets and the check under way (the next start recovers those
        partitions anyway)."""
        await self._checks.close()
        for task in list(self._background):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    @contextlib.asynccontextmanager
    async def holding(self, key: Key, timeout_s: float = 30.0) -> AsyncIterator[PartitionState]:
        """The partition with nothing in flight (an operator's reset): every request
        admitted before is written or refused, and the ones admitted meanwhile wait their
        turn behind this one. `TimeoutError` when that takes longer than ``timeout_s``."""
        state = self._partitions.of(key)
        ahead = state.last_in_line
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        state.last_in_line = turn
        state.last_queued = turn  # no check of a later request may run before it either
        try:
            async with asyncio.timeout(timeout_s):
                if ahead is not None:
                    await asyncio.shield(ahead)  # a timeout must not cancel others' turn
                # Outcomes still to come. Polled: `pending` has no event of its own, and
                # an operator's reset is rare.
                while state.pending or not state.open.is_set():  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
            yield state
        finally:
            if not turn.done():
                turn.set_result(None)

    def request_recovery(self, partitions: list[Key], reason: str) -> None:
        """Recover these partitions (again): start-up, operator request."""
        self._recoveries.request_all(partitions, reason)

    async def ensure_recovered(self, partitions: list[Key], timeout_s: float) -> bool:
        """Recover those not recovered yet, and wait (`RecoveryScheduler.ensure_recovered`).
        A partition recovered here whose topic has since been deleted and created again is
        recovered anew first: a state read (a producer's last sequence id, from which it
        resumes) must answer for the topic as it is."""
        await self.confirm_topics(partitions)
        return await self._recoveries.ensure_recovered(partitions, timeout_s)

    async def confirm_topics(self, partitions: list[Key] | None = None) -> None:
        """The partitions recovered here (all of them by default) whose topic now has
        another id, deleted and created again since, are recovered anew: their state, and
        Redis's copy that other instances read, become the new topic's. Those held here
        whose topic does not exist (deleted, not created again yet) are let go
        (`_let_go`). Raises OSError or TimeoutError when Kafka does not answer."""
        if self._topic_ids is None:
            return
        watched = [
            (key, state)
            for key in (list(self._partitions) if partitions is None else partitions)
            if (state := self._partitions.get(key)) is not None
            and ((state.recovered and state.topic_id is not None) or self._owners.holds(key))
        ]
        if not watched:
            return
        answers = await self._topic_ids.answers(sorted({key[0] for key, _ in watched}))
        for key, state in watched:
            answer = answers.get(key[0])  # None: no ids (Kafka < 2.8); other errors: next pass
            if isinstance(answer, UnknownTopic):
                self._let_go(key)
            elif isinstance(answer, str) and state.recovered and state.topic_id != answer:
                self._topic_gone(key, "deleted and created again")

    def _let_go(self, key: Key) -> None:
        """Its topic was deleted (the topic watch or a recovery found it): the lease is given
        up as in a handoff, so nothing is renewed or recovered for the partition any more,
        and its state here is kept as that of a partition Kafka does not have
        (`_remember_absent`). Created again, the topic's first use takes the partition
        anew."""
        if not self._owners.let_go(key):
            return  # not held here, or being let go already
        metrics.TOPIC_DELETED.inc()
        log.info("the topic was deleted: giving its partition up", topic=key[0], partition=key[1])
        self._remember_absent(key)

    async def wait_recovered(self, partitions: list[Key], timeout_s: float) -> bool:
        """Whether every one of these partitions is recovered within the timeout."""
        return await self._recoveries.wait_recovered(partitions, timeout_s)

    async def settle_for_handoff(self, key: Key, recovery_wait_s: float) -> bool:
        """Before a clean release (no request is let in any more): a recovery under way
        finishes, every admitted write settles and acknowledged positions reach Redis.
        True when the partition is then recovered here with no write's fate lost."""
        state = self._partitions.get(key)
        if state is None:
            return False
        if not state.recovered and self._recoveries.recovering(key):
            # Taken a moment ago and moving on already (a rolling restart): a recovery
            # left half done would cost the next owner a fence.
            await self._recoveries.wait_recovered([key], recovery_wait_s)
        if not state.recovered:
            return False
        # Counters with no event of their own; a handoff is rare and short.
        while state.pending or state.cursor.unsettled:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        if not state.recovered or state.failed:
            return False  # a write's fate was lost on the way: the next owner fences
        await self.flush_persisted()
        return True

    async def dedup_anywhere(self) -> bool:
        """False when every topic has dedup disabled: Produce passes through undecoded."""
        return (await self._policies.snapshot()).dedup_anywhere

    # ------------------------------------------------------------- 1. admit

    async def admit(
        self, request: Any, principal: str | None = None, connection: object | None = None
    ) -> Admission | None:
        """Called as each Produce request arrives, in arrival order: None to forward it as
        is (transactional, or dedup disabled for every topic it writes), else its place in
        line on each of its partitions, taken before anything else can run. ``connection``:
        any object that stands for the client connection it came on."""
        if request.transactional_id is not None:
            return None
        snapshot = await self._policies.snapshot()
        if self._local is not None:
            self.note_policies(snapshot)
        topics = [str(topic.name) for topic in request.topic_data]
        if all(snapshot.mode_for(topic) is Mode.DISABLED for topic in topics):
            return None
        # Nothing below awaits: the places in line follow the order of arrival.
        loop = asyncio.get_running_loop()
        admission = Admission(snapshot, principal, connection, parts=_partition_data(request))
        for key in admission.parts:  # one place per partition, however often named
            gate = self._partitions.of(key)
            if gate.last_in_line is not None and not gate.last_in_line.done():
                admission.predecessors.append(gate.last_in_line)
            if gate.last_queued is not None and not gate.last_queued.done():
                admission.queued_before.append(gate.last_queued)
            turn_done: asyncio.Future[None] = loop.create_future()
            gate.last_in_line = turn_done
            admission.turns.append(turn_done)
            queued: asyncio.Future[None] = loop.create_future()
            gate.last_queued = queued
            admission.queued.append(queued)
            gate.admitted += 1
            admission.numbers[key] = gate.admitted
        return admission

    async def produce(
        self, request: Any, admission: Admission, broker: Endpoint
    ) -> dict[tuple[str, int], PartitionAnswer]:
        """Run one admitted Produce request through dedup; an answer per partition."""
        parts = admission.parts
        if len(parts) < sum(len(topic.partition_data) for topic in request.topic_data):
            log.warning("a Produce request names a partition twice: its last data counts")
        modes = admission.snapshot.mode_for
        work = [
            _Work(
                *key,
                modes(key[0]),
                self._partitions.of(key),
                admission.numbers[key],
                connection=admission.connection,
            )
            for key in parts
        ]
        timeout_ms = int(request.timeout.total_seconds() * 1000)
        try:
            try:
                # Reading may wait for a worker thread: this request's places in line are
                # taken already (admit), so a request behind it still waits for its turn.
                budget = self._max_request_decompressed_bytes
                for item in work:
                    await self._read(item, parts[item.key], budget)
                    budget -= _decompressed(item.batches)
                # Check and sequence assignment happen in arrival order per partition: a
                # request checked later must never reach the log ahead of one that arrived
                # earlier, or the earlier one's records would read as old duplicates. The
                # checks queue in that order and share round trips (`dedup.group_check`);
                # the verdicts are then judged, and the writes submitted, in it too.
                for predecessor in admission.queued_before:
                    await predecessor
                try:
                    checking = await self._queue_check(work, admission.principal)
                finally:
                    admission.checks_queued()
                try:
                    for predecessor in admission.predecessors:
                        await predecessor
                    self._take_turn(work)
                    await self._judge(checking, broker)
                    writes, submitted = await self._submit(work, broker, timeout_ms)
                finally:
                    admission.done()
                if submitted is not None:
                    self._finish_writes(writes, await submitted)
            except Exception:
                # Answered all the same (`_release`): retriable, the partition left sound.
                log.exception("produce through dedup failed; answering retry")
        finally:
            admission.done()  # also on any failure before the check: never block successors
            self._release(work)
        answers = {}
        for item in work:
            assert item.answer is not None
            answers[item.key] = item.answer
        return answers

    async def refuse_foreign_names_in_transaction(
        self, request: Any, principal: str | None
    ) -> dict[Key, PartitionAnswer] | None:
        """A transactional request from an authenticated client, before it is forwarded
        unchecked: None to forward it, else every partition's answer, nothing forwarded.

        Its records are not checked, but once committed the identities they carry count at
        a recovery's replay (`dedup.replay`), so a producer name bound to another principal
        is refused here as outside a transaction (`dedup.bindings`), and so is a batch that
        cannot be read within the limits every produce request is read within (its names
        unknown). The request is forwarded whole or not at all: its other partitions are
        answered not written, retriable; the client's transaction then has to abort."""
        if request.transactional_id is None or principal is None or self._bindings is None:
            return None
        snapshot = await self._policies.snapshot()
        parts = _partition_data(request)
        refused: dict[Key, PartitionAnswer] = {}
        budget = self._max_request_decompressed_bytes  # shared by the request's partitions
        for (topic, partition), data in parts.items():
            if snapshot.mode_for(topic) is Mode.DISABLED:
                continue
            data = data or b""
            limits = self._limits_within(budget)
            try:
                if _read_in_thread(data):
                    batches = await asyncio.to_thread(
                        read_batches, data, self._headers, limits=limits
                    )
                else:
                    batches = read_batches(data, self._headers, limits=limits)
            except BadBatch as bad:
                metrics.BAD_INPUT.labels(ErrorCode(bad.error_code).name).inc()
                refused[(topic, partition)] = PartitionAnswer(
                    bad.error_code, error_message=bad.message
                )
                continue
            budget -= _decompressed(batches)
            names = _named(batches, self._headers.producer)
            if not names:
                continue
            try:
                foreign = await self._bindings.foreign(topic, names, principal)
            except RedisError as exc:
                log.error("producer bindings unavailable; refusing the request", error=str(exc))
                refused[(topic, partition)] = _not_written("dedup state unavailable")
                continue
            if foreign:
                refused[(topic, partition)] = _foreign_name(topic, partition, foreign, principal)
        if not refused:
            return None
        whole = _not_written("another partition of this transactional request was refused")
        return {key: refused.get(key, whole) for key in parts}

    # ------------------------------------------------------------- 2. read

    def _limits_within(self, budget: int) -> ReadLimits:
        """The per-batch limits, with no more decompressed bytes than ``budget``: what the
        request's earlier partitions left of ``max_request_decompressed_bytes``."""
        if budget < self._limits.max_decompressed_bytes:
            return replace(self._limits, max_decompressed_bytes=max(budget, 0))
        return self._limits

    async def _read(self, item: _Work, data: bytes | None, budget: int) -> None:
        """Reads the partition's batch within the limits, and within `budget`: what the
        request's earlier partitions left of its decompressed bytes."""
        data = data or b""
        limits = self._limits_within(budget)
        try:
            if _read_in_thread(data):
                item.batches, item.prepared = await asyncio.to_thread(
                    _read_and_prepare, data, self._headers, limits, item.mode is not Mode.DISABLED
                )
            else:
                item.batches = read_batches(data, self._headers, limits=limits)
        except BadBatch as bad:
            metrics.BAD_INPUT.labels(ErrorCode(bad.error_code).name).inc()
            log.warning(
                "refusing a bad partition batch",
                topic=item.topic,
                partition=item.partition,
                error=bad.message,
            )
            item.reach = Reach.CONNECTION  # its producer unknown: as `Reach` says
            item.answer = PartitionAnswer(bad.error_code, error_message=bad.message)
            return
        if not item.batches:
            item.reach = Reach.CONNECTION
            item.answer = PartitionAnswer(ErrorCode.corrupt_message, error_message="no records")
            return
        if item.mode is Mode.REQUIRE:
            for batch in item.batches:
                if batch.run is not None:  # every record has an identity
                    continue
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

    async def _queue_check(self, work: list[_Work], principal: str | None = None) -> _Checking:
        """Everything before the check (bindings, the partition's gate), then the check
        queued (`dedup.group_check`): the verdicts come back later, to `_judge`."""
        if principal is not None and self._bindings is not None:
            await self._refuse_foreign_names(work, principal)
        to_check = [w for w in work if w.answer is None and w.mode is not Mode.DISABLED]
        await self._ask_first_recoveries(to_check)
        for item in to_check:
            await self._pass_gate(item)
        for item in to_check:
            # After every gate's awaits, with none left before the check: the maps answer
            # only under a lease that cannot have been taken since (with them in Redis, the
            # token guards each check).
            if item.answer is None and self._local is not None:
                self._lease_holds(item)
            if item.answer is None:
                # Kafka's sequence-gap rule (`dedup.sequence_gaps`), in line: a request of
                # an idempotent producer that skips ahead waits for the one before it.
                gaps = self._gaps_of(item)
                gap = None if gaps is None else gaps.gap(item.batches)
                if gap is not None:
                    metrics.SEQUENCE_GAPS.inc()
                    item.reach = Reach.ITSELF  # the rule holds back its producer's next
                    self._refuse(item, _not_written(gap))
                    continue
                if gaps is not None:
                    gaps.accepted(item.batches)
                self._unwrap(item)
                item.state.pending += 1
                item.checked = True
        # Each identity list walks every record of the partition: build it once.
        pairs = [(w, check) for w in to_check if w.checked and (check := w.check()) is not None]
        if not pairs:
            return [], None
        for item, check in pairs:
            item.checked_as = check
        return [w for w, _ in pairs], self._checks.queue([c for _, c in pairs])

    def _unwrap(self, item: _Work) -> None:
        """Kafka's implicit sequences counted on past its wrap at 2^31, in line
        (`dedup.implicit_wraps`): after it, they would read as the first ones again."""
        unwrapped = item.state.wraps.unwrap(item.batches)
        if unwrapped is not None:
            item.batches = unwrapped
            item.prepared = []  # made ahead with Kafka's sequences: made again when written

    def _take_turn(self, work: list[_Work]) -> None:
        """Every request ahead is submitted or refused: a retriable refusal of this one
        (at the gate, before its turn) now refuses those behind it, as `_refuse` does."""
        for item in work:
            item.in_turn = True
            if item.answer is not None and not item.behind and retriable(item.answer.error_code):
                self._refuse_behind(item)

    async def _judge(self, checking: _Checking, broker: Endpoint) -> None:
        """The verdicts of the queued check, in the request's turn."""
        checked, pending_verdicts = checking
        if pending_verdicts is None:
            return
        try:
            verdicts = await pending_verdicts
        except RedisError as exc:
            # The script may or may not have run: treat it like a failed write, so the
            # partition is reset (pushed := persisted) before anything else is accepted.
            log.error("dedup state unavailable; refusing the request", error=str(exc))
            for item in checked:
                self._fail(item)
                self._refuse(item, _not_written("dedup state unavailable"))
            return
        for item, verdict in zip(checked, verdicts, strict=True):
            if self._behind_a_refusal(item):
                # One ahead of it was refused after this check went out (serially it would
                # have been refused at the gate): refused, and what its check pushed undone.
                if not verdict.lost:
                    self._fail(item)
                item.answer = _not_written(
                    "an earlier request to this partition was not written; retry in order"
                )
                self._not_sequenced(item, item.answer.error_code)
                continue
            if verdict.lost:
                self._recoveries.state_lost(item.topic, item.partition, item.token)
                self._refuse(item, _recovering())
                continue
            if verdict.evicted:
                item.state.wraps.forget(verdict.evicted)
                if self._local is not None:  # Redis's copy forgets them too
                    self._spawn(self._forget_in_redis(item.key, verdict.evicted))
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
                item.reach = Reach.CONNECTION  # as `Reach` says: any client can send one
                self._refuse(
                    item, _not_written(f"{verdict.bad}; the chunk before is still to come")
                )
                continue
            if verdict.bad is not None:
                self._refuse_bad_record(
                    item,
                    verdict.bad,
                    verdict.bad_index,
                    "sequence_jump" if verdict.jump else "chunk",
                )
                continue
            if verdict.refused:
                metrics.RECORDS.labels("unknown").inc(len(verdict.statuses))
                item.reach = Reach.PRODUCERS  # as `Reach` says: a retry too soon, say
                if not item.state.cursor.unsettled:
                    # Nothing of its producers is on its way from here (the requests ahead
                    # are submitted or refused; those behind naming them are refused by
                    # this refusal, the others are written before the reset below), and
                    # no other instance writes the partition: pushed is above persisted only
                    # through a check whose caller gave up on it (timed out) and that ran
                    # later, after the reset. Reset again once every check in flight has
                    # its outcome, or the retry would read UNKNOWN for ever.
                    self._fail(item)
                self._refuse(
                    item,
                    _not_written(
                        "an earlier write of these sequences is in flight or failed; retry"
                    ),
                )
                continue
            item.sizes = verdict.sizes
            if Status.DUP in verdict.statuses:  # else every record is kept, as it stands
                self._drop_duplicates(item, verdict.statuses)
                if not await self._topic_unchanged(item, broker):
                    continue
            if item.dropped:
                metrics.DUP_RECORDS.inc(item.dropped)
            metrics.NEW_RECORDS.inc(len(verdict.statuses) - item.dropped)

    async def _topic_unchanged(self, item: _Work, broker: Endpoint) -> bool:
        """Records are to be dropped as duplicates: first the partition's leader confirms
        that the topic is still the one its state was rebuilt from (`dedup.topic_ids`).
        Deleted and created again, its records would be lost to the old topic's sequences:
        then the request is refused (retriable; it and every request behind it on the
        partition) and the state is rebuilt from the new topic's log. Still in the turn:
        no later request of the partition is judged meanwhile."""
        expected = item.state.topic_id
        if expected is None or self._topic_ids is None:
            return True
        try:
            current = await self._topic_ids.of(item.topic, broker)
        except UnknownTopic as exc:
            self._topic_gone(item.key, "deleted")
            self._refuse(
                item, PartitionAnswer(ErrorCode.unknown_topic_or_partition, error_message=str(exc))
            )
            return False
        except (OSError, TimeoutError) as exc:
            self._fail(item)  # its check pushed these sequences: undo, as for a failed write
            self._refuse(item, _not_written(f"the topic's id could not be confirmed: {exc!r}"))
            return False
        if current is None or current == expected:
            return True
        self._topic_gone(item.key, "deleted and created again")
        self._refuse(item, _recovering())
        return False

    def _topic_gone(self, key: Key, how: str) -> None:
        metrics.TOPIC_RECREATED.inc()
        log.warning(
            f"the topic was {how}: rebuilding the partition's dedup state from its log",
            topic=key[0],
            partition=key[1],
            topic_id=self._partitions.of(key).topic_id,
        )
        self._recoveries.request(key, f"the topic was {how}")

    @staticmethod
    def _drop_duplicates(item: _Work, statuses: Sequence[Status]) -> None:
        at = 0  # statuses: one per record with identity, in batch order
        for b, batch in enumerate(item.batches):
            if batch.run is not None:  # every record has one: none of them decoded
                keep = [status is not Status.DUP for status in statuses[at : at + batch.run.count]]
                item.keep[b] = keep
                item.dropped += len(keep) - sum(keep)
                at += len(keep)
                continue
            for r, record in enumerate(batch.records):
                if record.identity is None:
                    continue
                if statuses[at] is Status.DUP:
                    item.keep[b][r] = False
                    item.dropped += 1
                at += 1

    def _refuse_bad_record(self, item: _Work, why: str, index: int, rule: str) -> None:
        """A record broke a rule the check knows (the chunk rule, `dedup.chunks.accept_chunk`,
        or max_sequence_jump): bad input, nothing written, not retriable (the same record
        can never be accepted)."""
        record = item.identified[index]
        message = f"record at offset delta {record.offset_delta}: {why}"
        metrics.BAD_INPUT.labels(rule).inc()
        log.warning(
            "refusing a bad record", topic=item.topic, partition=item.partition, error=message
        )
        item.answer = PartitionAnswer(ErrorCode.invalid_record, error_message=message)

    async def _ask_first_recoveries(self, items: list[_Work]) -> None:
        """The partitions of a request met here for the first time: their leaders looked up
        together and the recoveries of those served here asked at once, so they run as one
        batch. The gates (`_pass_gate`) then only wait: a producer's first request to many
        partitions would otherwise wait for as many recoveries in a row."""
        now = asyncio.get_running_loop().time()
        first = {item.key for item in items if item.state.unopened(now)}
        if len(first) < 2 or not self._owners.ready():
            return  # one partition: its gate does the same
        found = await leaders_by_topic(first, self._owners.learn_leader, FIRST_USE_LOOKUPS)
        for key, leader in found:
            # A failed lookup (no such partition, no answer) is the gate's to answer.
            if not isinstance(leader, BaseException) and self._owners.serves_here(key):
                self._recoveries.request(key, "first use")

    async def _pass_gate(self, item: _Work) -> None:
        """Wait while the partition recovers or settles a failed write."""
        state = item.state
        while True:
            if self._behind_a_refusal(item):
                item.answer = _not_written(
                    "an earlier request to this partition was not written; retry in order"
                )
                self._not_sequenced(item, item.answer.error_code)
                return
            if await self._elsewhere(item):
                return
            if not state.recovered:
                self._recoveries.request(item.key, "first use")
                # Wait here, in line. Answering "retry" at once would let a pipelined later
                # request of the same producer be checked after the recovery, ahead of this
                # one: its higher sequences would make this one's records read as old.
                if await self._recoveries.wait_recovered([item.key], self._first_use_wait_s):
                    continue
                self._refuse(item, _recovering())
                return
            if state.open.is_set():
                item.token = state.token  # the lease is asked after every gate (_queue_check)
                return
            # After a failed write, wait for the reset: nothing may overtake the retry.
            try:
                await asyncio.wait_for(state.open.wait(), self._settle_wait_s)
            except TimeoutError:
                self._refuse(item, _not_written("partition is recovering from a failed write"))
                return

    def _remember_absent(self, key: Key) -> None:
        """Kafka has no such partition. Its state here (a place in line, never recovered) is
        kept for the latest `max_absent_partitions` of them only, so a client naming
        partitions that do not exist, nor topics deleted one after another, can grow the
        proxy's memory without bound; the oldest is let go once every request admitted to
        it has ended and the writer has let go of its entry (`IdempotentWriter.forget`),
        which it does once no write of it is unresolved.
        What is lost with it: were the partition created within the moment between a
        retriable refusal and the same producer's next request, that request could
        overtake the retry."""
        self._recent.forget(key)  # the offsets of a log that is gone
        self._absent[key] = None
        self._absent.move_to_end(key)
        for _ in range(len(self._absent) - self._max_absent):  # the excess, oldest first
            oldest, _ = self._absent.popitem(last=False)
            state = self._partitions.get(oldest)
            if state is not None:
                if state.recovered:
                    continue  # there after all
                busy = state.pending or state.released < state.admitted
                if busy or self._recoveries.recovering(oldest):
                    self._absent[oldest] = None  # a request still on it: let go later
                    continue
            # The writer's entry too (a deleted topic's partition written here before).
            if not self._writer.forget(*oldest):
                self._absent[oldest] = None  # a write of it still unresolved: later
                continue
            self._partitions.pop(oldest, None)

    def _lease_holds(self, item: _Work) -> bool:
        """With the maps in memory: whether this instance's lease on the partition cannot
        have been taken by another. If not, the request is refused: retriable while the
        lease is held but could not be renewed in time; a lease no longer held (lost or
        released while the partition was being recovered) is taken again by a recovery."""
        if self._owners.lease_valid(item.key):
            return True
        if self._owners.holds(item.key):
            self._refuse(item, _not_written(LEASE_NOT_RENEWED))
        else:
            self._recoveries.request(item.key, "lease not held")
            self._refuse(item, _recovering())
        return False

    async def _elsewhere(self, item: _Work) -> bool:
        """Whether another instance owns (or should own) the partition: then the client is
        told NOT_LEADER_OR_FOLLOWER with the owner's node (KIP-951), as Kafka sends a
        client to a partition's leader."""
        state = item.state
        if not self._owners.ready():  # not a member yet: may take nothing
            self._refuse(item, _recovering())
            return True
        if not state.recovered:  # first use here: sidecar placement needs the leader
            try:
                await self._owners.learn_leader(item.key)
            except NoSuchPartition as exc:
                # Answered as Kafka would, before any lease or recovery: a client writing
                # to partitions that do not exist must not leave recoveries retrying.
                metrics.BAD_INPUT.labels("unknown_partition").inc()
                self._refuse(
                    item,
                    PartitionAnswer(ErrorCode.unknown_topic_or_partition, error_message=str(exc)),
                )
                self._remember_absent(item.key)
                return True
        holder = state.held_by(asyncio.get_running_loop().time())
        if holder is None and self._owners.serves_here(item.key):
            return False
        redirect = self._owners.redirect(item.key, holder)
        metrics.REDIRECTS.inc()
        where = f"; retry at {redirect.node.endpoint}" if redirect is not None else "; retry"
        self._refuse(
            item,
            PartitionAnswer(
                ErrorCode.not_leader_or_follower,
                error_message="another proxy instance owns this partition's dedup" + where,
                redirect=redirect,
            ),
        )
        return True

    # ------------------------------------------------------------- 4. write

    async def _submit(
        self, work: list[_Work], broker: Endpoint, timeout_ms: int
    ) -> tuple[list[_Work], asyncio.Future[list[WriteResult]] | None]:
        writes: list[tuple[_Work, BatchToWrite]] = []
        for item in work:
            if item.answer is not None:
                continue
            # A batch with every record kept is passed whole: a uniform batch's records
            # stay undecoded (`LazyRecords`) unless the batch has to be rebuilt.
            kept = [
                batch.records
                if all(keep)
                else [r for r, k in zip(batch.records, keep, strict=True) if k]
                if any(keep)
                else []  # every record a duplicate (a blind re-send): none decoded
                for batch, keep in zip(item.batches, item.keep, strict=True)
            ]
            count = item.kept = sum(len(records) for records in kept)
            if count == 0:  # every record was a duplicate: success, nothing to write
                item.answer = self._duplicate_answer(item)
                continue
            batch = BatchToWrite(
                item.topic,
                item.partition,
                count,
                _builder(item, kept, self._headers),
                wanted=self._still_wanted(item) if item.checked else None,
                settled=self._on_settled(item) if item.checked else None,
            )
            writes.append((item, batch))
        if not writes:
            return [], None
        items = [item for item, _ in writes]
        try:
            submitted = await self._writer.submit(broker, [w for _, w in writes], timeout_ms)
        except (OSError, TimeoutError) as exc:
            # Nothing was sent (the writer fails before assigning sequences): tell the
            # client to refresh metadata and retry, as a broker that went away would.
            failed: asyncio.Future[list[WriteResult]] = asyncio.get_running_loop().create_future()
            failed.set_result(
                [WriteResult(False, ErrorCode.not_leader_or_follower, error_message=str(exc))]
                * len(writes)
            )
            return items, failed
        for item in items:  # in submission order: the order of the partition's log
            if item.checked:
                item.ticket = item.state.cursor.submitted()
        return items, submitted

    def _still_wanted(self, item: _Work) -> Callable[[], bool]:
        """Asked by the writer as the batch takes its sequence: a write ahead of it in line
        may have failed since its check, and it must not overtake that one's retry."""

        def wanted() -> bool:
            return not self._behind_a_refusal(item)

        return wanted

    def _on_settled(self, item: _Work) -> Callable[[WriteResult], None]:
        """Told by the writer as soon as the write's outcome is definite, before any later
        batch of the partition takes a sequence."""

        def settled(result: WriteResult) -> None:
            if not result.written:
                # Now, before a request of its producer that follows is checked.
                self._not_sequenced(item, result.error_code)
                if retriable(result.error_code) and not item.behind:
                    self._refuse_behind(item)

        return settled

    def _finish_writes(self, items: list[_Work], results: list[WriteResult]) -> None:
        for item, result in zip(items, results, strict=True):
            written_records = 0
            end_offset = None
            if result.written:
                written_records = item.kept
                if result.base_offset >= 0:
                    end_offset = result.base_offset + written_records
                if item.checked:
                    highest = _highest_kept(item)
                    table = item.state.sequences
                    if table is not None and table.token == item.token:
                        table.persisted(highest, self._clock.clock_ms())
                    self._persisted.add(item.topic, item.partition, highest, item.token)
                item.answer = PartitionAnswer(
                    base_offset=result.base_offset
                    if item.dropped == 0
                    else self._base_before_dropped(item, result.base_offset),
                    log_append_time_ms=result.log_append_time_ms,
                    log_start_offset=result.log_start_offset,
                )
                if result.log_start_offset >= 0:
                    item.state.log_start_offset = result.log_start_offset
                if item.checked and result.base_offset >= 0:
                    self._remember_append(item, result)
            else:
                if item.checked:
                    self._fail(item)
                if result.unresolved:  # only the log can tell: fence, then replay
                    self._recoveries.request(item.key, "a write stayed ambiguous")
                self._refuse(
                    item, PartitionAnswer(result.error_code, error_message=result.error_message)
                )
            if item.ticket is not None:
                item.state.cursor.settled(item.ticket, end_offset, written_records)

    def _opened(self, key: Key, recovered: RecoveredPartition) -> None:
        """A partition recovered here: its maps, and where its producers' latest records
        are in the log (a batch whose answer the crash lost is answered from it)."""
        if self._local is not None:
            self._local.opened(key, recovered)
        self._recent.seed(key, recovered.runs, recovered.token)

    def latest_appends(self, key: Key, token: str, below: int) -> dict[str, tuple[Append, ...]]:
        """Where the partition's producers' latest batches are, as this instance knows
        under ``token``, below offset ``below`` (`RecentAppends.latest`)."""
        return self._recent.latest(key, token, below)

    def _remember_append(self, item: _Work, result: WriteResult) -> None:
        """Where a batch of one producer's sequences in a row went. Of a batch whose first
        records were dropped as duplicates, the part written (in a row, at the result's
        offset): it continues the run where the dropped ones are, if that ends just
        before, so that a re-send of the whole batch is answered from the run too."""
        run = _whole_run(item)
        dropped = _dropped_first(item)
        if run is None or dropped is None:
            return
        producer, first, count = run
        written = Append(
            first + dropped,
            count - dropped,
            result.base_offset,
            result.log_append_time_ms,
            item.token,
        )
        self._recent.record(item.key, producer, written)

    def _base_before_dropped(self, item: _Work, written_at: int) -> int:
        """A batch whose first records were dropped as duplicates and the rest written at
        `written_at`: its first record's offset, when the dropped ones are in the log just
        before the written ones (where this instance's latest append of them ended), so
        that every record's offset follows from it as from any answer; else -1. A client
        numbers a batch's records from its base offset, so -1 is the answer only where no
        base is right (librdkafka numbers from -1 too: `dedup.produce_filter` answers its
        clients below zero)."""
        run = _whole_run(item)
        dropped = _dropped_first(item)
        if run is None or not dropped or written_at < 0:
            return -1
        producer, first, _ = run
        found = self._recent.find(item.key, producer, first, dropped, item.token)
        if found is None or found.base_offset + dropped != written_at:
            return -1
        return found.base_offset

    def _duplicate_answer(self, item: _Work) -> PartitionAnswer:
        """A batch dropped whole: answered with the original's offset and append time
        where the partition's latest appends under its current recovery token say, as
        Kafka's broker answers a duplicate batch; else with offset -1. The log start
        offset is the latest this instance knows of the partition (read by the recovery
        that opened it here, or given by Kafka's latest answer to a write since), as in
        Kafka's answer."""
        run = _whole_run(item)
        append = None if run is None else self._recent.find(item.key, *run, item.token)
        log_start_offset = item.state.log_start_offset
        if append is None:
            metrics.DUPLICATE_NO_OFFSET.inc()
            return PartitionAnswer(log_start_offset=log_start_offset)
        metrics.DUPLICATE_ORIGINAL_OFFSET.inc()
        return PartitionAnswer(
            base_offset=append.base_offset,
            log_append_time_ms=append.log_append_time_ms,
            log_start_offset=log_start_offset,
        )

    # ------------------------------------------------------------- 5. settle

    def _release(self, work: list[_Work]) -> None:
        for item in work:
            item.state.released_one()
            if item.answer is None:
                self._abandon(item)
            elif item.answer.error_code:  # every way to "not written" ends here too
                self._not_sequenced(item, item.answer.error_code)
                if item.mode is not Mode.DISABLED and retriable(item.answer.error_code):
                    # Again now: requests admitted since it was refused were sent before
                    # its answer too.
                    self._refuse_behind(item)
            if not item.checked:
                continue
            state = item.state
            state.pending -= 1
            if state.pending == 0 and state.failed:
                state.failed = False
                if state.recovered:  # else the recovery under way rebuilds pushed anyway
                    self._spawn(self._reset(item.topic, item.partition, state))

    def _abandon(self, item: _Work) -> None:
        """The request stopped (an unexpected error, cancellation) before this partition
        had its outcome: answer retry, and leave the partition able to take the retry."""
        if item.ticket is not None:
            # Submitted: whether it reached the log only the log can tell.
            item.state.cursor.settled(item.ticket, None, 0)
            self._recoveries.request(item.key, "a write's outcome was lost")
            self._refuse(item, _recovering())
            return
        if item.checked:  # pushed may have risen with nothing on its way: a failed write
            self._fail(item)
        self._refuse(item, _not_written("the proxy failed to handle the request; retry"))

    def _refuse(self, item: _Work, answer: PartitionAnswer) -> None:
        """Answer not written; when the client retries that, nothing behind may overtake."""
        item.answer = answer
        self._not_sequenced(item, answer.error_code)
        if retriable(answer.error_code) and not item.behind:
            self._refuse_behind(item)

    def _not_sequenced(self, item: _Work, error_code: int) -> None:
        """Not written (`dedup.sequence_gaps`), called as soon as that is decided. Answered
        retry, its producer must send this partition batch again before anything after it.
        Refused for good, it is never sent again: what follows it is no gap (Kafka's Java
        producer takes a new epoch then; others go on after it)."""
        gaps = self._gaps_of(item)
        if gaps is None:
            return
        if retriable(error_code):
            gaps.refused(item.batches)
        else:
            gaps.accepted(item.batches)

    def _gaps_of(self, item: _Work) -> SequenceGaps | None:
        """The partition's expectations, while this instance holds its lease: only what its
        producers sent while it did tells (redirected to another owner, they go on there;
        `RecoveryScheduler.forget` empties them when the lease goes).

        Also at a partition's first use here, before the lease, while this instance is to
        take it: a request refused then (a broker that does not know a new topic yet, the
        recovery not done in time) must be sent again before the producer's next one, which
        may arrive once the lease is held. The recovery keeps these only when no other
        instance can have written the partition meanwhile (`unseen_writes`), and they go
        when another instance holds it (`RecoveryScheduler`)."""
        if item.mode is Mode.DISABLED:
            return None
        state = item.state
        if self._owners.holds(item.key):
            return state.gaps
        now = asyncio.get_running_loop().time()
        if state.unopened(now) and self._owners.serves_here(item.key):
            return state.gaps
        return None

    def _refuse_behind(self, item: _Work) -> None:
        """Refuse the requests admitted on the partition so far that are not yet written,
        as far as the refusal's `Reach`: each was sent before this one's answer (retry)
        reached its client. Only once its turn has come: the requests ahead of it are
        written or refused by then."""
        if item.mode is Mode.DISABLED or not item.in_turn:
            return
        producers = item.producers() if item.reach is Reach.PRODUCERS else ()
        item.state.refuse_behind(item.reach, item.connection, producers)

    @staticmethod
    def _behind_a_refusal(item: _Work) -> bool:
        """Whether a refusal ahead of it in line refuses this request too; if so it is
        marked `behind`, and its own refusal reaches as far as that one's."""
        reach = item.state.refuses(item.number, item.connection, item.producers)
        if reach is None:
            return False
        metrics.REFUSED_BEHIND.labels(reach.value).inc()
        item.behind, item.reach = True, reach
        return True

    def _fail(self, item: _Work) -> None:
        state = item.state
        state.failed = True
        state.open.clear()

    async def _reset(self, topic: str, partition: int, state: PartitionState) -> None:
        """Every write that passed the check has its outcome: forget what was pushed but
        never persisted, so the client's retry is accepted. Retried until Redis answers."""
        if self._local is not None:  # the maps are here: nothing to wait for
            if state.sequences is not None:
                state.sequences.reset()
            state.open.set()
            log.info("partition reset after a failed write", topic=topic, partition=partition)
            return
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
            self._recoveries.state_lost(topic, partition, state.token)
        state.open.set()
        log.info("partition reset after a failed write", topic=topic, partition=partition)

    async def _refuse_foreign_names(self, work: list[_Work], principal: str) -> None:
        """A partition batch that names a producer bound to another principal is refused
        whole (`dedup.bindings`); in turn, so a retriable refusal refuses those behind."""
        assert self._bindings is not None
        for item in work:
            if item.answer is not None or item.mode is Mode.DISABLED:
                continue
            names = item.producers()
            if not names:
                continue
            try:
                foreign = await self._bindings.foreign(item.topic, names, principal)
            except RedisError as exc:
                log.error("producer bindings unavailable; refusing the request", error=str(exc))
                self._refuse(item, _not_written("dedup state unavailable"))
                continue
            if foreign:
                self._refuse(item, _foreign_name(item.topic, item.partition, foreign, principal))

    def note_policies(self, snapshot: PolicySnapshot) -> None:
        """With the maps in memory: those of partitions whose topic has dedup disabled in a
        policy read just now are dropped. Records written meanwhile go round the check, so
        a later enabling must recover the partition from the log (as the maps in Redis
        are cleared when dedup is disabled). Each read is looked at once: on the produce
        path and by the service's policy watch, so an owner that gets no request for the
        topic sees it too."""
        if self._local is None or snapshot is self._policies_seen:
            return
        self._policies_seen = snapshot
        self._forget_maps(lambda topic: snapshot.mode_for(topic) is Mode.DISABLED)

    def forget_topic(self, topic: str) -> None:
        """Dedup was disabled for the topic (by this instance's admin API): the maps kept
        here go at once (`note_policies`)."""
        self._forget_maps(lambda name: name == topic)

    def _forget_maps(self, of_topic: Callable[[str], bool]) -> None:
        """The maps kept here of the partitions of the topics named go, with the partitions'
        recovered state: the next request recovers them from the log."""
        for key, state in list(self._partitions.items()):
            if state.sequences is not None and of_topic(key[0]):
                self._recoveries.forget(key)

    async def _forget_in_redis(self, key: Key, producers: Sequence[str]) -> None:
        """Evicted here: gone from Redis's copy too, so a snapshot does not bring them back."""
        try:
            await self._state.forget_producers(key[0], key[1], producers)
        except RedisError as exc:
            log.warning("evicted producers stay in Redis's copy", error=str(exc))

    # ------------------------------------------------------------- plumbing

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _read_and_prepare(
    data: bytes, headers: IdentityHeaders, limits: ReadLimits, add_identity_headers: bool
) -> tuple[list[IncomingBatch], list[MadeAhead]]:
    """`read_batches` in a worker thread, and there too what each batch is written with
    (`made_ahead`: the records of a batch of implicit identity, the records' CRC32C): the
    event loop then only stamps the header of a large batch."""
    batches = read_batches(data, headers, limits=limits)
    return batches, [made_ahead(batch, headers, add_identity_headers) for batch in batches]


def _read_in_thread(data: bytes) -> bool:
    """Whether a partition's records are read in a worker thread: large or compressed."""
    return len(data) > READ_IN_THREAD_BYTES or (
        len(data) > _ATTRIBUTES_LOW_BYTE and bool(data[_ATTRIBUTES_LOW_BYTE] & 0x07)
    )


def _decompressed(batches: Sequence[IncomingBatch]) -> int:
    """The bytes a partition's batches took of the request's decompressed budget (a batch
    read without limits tells -1: it took none)."""
    return sum(max(batch.decompressed_size, 0) for batch in batches)


def _named(batches: Sequence[IncomingBatch], producer_header: str) -> set[str]:
    """Every producer the records' identity headers name, read as a recovery's replay reads
    them (`dedup.replay`): transactional batches, whose records carry no identity on the
    produce path, included."""
    return {
        name
        for batch in batches
        for record in batch.records
        for header, raw in record.headers
        if header == producer_header and (name := parse_producer(raw)) is not None
    }


def _foreign_name(
    topic: str, partition: int, foreign: dict[str, str], principal: str
) -> PartitionAnswer:
    """The refusal of a partition batch naming producers bound to other principals."""
    name, owner = sorted(foreign.items())[0]
    metrics.BAD_INPUT.labels("foreign_producer").inc()
    log.warning(
        "refusing records under another principal's producer name",
        topic=topic,
        partition=partition,
        producer=name,
        owner=owner,
        principal=principal,
    )
    return PartitionAnswer(
        ErrorCode.topic_authorization_failed,
        error_message=f"producer {name!r} on topic {topic} belongs to {owner}, not {principal}",
    )


def _partition_data(request: Any) -> dict[Key, bytes | None]:
    """Each partition's records in request order. A partition named twice keeps its last
    data: Kafka's broker does the same (`KafkaApis.handleProduceRequest` keeps one entry
    per partition, the last), so its earlier data is neither written nor refused."""
    parts: dict[Key, bytes | None] = {}
    for topic in request.topic_data:
        for part in topic.partition_data:
            parts[(str(topic.name), int(part.index))] = part.records
    return parts


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
    check = item.checked_as
    if check is not None and not item.dropped and not check.chunks:
        return _highest_sequences(check.identities)  # the usual case: every record written
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


def _highest_sequences(identities: Sequence[tuple[str, int]]) -> dict[str, Persisted]:
    highest: dict[str, int] = {}
    if isinstance(identities, RunIdentities):  # a run's highest is its last
        for producer, _, last, _ in identities.runs:
            known = highest.get(producer)
            if known is None or last > known:
                highest[producer] = last
        return cast(dict[str, Persisted], highest)
    for producer, sequence in identities:
        known = highest.get(producer)
        if known is None or sequence > known:  # plain sequences: no chunk positions here
            highest[producer] = sequence
    return cast(dict[str, Persisted], highest)  # a sequence is a Persisted: no copy


def _whole_run(item: _Work) -> tuple[str, int, int] | None:
    """The producer, first sequence and count of the partition's one batch, when its
    records are one producer's sequences in a row (a Kafka producer's batch always is).
    Never for chunks: a chunked message's chunks share its sequence, each at its offset."""
    if len(item.batches) != 1:
        return None
    batch = item.batches[0]
    if batch.run is not None:  # the Rust scan's (no chunk in it), no record looked at
        return batch.run.producer, batch.run.first, batch.run.count
    identities = [  # the records are read in Python already
        (r.identity.producer, r.identity.sequence)
        for r in batch.records
        if r.identity and r.chunk is None
    ]
    runs = check_runs(identities) if len(identities) == len(batch.records) else []
    if len(runs) != 1:
        return None
    producer, first, _, count = runs[0]
    return producer, first, count


def _dropped_first(item: _Work) -> int | None:
    """How many records the check dropped from the front of the partition's one batch,
    where it dropped none after a record it kept (the written ones then lie in a row at
    the write's offset, the batch's last sequences); else None."""
    if item.dropped == 0:
        return 0
    if len(item.keep) != 1:
        return None
    keep, dropped = item.keep[0], item.dropped
    if any(keep[:dropped]) or not all(keep[dropped:]):
        return None
    return dropped


def _builder(
    item: _Work, kept: Sequence[Sequence[IncomingRecord]], headers: IdentityHeaders
) -> Callable[[int, int, int], RecordBytes]:
    """The batch bytes for the writer: one output batch per input batch, sequences in a row.
    A batch with nothing dropped and no header to add is the client's own bytes, restamped
    (`dedup.batches.forwardable`); any other is rebuilt from the records kept."""
    add_identity_headers = item.mode is not Mode.DISABLED
    prepared: Sequence[MadeAhead | None] = item.prepared or [None] * len(item.batches)
    plan = [
        (batch, records, forwardable(batch, records, add_identity_headers), ahead)
        for batch, records, ahead in zip(item.batches, kept, prepared, strict=True)
        if records
    ]

    def build(producer_id: int, producer_epoch: int, base_sequence: int) -> RecordBytes:
        parts: list[bytes | memoryview] = []
        sequence = base_sequence
        for batch, records, as_is, ahead in plan:
            if as_is:
                parts.extend(restamped(batch.raw, producer_id, producer_epoch, sequence, ahead))
            elif (
                add_identity_headers
                and batch.run is not None
                and batch.run.rewritable
                and len(records) == len(batch.records)
            ):  # implicit identities, every record kept: rewritten in Rust
                parts.extend(
                    rewritten_with_identity_headers(
                        batch,
                        producer_id=producer_id,
                        producer_epoch=producer_epoch,
                        base_sequence=sequence,
                        headers=headers,
                        ahead=ahead,
                    )
                )
            else:
                parts.append(
                    build_batch(
                        records,
                        compression=batch.compression,
                        timestamp_type=batch.timestamp_type,
                        producer_id=producer_id,
                        producer_epoch=producer_epoch,
                        base_sequence=sequence,
                        add_identity_headers=add_identity_headers,
                        headers=headers,
                    )
                )
            sequence = (sequence + len(records)) % (1 << 31)
        # A large batch is not joined here, on the event loop: its pieces go to the socket.
        return records_for_request(parts)

    return build
