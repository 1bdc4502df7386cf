"""When Kafka will have ended a partition's open transactions (`dedup.transaction_deadlines`),
from its answers as kio decodes them, on links that answer from a table (the requests
against a real Kafka: tests/integration/test_recovery.py)."""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest
from kio.schema.describe_producers.v0 import response as producers
from kio.schema.describe_transactions.v0 import response as described
from kio.schema.errors import ErrorCode
from kio.schema.list_transactions.v0 import response as listed
from kio.schema.types import ProducerId, TopicName, TransactionalId
from kio.static.primitive import i16, i32, i32Timedelta, i64

from dedup.transaction_deadlines import (
    ABORT_MARGIN_S,
    TRANSACTIONS_LANE,
    DeadlineUnknown,
    TransactionDeadlines,
)
from proxy.kafka.topology import Endpoint

pytestmark = pytest.mark.unit

A, B, C = Endpoint("kafka-a", 9092), Endpoint("kafka-b", 9092), Endpoint("kafka-c", 9092)
NO_TIME = i32Timedelta.parse(datetime.timedelta(0))
STARTED = datetime.datetime(2026, 12, 3, 12, 0, tzinfo=datetime.UTC)


def producer_state(producer_id: int, txn_start: int) -> producers.ProducerState:
    return producers.ProducerState(
        producer_id=ProducerId(producer_id),
        producer_epoch=i32(0),
        coordinator_epoch=i32(0),
        current_txn_start_offset=i64(txn_start),
    )


def open_producers(
    error: ErrorCode, *states: producers.ProducerState, partition: tuple[str, int] = ("t", 0)
) -> Any:
    """One broker's DescribeProducers answer for one partition."""
    return leading({partition: (error, states)})


def leading(
    partitions: dict[tuple[str, int], tuple[ErrorCode, tuple[producers.ProducerState, ...]]],
) -> Any:
    """One broker's DescribeProducers answer for several partitions."""
    topics: dict[str, list[producers.PartitionResponse]] = {}
    for (topic, index), (error, states) in partitions.items():
        topics.setdefault(topic, []).append(
            producers.PartitionResponse(
                partition_index=i32(index), error_code=error, active_producers=states
            )
        )
    return producers.DescribeProducersResponse(
        throttle_time=NO_TIME,
        topics=tuple(
            producers.TopicResponse(name=TopicName(name), partitions=tuple(answers))
            for name, answers in topics.items()
        ),
    )


def transactions(*ids: tuple[str, int]) -> Any:
    return listed.ListTransactionsResponse(
        throttle_time=NO_TIME,
        error_code=ErrorCode.none,
        transaction_states=tuple(
            listed.TransactionState(
                transactional_id=TransactionalId(tid),
                producer_id=ProducerId(pid),
                transaction_state="Ongoing",
            )
            for tid, pid in ids
        ),
    )


def description(*states: tuple[str, str, int]) -> Any:
    """A DescribeTransactions answer: (transactional id, state, timeout in seconds) each."""
    return described.DescribeTransactionsResponse(
        throttle_time=NO_TIME,
        transaction_states=tuple(
            described.TransactionState(
                error_code=ErrorCode.none,
                transactional_id=TransactionalId(tid),
                transaction_state=state,
                transaction_timeout=i32Timedelta.parse(datetime.timedelta(seconds=timeout_s)),
                transaction_start_time=STARTED,
                producer_id=ProducerId(1),
                producer_epoch=i16(0),
                topics=(),
            )
            for tid, state, timeout_s in states
        ),
    )


async def of_t0(cluster: Cluster, below: int) -> float:
    """Partition t/0's deadline, asked alone; raises why Kafka did not tell it."""
    answer = (await cluster.deadlines().latest({("t", 0): below}))[("t", 0)]
    if isinstance(answer, DeadlineUnknown):
        raise answer
    return answer


