"""When Kafka will have ended the transactions open in a partition below an offset.

A recovery waits for the transactions open below the end it replays to
(`dedup.open_transactions`). A fixed wait is right only for clients whose
``transaction.timeout.ms`` is below it, and a client may set up to the brokers'
``transaction.max.timeout.ms`` (15 min by default). So the recovery asks Kafka for each
open transaction's own deadline, with the admin APIs that Kafka's ``kafka-transactions.sh`` uses:

- DescribeProducers (Kafka 2.8+), of the partition's leader: the producers with a
  transaction open in the partition, and the offset each began at;
- ListTransactions, of every broker (each answers for the transactions it coordinates):
  the transactional id of each such producer;
- DescribeTransactions, of the broker that listed it (its coordinator): its start time and
  timeout.

Kafka's coordinator aborts a transaction whose start plus timeout has passed at its next
check (``transaction.abort.timed.out.transaction.cleanup.interval.ms``, 10 s by default),
so the deadline is the latest start plus timeout, plus `ABORT_MARGIN_S`. Anything not
learned (a producer no broker lists: no DESCRIBE on its transactional id, or an older
Kafka; a broker that does not answer) gives no deadline, and the caller keeps its fixed
wait. The requests go on a connection of their own per broker.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Final, Protocol

from kio.schema.describe_producers.v0.request import DescribeProducersRequest, TopicRequest
from kio.schema.describe_transactions.v0.request import DescribeTransactionsRequest
from kio.schema.errors import ErrorCode
from kio.schema.list_transactions.v0.request import ListTransactionsRequest
from kio.schema.types import ProducerId, TopicName, TransactionalId
from kio.static.primitive import i32

from proxy.kafka.topology import Endpoint

TRANSACTIONS_LANE: Final = -2  # apart from the writer's lanes and the metadata lane (-1)
# Kafka's check for timed-out transactions runs every 10 s by default; then the markers.
ABORT_MARGIN_S: Final = 30.0
ONGOING: Final = "Ongoing"
# Decided by the coordinator, or being fenced: over once its markers are written. (A
# completed or empty one is not asked: its start time may be -1, which kio does not read.)
_ENDING: Final = ("PrepareCommit", "PrepareAbort", "PrepareEpochFence")


class AdminLink(Protocol):
    """A connection to a broker (`proxy.kafka.upstream_client.UpstreamClient`)."""

    async def request(self, payload: Any) -> Any: ...


class DeadlineUnknown(Exception):
    """Kafka did not tell an open transaction's deadline."""


class TransactionDeadlines:
    def __init__(
        self,
        connect: Callable[[Endpoint, int], Awaitable[AdminLink]],
        known_upstreams: Callable[[], Sequence[Endpoint]],
    ) -> None:
        self._connect = connect  # (broker, lane) -> an open connection (`dedup.links`)
        self._known_upstreams = known_upstreams

    async def latest(self, topic: str, partition: int, below: int) -> float:
        """The time (epoch seconds) by which Kafka will have ended every transaction open in
        the partition that began below offset ``below``: now when there is none. Raises
        `DeadlineUnknown`, or OSError / TimeoutError when a coordinator does not answer."""
        producers = await self._open_producers(topic, partition, below)
        if not producers:
            return time.time()
        coordinators = await self._coordinators(producers)
        missing = producers - {pid for _broker, _tid, pid in coordinators}
        if missing:
            raise DeadlineUnknown(f"no broker lists the transaction of producers {sorted(missing)}")
        deadline = 0.0
        for broker in {broker for broker, _tid, _pid in coordinators}:
            ids = tuple(tid for b, tid, _pid in coordinators if b == broker)
            deadline = max(deadline, await self._deadline(broker, ids))
        return deadline + ABORT_MARGIN_S

    async def _open_producers(self, topic: str, partition: int, below: int) -> set[int]:
        """The producer ids with a transaction open in the partition that began below
        ``below``, as its leader tells them (a broker that does not lead it says so)."""
        request = DescribeProducersRequest(
            topics=(TopicRequest(name=TopicName(topic), partition_indexes=(i32(partition),)),)
        )
        async for _broker, response in self._answers(request):
            for found in (p for t in response.topics for p in t.partitions):
                if found.error_code == ErrorCode.not_leader_or_follower:
                    continue
                if found.error_code != ErrorCode.none:
                    where = f"{topic}/{partition}"
                    raise DeadlineUnknown(f"DescribeProducers of {where}: {found.error_code!r}")
                return {
                    int(p.producer_id)
                    for p in found.active_producers
                    if 0 <= p.current_txn_start_offset < below
                }
        raise DeadlineUnknown(f"no broker that answered leads {topic}/{partition}")

    async def _coordinators(self, producers: set[int]) -> list[tuple[Endpoint, str, int]]:
        """(coordinator, transactional id, producer id) of the producers' transactions, as
        the brokers that answer list them (the caller finds out one that is missing)."""
        request = ListTransactionsRequest(
            state_filters=(ONGOING, *_ENDING),
            producer_id_filters=tuple(ProducerId(p) for p in sorted(producers)),
        )
        found = []
        async for broker, response in self._answers(request):
            if response.error_code == ErrorCode.none:
                found += [
                    (broker, str(state.transactional_id), int(state.producer_id))
                    for state in response.transaction_states
                    if int(state.producer_id) in producers
                ]
        return found

    async def _answers(self, request: Any) -> AsyncIterator[tuple[Endpoint, Any]]:
        """Each known broker's answer, in turn; one that does not answer is passed over (a
        broker that went down is often why a partition is being recovered)."""
        for broker in self._known_upstreams():
            try:
                link = await self._connect(broker, TRANSACTIONS_LANE)
                response = await link.request(request)
            except (OSError, TimeoutError):
                continue
            yield broker, response

    async def _deadline(self, coordinator: Endpoint, ids: tuple[str, ...]) -> float:
        request = DescribeTransactionsRequest(transactional_ids=tuple(map(TransactionalId, ids)))
        link = await self._connect(coordinator, TRANSACTIONS_LANE)
        deadline = 0.0
        for state in (await link.request(request)).transaction_states:
            if state.error_code != ErrorCode.none:
                name = state.transactional_id
                raise DeadlineUnknown(f"DescribeTransactions of {name}: {state.error_code!r}")
            if state.transaction_state == ONGOING:
                started = state.transaction_start_time.timestamp()
                deadline = max(deadline, started + state.transaction_timeout.total_seconds())
            else:
                deadline = max(deadline, time.time())
        return deadline
