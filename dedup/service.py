"""Everything dedup needs at run time, built from its settings and closed in order."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import cast

import redis.asyncio
import structlog
from confluent_kafka.admin import AdminClient

from dedup.batches import IdentityHeaders, ReadLimits
from dedup.bindings import ProducerBindings
from dedup.engine import DedupEngine
from dedup.fencing import Fencer
from dedup.links import UpstreamLinks
from dedup.ownership.leases import Lease, PartitionLeases
from dedup.ownership.members import Member, Membership
from dedup.ownership.owner import Ownership
from dedup.policies import Mode, PolicyStore
from dedup.ports import SystemClock
from dedup.recovery import Owners, Recovery
from dedup.recovery_scheduler import RecoveryScheduler
from dedup.redis_connect import redacted, redis_from_url
from dedup.sequences import PartitionSequences
from dedup.settings import DedupSettings
from dedup.snapshots import SnapshotError, SnapshotStore
from dedup.snapshotter import SnapshotPolicy, Snapshotter
from dedup.state import DedupState, ProducerState, clock_ms
from dedup.topic_ids import TopicIds, UnknownTopic, topic_id_of
from dedup.transaction_deadlines import TransactionDeadlines
from dedup.writer import IdempotentWriter, LeaderLookup
from proxy.kafka.topology import Endpoint
from proxy.runtime import background
from proxy.runtime.security import UpstreamSecurity

log = structlog.get_logger(__name__)

PURGE_INTERVAL_S = 300.0
# A partition handed on while still being recovered waits this long for the recovery
# (within the ownership's HANDOFF_TIMEOUT_S).
HANDOFF_RECOVERY_WAIT_S = 20.0


@dataclass(frozen=True, slots=True)
class UpstreamAccess:
    """What dedup needs of the Kafka cluster behind the proxy, given by the runtime."""

    bootstrap_servers: list[str]
    security: UpstreamSecurity  # how every connection to Kafka is made
    instance_id: str  # stable per proxy instance: the root of its transactional id
    connect_timeout_s: float
    known_upstreams: Callable[[], Sequence[Endpoint]]
    leader_of: LeaderLookup
    # A partition's leader id and epoch (None: not known); raises
    # `proxy.runtime.cluster.NoSuchPartition` when Kafka answered that it does not exist.
    partition_leader: Callable[[str, int], Awaitable[tuple[int, int] | None]]
    advertised_host: str  # how clients reach this instance (published to the others)
    advertised_port_base: int  # with SNI routing: the one port of every broker
    node_id_offset: int
    sni_host_pattern: str | None = None  # SNI routing: each broker's name


class DedupService:
    def __init__(
        self,
        settings: DedupSettings,
        upstream: UpstreamAccess,
    ) -> None:
        self.settings = settings
        self.upstream = upstream
        leader_of = upstream.leader_of
        self._leader_of = leader_of
        self.redis = redis_from_url(
            settings.redis,
            socket_timeout=settings.redis_timeout_s,
            socket_connect_timeout=settings.redis_connect_timeout_s,
            **settings.redis_tls,
        )
        prefix = settings.redis_key_prefix
        self.bindings = ProducerBindings(
            self.redis, prefix, prefixes=settings.producer_name_prefixes
        )
        self.state = DedupState(
            self.redis,
            key_prefix=prefix,
            max_producers=settings.max_producers_per_partition,
            max_sequence_jump=settings.max_sequence_jump,
        )
        self.policies = PolicyStore(
            self.redis,
            Mode.ENABLED if settings.dedup else Mode.DISABLED,
            key_prefix=prefix,
            cache_s=settings.policy_cache_s,
        )
        # The proxy's own connections to the brokers, for its writes (a few per broker:
        # `dedup.links`) and its fencing.
        self.links = UpstreamLinks(upstream.connect_timeout_s, upstream.security.link())
        kafka_config = upstream.security.librdkafka()
        incarnation = uuid.uuid4().hex
        me = Member(
            upstream.instance_id,
            incarnation,
            0,  # given at join
            upstream.advertised_host,
            upstream.advertised_port_base,
            upstream.node_id_offset,
            settings.local_broker_id,
            upstream.sni_host_pattern,
        )
        self.ownership = Ownership(
            Membership(self.state, me, settings.lease_ttl_s),
            PartitionLeases(self.state, upstream.instance_id, incarnation, settings.lease_ttl_s),
            placement=settings.placement,
            node_id_stride=settings.node_id_stride,
            heartbeat_s=settings.heartbeat_s,
            ttl_s=settings.lease_ttl_s,
            leader_lookup=upstream.partition_leader,
        )
        self._fencers: dict[str, Fencer] = {}
        self.writer = IdempotentWriter(
            leader_of,
            self._fencer_for(upstream.instance_id),
            self.links.get,
            timeout_s=upstream.connect_timeout_s,
            ambiguous_give_up_s=settings.ambiguous_write_give_up_s,
            lanes=settings.produce_connections_per_broker,
            may_write=lambda topic, partition: self.ownership.still_mine((topic, partition)),
        )
        servers = ",".join(upstream.bootstrap_servers)
        self.snapshots = SnapshotStore(
            servers,
            settings.snapshot_topic,
            partitions=settings.snapshot_topic_partitions,
            kafka_config=kafka_config,
        )
        headers = IdentityHeaders(settings.dedup_producer_header, settings.dedup_sequence_header)
        self.topic_ids = topic_ids = TopicIds(self.links.get, upstream.known_upstreams)
        self.recoveries = RecoveryScheduler(
            Recovery(
                self.writer,
                self.snapshots,
                self.state,
                servers,
                headers,
                Owners(
                    self.ownership.leases,
                    self._fencer_for,
                    lambda: [
                        m.instance_id
                        for m in self.ownership.members
                        if m.instance_id != upstream.instance_id
                    ],
                    self.ownership.granted,
                ),
                topic_ids,
                TransactionDeadlines(self.links.get, upstream.known_upstreams),
                max_producers=settings.max_producers_per_snapshot,
                replay_timeout_s=settings.replay_timeout_s,
                replay_transaction_wait_s=settings.replay_transaction_wait_s,
                replay_transaction_wait_max_s=settings.replay_transaction_wait_max_s,
                kafka_config=kafka_config,
            ),
            first_sequence_wait_s=settings.first_sequence_wait_s,
        )
        self.engine = DedupEngine(
            self.state,
            self.policies,
            self.writer,
            headers,
            self.recoveries,
            SystemClock(),
            self.ownership,
            persisted_linger_s=settings.persisted_linger_s,
            limits=ReadLimits(
                max_records=settings.max_batch_records,
                max_decompressed_bytes=settings.max_batch_decompressed_bytes,
                max_headers=settings.max_headers_per_record,
                max_producer_bytes=settings.max_producer_name_bytes,
            ),
            max_request_decompressed_bytes=settings.max_request_decompressed_bytes,
            bindings=self.bindings if settings.bind_producer_names else None,
            check_state=settings.check_state,
            max_producers=settings.max_producers_per_partition,
            max_sequence_jump=settings.max_sequence_jump,
            topic_ids=topic_ids,
            max_absent_partitions=settings.max_absent_partitions,
            recent_append_producers=settings.recent_append_producers,
        )
        self.snapshotter = Snapshotter(
            self.engine,
            self.state,
            self.snapshots,
            SnapshotPolicy(
                every_records=settings.snapshot_every_records,
                every_s=settings.snapshot_every_s,
                max_producers=settings.max_producers_per_snapshot,
                appends=settings.snapshot_appends,
            ),
        )
        self.ownership.bind(on_lost=self.recoveries.forget, handoff=self._hand_off)
        self._tasks: list[asyncio.Task[None]] = []

    def _fencer_for(self, instance_id: str) -> Fencer:
        """The fencer of an instance's transactional id (this one's, or a suspect's)."""
        fencer = self._fencers.get(instance_id)
        if fencer is None:
            fencer = self._fencers[instance_id] = Fencer(
                f"dedup-proxy-{instance_id}",
                self.upstream.known_upstreams,
                self._leader_of,
                self.links.get,
            )
        return fencer

    async def _hand_off(self, lease: Lease) -> bool:
        """Before a clean release: no request is let in any more (the ownership redirects
        them), a recovery under way finishes, every write already admitted settles,
        acknowledged positions reach Redis, and a snapshot covers them all. True when all
        of it happened."""
        if not await self.engine.settle_for_handoff(lease.key, HANDOFF_RECOVERY_WAIT_S):
            return False
        return await self.snapshotter.snapshot_now(lease.key) is not None

    async def start(self) -> None:
        try:
            await cast(Awaitable[bool], self.redis.ping())
        except redis.RedisError as exc:
            # Not fatal: produce requests are refused (retriable) until Redis answers.
            log.error(
                "Redis not reachable at start", redis=redacted(self.settings.redis), error=str(exc)
            )
        await self.ownership.start()  # DuplicateInstance: a configuration error, fatal
        self._tasks = [
            background.start(self._purge_loop(), "purge-idle-producers"),
            background.start(self._policy_watch(), "policy-watch"),
            background.start(self._prepare(), "prepare-dedup"),
            background.start(self._topic_watch(), "topic-watch"),
        ]
        self.snapshotter.start()

    async def close(self) -> None:
        # Hand every partition over first: the next owners then need no fence.
        await self.ownership.close()
        try:
            await asyncio.wait_for(self.engine.flush_persisted(), 10)
        except TimeoutError:
            log.error("shutting down with acknowledged sequences not yet recorded in Redis")
        try:  # so the next start has little to replay
            await asyncio.wait_for(self.snapshotter.snapshot_changed(), 10)
        except TimeoutError:
            log.warning("shutting down before every changed partition was snapshotted")
        await self.snapshotter.close()
        await self.recoveries.close()
        await self.engine.close()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.links.close()
        await self.snapshots.close()
        await self.redis.aclose()

    async def reset_producer(self, topic: str, partition: int, producer: str) -> int | None:
        """Forget one producer on a partition (an operator's decision: a producer that was
        forged, or restarts its sequences): its next record is new whatever its sequence.
        Recorded in the snapshot topic first, with the partition's end, so a recovery
        (snapshot or replay) honours it too. The offset recorded; None when the partition
        is not recovered here (another instance owns it, or it was never written here)."""
        key = (topic, partition)
        state = self.engine.partition_states().get(key)
        if state is None or not state.recovered:
            return None
        async with self.engine.holding(key) as held:
            if not held.recovered:
                return None
            end = held.cursor.safe_end
            stored = (await self.snapshots.read([key]))[key]
            await self.snapshots.write_resets(topic, partition, {**stored.resets, producer: end})
            await self.engine.flush_persisted()
            if held.sequences is not None:
                held.sequences.forget(producer)
            await self.state.forget_producer(topic, partition, producer)
        log.info("producer reset", topic=topic, partition=partition, producer=producer, offset=end)
        return end

    async def last_sequence(self, topic: str, partition: int, producer: str) -> int:
        """The producer's last persisted sequence (-1: unknown): from the maps kept here
        when this instance holds them, else from Redis's copy."""
        maps = self._maps_here(topic, partition)
        if maps is not None:
            found = maps.producers().get(producer)
            return -1 if found is None or found.persisted is None else found.persisted
        return await self.state.last_sequence(topic, partition, producer)

    async def copies_are_current(self, topic: str, partitions: Sequence[int]) -> bool:
        """Whether Redis's copy of each of these partitions that another instance owns is of
        the topic as it is now: its recovery token names the topic's id (`dedup.topic_ids`).
        Deleted and created again, the topic is rebuilt by its owner within
        `topic_id_check_s`; until then a state read would answer for the old topic. Raises
        OSError or TimeoutError when Kafka does not answer."""
        states = self.engine.partition_states()
        elsewhere = [
            p for p in partitions if (s := states.get((topic, p))) is None or not s.recovered
        ]
        if not elsewhere:
            return True
        recorded = {topic_id_of(t) for t in await self.state.tokens(topic, elsewhere) if t}
        recorded.discard(None)
        if not recorded:
            return True
        try:
            current = await self.topic_ids.of(topic)
        except UnknownTopic:  # deleted, not created again: left as it is, as by its owner
            return True
        return current is None or recorded == {current}

    async def producers(self, topic: str, partition: int) -> dict[str, ProducerState]:
        """Every producer the partition tracks: from the maps kept here when this instance
        holds them (pushed included), else from Redis's copy."""
        maps = self._maps_here(topic, partition)
        if maps is not None:
            return maps.producers()
        return await self.state.producers(topic, partition)

    def _maps_here(self, topic: str, partition: int) -> PartitionSequences | None:
        """The partition's maps kept in this instance's memory (None: checked in Redis, or
        not held here)."""
        state = self.engine.partition_states().get((topic, partition))
        return None if state is None else state.sequences

    async def topic_partitions(self, topic: str) -> list[int]:
        """The topic's partitions as Kafka reports them (empty: no such topic)."""

        def ask() -> list[int]:
            admin = AdminClient(
                {
                    "bootstrap.servers": ",".join(self.upstream.bootstrap_servers),
                    "allow.auto.create.topics": False,  # asking must not create it
                    **self.upstream.security.librdkafka(),
                }
            )
            found = admin.list_topics(topic, timeout=10).topics.get(topic)
            if found is None or found.error is not None:
                return []
            return sorted(found.partitions)

        return await asyncio.to_thread(ask)

    async def _prepare(self) -> None:
        """The snapshot topic. Partitions are taken (and recovered) on first use: an
        instance takes only what the placement gives it and a client asks for."""
        delay = 1.0
        while True:
            try:
                await self.snapshots.ensure_topic()
                break
            except SnapshotError as exc:
                log.error("cannot create the snapshot topic; retrying", error=str(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 60.0)

    async def _policy_watch(self) -> None:
        """The policies read again as often as they may change here, so that an owner
        keeping the maps in memory drops those of a topic whose dedup was disabled through
        another instance even while it gets no request for it (`DedupEngine.note_policies`)."""
        if self.settings.check_state != "memory":
            return
        while True:
            await asyncio.sleep(max(self.settings.policy_cache_s, 0.1))
            with background.one_pass("policy-watch"):
                try:
                    self.engine.note_policies(await self.policies.snapshot())
                except redis.RedisError as exc:  # not read yet: the next pass tries again
                    log.warning("policies could not be read", error=str(exc))

    async def _topic_watch(self) -> None:
        """Topics deleted and created again while no request of theirs dropped records
        (`DedupEngine.confirm_topics`): without this, an idle partition's state, and the
        copy in Redis that other instances answer state reads from, would stay the old
        topic's until then."""
        while True:
            await asyncio.sleep(self.settings.topic_id_check_s)
            with background.one_pass("topic-watch"):
                try:
                    await self.engine.confirm_topics()
                except (OSError, TimeoutError) as exc:
                    log.warning("could not ask Kafka for topic ids", error=repr(exc))

    async def _purge_loop(self) -> None:
        idle_ms = int(self.settings.producer_idle_timeout_s * 1000)
        while True:
            await asyncio.sleep(min(PURGE_INTERVAL_S, self.settings.producer_idle_timeout_s))
            with background.one_pass("purge-idle-producers"):
                await self._purge_idle(idle_ms)

    async def _purge_idle(self, idle_ms: int) -> None:
        """One pass: the producers idle for longer than ``idle_ms`` forgotten, partition by
        partition; Redis failing ends the pass, and the next tries again."""
        states = self.engine.partition_states()
        for topic, partition in self.engine.partitions():
            older_than_ms = clock_ms() - idle_ms
            state = states.get((topic, partition))
            if state is None or not state.recovered:
                continue  # not this instance's to purge (or let go since the listing)
            table = state.sequences
            try:
                if table is not None:
                    # The maps here know when each producer was last checked (Redis's
                    # copy only when it was last acknowledged): they decide, the copy
                    # follows.
                    purged = table.purge_idle(older_than_ms)
                    await self.state.forget_producers(topic, partition, purged)
                else:
                    purged = await self.state.purge_idle(topic, partition, older_than_ms)
            except redis.RedisError as exc:
                log.warning("idle producer purge failed", error=str(exc))
                return
            if purged:
                log.info(
                    "purged idle producers", topic=topic, partition=partition, producers=purged
                )