class Cluster:
    """Each broker's answer per request type; the requests each broker was asked."""

    def __init__(self, answers: dict[Endpoint, dict[str, Any]]) -> None:
        self.answers = answers
        self.asked: list[tuple[Endpoint, str]] = []

    async def connect(self, broker: Endpoint, lane: int) -> Any:
        assert lane == TRANSACTIONS_LANE
        cluster = self

        class Link:
            async def request(self, payload: Any) -> Any:
                kind = type(payload).__name__
                cluster.asked.append((broker, kind))
                answer = cluster.answers[broker].get(kind, cluster.answers[broker].get("any"))
                if isinstance(answer, Exception):
                    raise answer
                return answer

        return Link()

    def deadlines(self) -> TransactionDeadlines:
        return TransactionDeadlines(self.connect, lambda: list(self.answers))


async def test_the_deadline_is_the_latest_start_plus_timeout_of_the_transactions_below() -> None:
    cluster = Cluster(
        {
            A: {  # not the leader; coordinates tx-1
                "DescribeProducersRequest": open_producers(ErrorCode.not_leader_or_follower),
                "ListTransactionsRequest": transactions(("tx-1", 1)),
                "DescribeTransactionsRequest": description(("tx-1", "Ongoing", 600)),
            },
            B: {  # the leader: 1 began at 5, 2 at 9 (not below 9), 3 has none open
                "DescribeProducersRequest": open_producers(
                    ErrorCode.none,
                    producer_state(1, 5),
                    producer_state(2, 9),
                    producer_state(3, -1),
                ),
                "ListTransactionsRequest": transactions(),
            },
        }
    )
    deadline = await of_t0(cluster, 9)
    assert deadline == STARTED.timestamp() + 600 + ABORT_MARGIN_S
    assert (A, "DescribeTransactionsRequest") in cluster.asked
    assert (B, "DescribeTransactionsRequest") not in cluster.asked


async def test_a_decided_transaction_ends_with_its_markers_and_none_open_is_now() -> None:
    answers = {
        "DescribeProducersRequest": open_producers(ErrorCode.none, producer_state(1, 0)),
        "ListTransactionsRequest": transactions(("tx-1", 1)),
        "DescribeTransactionsRequest": description(("tx-1", "PrepareAbort", 600)),
    }
    before = time.time()
    deadline = await of_t0(Cluster({A: answers}), 1)
    assert before + ABORT_MARGIN_S <= deadline <= time.time() + ABORT_MARGIN_S
    assert before <= await of_t0(Cluster({A: answers}), 0) <= time.time()


async def test_what_kafka_does_not_tell_leaves_the_deadline_unknown() -> None:
    unlisted = {  # no DESCRIBE on the transactional id: Kafka leaves it out of the list
        "DescribeProducersRequest": open_producers(ErrorCode.none, producer_state(1, 0)),
        "ListTransactionsRequest": transactions(),
    }
    with pytest.raises(DeadlineUnknown, match=r"no broker lists the transaction of producer 1"):
        await of_t0(Cluster({A: unlisted}), 1)
    leaderless = {"DescribeProducersRequest": open_producers(ErrorCode.not_leader_or_follower)}
    with pytest.raises(DeadlineUnknown, match="no broker that answered leads t/0"):
        await of_t0(Cluster({A: leaderless}), 1)
    refused = {"DescribeProducersRequest": open_producers(ErrorCode.topic_authorization_failed)}
    with pytest.raises(DeadlineUnknown, match="topic_authorization_failed"):
        await of_t0(Cluster({A: refused}), 1)


async def test_a_broker_that_does_not_answer_is_passed_over() -> None:
    """A broker that went down is often why a partition is being recovered; one that
    coordinated an open transaction leaves it unlisted, so its deadline unknown."""
    live = {
        "DescribeProducersRequest": open_producers(ErrorCode.none, producer_state(1, 0)),
        "ListTransactionsRequest": transactions(("tx-1", 1)),
        "DescribeTransactionsRequest": description(("tx-1", "Ongoing", 60)),
    }
    cluster = Cluster({A: {"any": ConnectionRefusedError("down")}, B: live})
    deadline = await of_t0(cluster, 1)
    assert deadline == STARTED.timestamp() + 60 + ABORT_MARGIN_S
    coordinator_down = {**live, "ListTransactionsRequest": transactions()}
    cluster = Cluster({A: {"any": TimeoutError()}, B: coordinator_down})
    with pytest.raises(DeadlineUnknown, match="no broker lists"):
        await of_t0(cluster, 1)


