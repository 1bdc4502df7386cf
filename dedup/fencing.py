"""Making the end of a partition final before a replay trusts it.

A proxy killed with writes in flight may leave a Produce request in a socket buffer or
waiting for replication: appended later, or appended and then truncated. A replay that
stops at today's end of the partition would miss such a write, and the client's re-send
of it would then be written a second time. Pulsar gets a final end from BookKeeper's
ledger fencing; this module gets it from Kafka's own zombie fencing:

- The proxy's idempotent writer takes its producer id from InitProducerId with a
  transactional id that is stable per proxy instance (``instance_id``). Its batches are
  plain idempotent batches (not transactional); the transactional id only ties every
  incarnation of the instance to the same producer id, with a rising epoch.
- InitProducerId from a new incarnation bumps that epoch. A partition leader learns of
  the bump only from a batch or a transaction marker of the new epoch, so to fence a
  partition the proxy adds it to an empty transaction and aborts it: the coordinator
  writes an ABORT marker of the new epoch to the partition (a control record, invisible
  to consumers in both isolation levels) with acks=all.
- Once the marker is in the partition, a late batch of any older epoch is refused with
  INVALID_PRODUCER_EPOCH, so it can never appear; and every batch the old incarnation got
  appended before the marker sits below the marker's offset. The marker is written with
  acks=all, so once the leader reports the new epoch the high watermark is past every
  such batch. A replay up to the high watermark read after that sees each of them.

So after `Fencer.fence`: every write of an older incarnation of this instance is either
below the partition's high watermark or never in the log.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import kio.schema.add_partitions_to_txn.v3.request as add_partitions
import kio.schema.describe_producers.v0.request as describe_producers
import kio.schema.end_txn.v3.request as end_txn
import kio.schema.find_coordinator.v4.request as find_coordinator
import kio.schema.init_producer_id.v4.request as init_pid
import structlog
from kio.schema.errors import ErrorCode
from kio.schema.types import ProducerId, TopicName, TransactionalId
from kio.static.primitive import i8, i16, i32, i32Timedelta

from proxy.kafka.topology import Endpoint
from proxy.kafka.upstream_client import UpstreamClient

log = structlog.get_logger(__name__)

_COORDINATOR_TRANSACTION = 1
# Worth another try after a moment (the coordinator moves, loads, or finishes a transaction).
_RETRIABLE = {
    ErrorCode.coordinator_load_in_progress,
    ErrorCode.coordinator_not_available,
    ErrorCode.not_coordinator,
    ErrorCode.concurrent_transactions,
    ErrorCode.request_timed_out,
    ErrorCode.not_leader_or_follower,
    ErrorCode.unknown_topic_or_partition,
    ErrorCode.network_exception,
}
_COORDINATOR_MOVED = {ErrorCode.coordinator_not_available, ErrorCode.not_coordinator}


class FenceError(Exception):
    """The partitions could not be fenced in time; the caller retries the recovery."""


@dataclass(frozen=True, slots=True)
class ProducerIdentity:
    producer_id: int
    epoch: int


LeaderLookup = Callable[[str, int], Awaitable[Endpoint | None]]
LinkFactory = Callable[[Endpoint], Awaitable[UpstreamClient]]


class Fencer:
    """The proxy instance's producer id, and the fence that makes older epochs harmless."""

    def __init__(
        self,
        transactional_id: str,
        bootstrap: Callable[[], Sequence[Endpoint]],
        leader_of: LeaderLookup,
        link: LinkFactory,
        *,
        timeout_s: float = 60.0,
        retry_backoff_s: float = 0.1,
    ) -> None:
        self.transactional_id = transactional_id
        self._bootstrap = bootstrap
        self._leader_of = leader_of
        self._link = link
        self._timeout_s = timeout_s
        self._retry_backoff_s = retry_backoff_s
        self._coordinator: Endpoint | None = None
        self._lock = asyncio.Lock()  # one transaction at a time per transactional id

    async def new_epoch(self) -> ProducerIdentity:
        """InitProducerId: the instance's producer id with the next epoch. Every batch of
        an older epoch is refused wherever a batch or marker of this one has landed."""
        async with self._lock:
            return await self._init_producer_id(time.monotonic() + self._timeout_s)

    async def fence(self, partitions: Iterable[tuple[str, int]]) -> ProducerIdentity:
        """Bump the epoch and write a marker of it to every partition; return the identity
        to write those partitions with (from sequence 0). Raises FenceError on timeout."""
        wanted = sorted(set(partitions))
        if not wanted:
            raise ValueError("nothing to fence")
        deadline = time.monotonic() + self._timeout_s
        async with self._lock:
            identity = await self._init_producer_id(deadline)
            await self._add_partitions(identity, wanted, deadline)
            await self._abort(identity, deadline)
        await self._await_markers(identity, wanted, deadline)
        log.info(
            "partitions fenced",
            producer_id=identity.producer_id,
            epoch=identity.epoch,
            partitions=len(wanted),
        )
        return identity

    # ------------------------------------------------------------- coordinator requests

    async def _init_producer_id(self, deadline: float) -> ProducerIdentity:
        request = init_pid.InitProducerIdRequest(
            transactional_id=TransactionalId(self.transactional_id),
            transaction_timeout=i32Timedelta.parse(datetime.timedelta(minutes=1)),
        )
        response = await self._coordinator_call(request, lambda r: r.error_code, deadline)
        identity = ProducerIdentity(int(response.producer_id), int(response.producer_epoch))
        log.info(
            "upstream producer id",
            transactional_id=self.transactional_id,
            producer_id=identity.producer_id,
            epoch=identity.epoch,
        )
        return identity

    async def _add_partitions(
        self, identity: ProducerIdentity, partitions: Sequence[tuple[str, int]], deadline: float
    ) -> None:
        by_topic: dict[str, list[int]] = {}
        for topic, partition in partitions:
            by_topic.setdefault(topic, []).append(partition)
        request = add_partitions.AddPartitionsToTxnRequest(
            v3_and_below_transactional_id=TransactionalId(self.transactional_id),
            v3_and_below_producer_id=ProducerId(identity.producer_id),
            v3_and_below_producer_epoch=i16(identity.epoch),
            v3_and_below_topics=tuple(
                add_partitions.AddPartitionsToTxnTopic(
                    name=TopicName(topic), partitions=tuple(i32(p) for p in numbers)
                )
                for topic, numbers in by_topic.items()
            ),
        )

        def first_error(response: Any) -> ErrorCode:
            for topic in response.results_by_topic_v3_and_below:
                for result in topic.results_by_partition:
                    code = ErrorCode(result.partition_error_code)
                    # OPERATION_NOT_ATTEMPTED: only an echo of another partition's error.
                    if code not in (ErrorCode.none, ErrorCode.operation_not_attempted):
                        return code
            return ErrorCode.none

        await self._coordinator_call(request, first_error, deadline)

    async def _abort(self, identity: ProducerIdentity, deadline: float) -> None:
        request = end_txn.EndTxnRequest(
            transactional_id=TransactionalId(self.transactional_id),
            producer_id=ProducerId(identity.producer_id),
            producer_epoch=i16(identity.epoch),
            committed=False,
        )
        await self._coordinator_call(request, lambda r: r.error_code, deadline)

    async def _coordinator_call(
        self, request: Any, error_of: Callable[[Any], Any], deadline: float
    ) -> Any:
        """Send to the transaction coordinator until it answers without a retriable error."""
        while True:
            code: ErrorCode | None = None
            try:
                coordinator = await self._find_coordinator(deadline)
                response = await (await self._link(coordinator)).request(request)
                code = ErrorCode(error_of(response))
            except (OSError, TimeoutError) as exc:
                log.debug("transaction coordinator unreachable", error=str(exc))
                self._coordinator = None
            if code is ErrorCode.none:
                return response
            if code is not None and code not in _RETRIABLE:
                raise FenceError(
                    f"{type(request).__name__} for {self.transactional_id!r} failed: {code.name}"
                )
            if code in _COORDINATOR_MOVED:
                self._coordinator = None
            await self._pause(deadline, f"{type(request).__name__}: {code}")

    async def _find_coordinator(self, deadline: float) -> Endpoint:
        while self._coordinator is None:
            request = find_coordinator.FindCoordinatorRequest(
                key_type=i8(_COORDINATOR_TRANSACTION), coordinator_keys=(self.transactional_id,)
            )
            for endpoint in self._bootstrap():
                try:
                    response = await (await self._link(endpoint)).request(request)
                except (OSError, TimeoutError):
                    continue
                (found,) = response.coordinators
                if ErrorCode(found.error_code) is ErrorCode.none:
                    self._coordinator = Endpoint(found.host, int(found.port))
                    break
            else:
                await self._pause(deadline, "no transaction coordinator")
        return self._coordinator

    # ------------------------------------------------------------- partition leaders

    async def _await_markers(
        self, identity: ProducerIdentity, partitions: Sequence[tuple[str, int]], deadline: float
    ) -> None:
        """Until each leader reports the new epoch for the producer id: the marker is in."""
        waiting = set(partitions)
        while waiting:
            for topic, partition in sorted(waiting):
                if await self._leader_has_epoch(identity, topic, partition):
                    waiting.discard((topic, partition))
            if waiting:
                await self._pause(deadline, f"markers pending on {len(waiting)} partitions")

    async def _leader_has_epoch(
        self, identity: ProducerIdentity, topic: str, partition: int
    ) -> bool:
        leader = await self._leader_of(topic, partition)
        if leader is None:
            return False
        request = describe_producers.DescribeProducersRequest(
            topics=(
                describe_producers.TopicRequest(
                    name=TopicName(topic), partition_indexes=(i32(partition),)
                ),
            )
        )
        try:
            response = await (await self._link(leader)).request(request)
        except (OSError, TimeoutError):
            return False
        (found,) = response.topics[0].partitions
        if ErrorCode(found.error_code) is not ErrorCode.none:
            return False
        return any(
            int(state.producer_id) == identity.producer_id
            and int(state.producer_epoch) >= identity.epoch
            and int(state.current_txn_start_offset) < 0
            for state in found.active_producers
        )

    async def _pause(self, deadline: float, waiting_for: str) -> None:
        if time.monotonic() >= deadline:
            raise FenceError(f"fencing timed out waiting for {waiting_for}")
        await asyncio.sleep(self._retry_backoff_s)
