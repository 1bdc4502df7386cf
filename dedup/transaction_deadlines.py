"""When Kafka will have ended the transactions open in partitions below an offset each.

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
so a partition's deadline is the latest start plus timeout of its open transactions, plus
`ABORT_MARGIN_S`. Anything not learned (a producer no broker lists: no DESCRIBE on its
transactional id, or an older Kafka; no READ on the topic; a broker that does not answer)
leaves that partition's deadline unknown, and the caller keeps its fixed wait.

The partitions of one recovery are asked together: a client that died inside a
transaction over many partitions costs each request once, not once per partition. The
requests go on a connection of their own per broker.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
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


Partition = tuple[str, int]


class TransactionDeadlines:
    def __init__(
        self,
        connect: Callable[[Endpoint, int], Awaitable[AdminLink]],
        known_upstreams: Callable[[], Sequence[Endpoint]],
    ) -> None:
        self._connect = connect  # (broker, lane) -> an open connection (`dedup.links`)
        self._known_upstreams = known_upstreams

    async def latest(
        self, below: Mapping[Partition, int]
    ) -> dict[Partition, float | DeadlineUnknown]:
        """Per partition, the time (epoch seconds) by which Kafka will have ended every
        transaction open in it that began below its offset in ``below`` (now when there is
        none), or why Kafka did not tell it. Raises OSError / TimeoutError when a
        coordinator does not answer."""
        opened = await self._open_producers(below)
        producers = set().union(*(p for p in opened.values() if isinstance(p, set)))
        ends = await self._ends(producers) if producers else {}
        answers: dict[Partition, float | DeadlineUnknown] = {}
        for key, found in opened.items():
            if isinstance(found, DeadlineUnknown):
                answers[key] = found
                continue
            of_key = [ends[pid] for pid in sorted(found)]
            unknown = [end for end in of_key if isinstance(end, DeadlineUnknown)]
            known = [end for end in of_key if not isinstance(end, DeadlineUnknown)]
            if unknown:
                answers[key] = unknown[0]
            elif known:
                answers[key] = max(known) + ABORT_MARGIN_S
            else:  # nothing open below its offset
                answers[key] = time.time()
        return answers

    async def _open_producers(
        self, below: Mapping[Partition, int]
    ) -> dict[Partition, set[int] | DeadlineUnknown]:
        """Per partition, the producer ids with a transaction open in it that began below
        its offset, as its leader tells them (a broker that does not lead it says so); an
        error only when no broker answered it without one."""
        by_topic: dict[str, list[int]] = {}
        for topic, partition in sorted(below):
            by_topic.setdefault(topic, []).append(partition)
        request = DescribeProducersRequest(
            topics=tuple(
                TopicRequest(name=TopicName(topic), partition_indexes=tuple(map(i32, indexes)))
                for topic, indexes in by_topic.items()
            )
        )
        found: dict[Partition, set[int]] = {}
        refused: dict[Partition, DeadlineUnknown] = {}  # unless its leader answers after all
        async with contextlib.aclosing(self._answers(request)) as answers:
            async for _broker, response in answers:
                for topic in response.topics:
                    for answer in topic.partitions:
                        key = (str(topic.name), int(answer.partition_index))
                        if key in below and key not in found:
                            _read_producers(key, answer, below[key], found, refused)
                if len(found) == len(below):
                    break  # every partition's leader answered: no other broker is asked
        lost = {
            key: DeadlineUnknown(f"no broker that answered leads {key[0]}/{key[1]}")
            for key in below
        }
        told: dict[Partition, set[int] | DeadlineUnknown] = {**lost, **refused, **found}
        return told  # the leader's answer, else an error answered, else none

    async def _ends(self, producers: set[int]) -> dict[int, float | DeadlineUnknown]:
        """Per producer id, when its coordinator will have ended its transaction (start
        plus timeout; now for one already decided), or why that is not known."""
        coordinators = await self._coordinators(producers)
        ends: dict[int, float | DeadlineUnknown] = {
            pid: DeadlineUnknown(f"no broker lists the transaction of producer {pid}")
            for pid in producers
        }
        for broker in {broker for broker, _tid, _pid in coordinators}:
            ids = {tid: pid for b, tid, pid in coordinators if b == broker}
            for tid, end in (await self._described(broker, tuple(ids))).items():
                if tid in ids:
                    ends[ids[tid]] = end
        return ends

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

    async def _answers(self, request: Any) -> AsyncGenerator[tuple[Endpoint, Any], None]:
        """Each known broker's answer, in turn; one that does not answer is passed over (a
        broker that went down is often why a partition is being recovered)."""
        for broker in self._known_upstreams():
            try:
                link = await self._connect(broker, TRANSACTIONS_LANE)
                response = await link.request(request)
            except (OSError, TimeoutError):
                continue
            yield broker, response

    async def _described(
        self, coordinator: Endpoint, ids: tuple[str, ...]
    ) -> dict[str, float | DeadlineUnknown]:
        """Per transactional id, when its coordinator will have ended its transaction."""
        request = DescribeTransactionsRequest(transactional_ids=tuple(map(TransactionalId, ids)))
        link = await self._connect(coordinator, TRANSACTIONS_LANE)
        ends: dict[str, float | DeadlineUnknown] = {}
        for state in (await link.request(request)).transaction_states:
            name = str(state.transactional_id)
            if state.error_code != ErrorCode.none:
                ends[name] = DeadlineUnknown(
                    f"DescribeTransactions of {name}: {state.error_code!r}"
                )
            elif state.transaction_state == ONGOING:
                started = state.transaction_start_time.timestamp()
                ends[name] = started + state.transaction_timeout.total_seconds()
            else:
                ends[name] = time.time()
        return ends


def _read_producers(
    key: Partition,
    answer: Any,
    below: int,
    found: dict[Partition, set[int]],
    refused: dict[Partition, DeadlineUnknown],
) -> None:
    """What one broker's DescribeProducers answer tells of a partition: nothing when it
    does not lead it; else the producers with a transaction open below ``below``, or the
    error it answered (a broker whose metadata lags may not know the topic yet)."""
    if answer.error_code == ErrorCode.not_leader_or_follower:
        return
    if answer.error_code != ErrorCode.none:
        why = f"DescribeProducers of {key[0]}/{key[1]}: {answer.error_code!r}"
        refused[key] = DeadlineUnknown(why)
        return
    found[key] = {
        int(p.producer_id)
        for p in answer.active_producers
        if 0 <= p.current_txn_start_offset < below
    }