async def test_the_leaders_answer_counts_over_another_brokers_error() -> None:
    """A broker whose metadata lags the controller's may not know the topic yet: its error
    stands only when no broker answers for the partition without one."""
    lagging = {"DescribeProducersRequest": open_producers(ErrorCode.unknown_topic_or_partition)}
    leader = {
        "DescribeProducersRequest": open_producers(ErrorCode.none, producer_state(1, 0)),
        "ListTransactionsRequest": transactions(("tx-1", 1)),
        "DescribeTransactionsRequest": description(("tx-1", "Ongoing", 60)),
    }
    for order in ({A: lagging, B: leader}, {B: leader, A: lagging}):
        lagging["ListTransactionsRequest"] = transactions()
        deadline = await of_t0(Cluster(order), below=1)
        assert deadline == STARTED.timestamp() + 60 + ABORT_MARGIN_S, list(order)
    with pytest.raises(DeadlineUnknown, match="unknown_topic_or_partition"):
        await of_t0(Cluster({A: lagging}), below=1)


async def test_the_partitions_of_one_recovery_are_asked_together() -> None:
    """A client that died inside a transaction over several partitions: each request is
    sent once for all of them; each partition gets the deadline of its own transactions,
    or its own reason why not; once every partition's leader answered DescribeProducers,
    the other brokers are not asked it."""
    not_leader = (ErrorCode.not_leader_or_follower, ())
    cluster = Cluster(
        {
            A: {  # leads t/0 and u/0; coordinates tx-1
                "DescribeProducersRequest": leading(
                    {
                        ("t", 0): (ErrorCode.none, (producer_state(1, 3),)),
                        ("t", 1): not_leader,
                        ("u", 0): (ErrorCode.none, (producer_state(1, 2), producer_state(2, 0))),
                    }
                ),
                "ListTransactionsRequest": transactions(("tx-1", 1)),
                "DescribeTransactionsRequest": description(("tx-1", "Ongoing", 60)),
            },
            B: {  # leads t/1 (tx-3, 600 s, and tx-1); coordinates tx-3; tx-2 unlisted
                "DescribeProducersRequest": leading(
                    {
                        ("t", 0): not_leader,
                        ("t", 1): (ErrorCode.none, (producer_state(3, 1), producer_state(1, 4))),
                        ("u", 0): not_leader,
                    }
                ),
                "ListTransactionsRequest": transactions(("tx-3", 3)),
                "DescribeTransactionsRequest": description(("tx-3", "Ongoing", 600)),
            },
            C: {
                "DescribeProducersRequest": AssertionError("asked after every leader answered"),
                "ListTransactionsRequest": transactions(),
            },
        }
    )
    answers = await cluster.deadlines().latest({("t", 0): 9, ("t", 1): 9, ("u", 0): 9})
    assert answers[("t", 0)] == STARTED.timestamp() + 60 + ABORT_MARGIN_S
    assert answers[("t", 1)] == STARTED.timestamp() + 600 + ABORT_MARGIN_S
    unknown = answers[("u", 0)]
    assert isinstance(unknown, DeadlineUnknown) and "producer 2" in str(unknown)
    assert sorted(cluster.asked) == sorted(
        [
            (A, "DescribeProducersRequest"),
            (B, "DescribeProducersRequest"),
            (A, "ListTransactionsRequest"),
            (B, "ListTransactionsRequest"),
            (C, "ListTransactionsRequest"),
            (A, "DescribeTransactionsRequest"),
            (B, "DescribeTransactionsRequest"),
        ]
    )
