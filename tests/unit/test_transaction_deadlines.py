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

A, B = Endpoint("kafka-a", 9092), Endpoint("kafka-b", 9092)
NO_TIME = i32Timedelta.parse(datetime.timedelta(0))
STARTED = datetime.datetime(2026, 12, 3, 12, 0, tzinfo=datetime.UTC)


def producer_state(producer_id: int, txn_start: int) -> producers.ProducerState:
    return producers.ProducerState(
        producer_id=ProducerId(producer_id),
        producer_epoch=i32(0),
        coordinator_epoch=i32(0),
        current_txn_start_offset=i64(txn_start),
    )


def open_producers(error: ErrorCode, *states: producers.ProducerState) -> Any:
    partition = producers.PartitionResponse(
        partition_index=i32(0), error_code=error, active_producers=states
    )
    topic = producers.TopicResponse(name=TopicName("t"), partitions=(partition,))
    return producers.DescribeProducersResponse(throttle_time=NO_TIME, topics=(topic,))


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


def description(tid: str, state: str, timeout_s: int) -> Any:
    return described.DescribeTransactionsResponse(
        throttle_time=NO_TIME,
        transaction_states=(
            described.TransactionState(
                error_code=ErrorCode.none,
                transactional_id=TransactionalId(tid),
                transaction_state=state,
                transaction_timeout=i32Timedelta.parse(datetime.timedelta(seconds=timeout_s)),
                transaction_start_time=STARTED,
                producer_id=ProducerId(1),
                producer_epoch=i16(0),
                topics=(),
            ),
        ),
    )


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
                "DescribeTransactionsRequest": description("tx-1", "Ongoing", 600),
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
    deadline = await cluster.deadlines().latest("t", 0, below=9)
    assert deadline == STARTED.timestamp() + 600 + ABORT_MARGIN_S
    assert (A, "DescribeTransactionsRequest") in cluster.asked
    assert (B, "DescribeTransactionsRequest") not in cluster.asked


async def test_a_decided_transaction_ends_with_its_markers_and_none_open_is_now() -> None:
    answers = {
        "DescribeProducersRequest": open_producers(ErrorCode.none, producer_state(1, 0)),
        "ListTransactionsRequest": transactions(("tx-1", 1)),
        "DescribeTransactionsRequest": description("tx-1", "PrepareAbort", 600),
    }
    before = time.time()
    deadline = await Cluster({A: answers}).deadlines().latest("t", 0, below=1)
    assert before + ABORT_MARGIN_S <= deadline <= time.time() + ABORT_MARGIN_S
    assert before <= await Cluster({A: answers}).deadlines().latest("t", 0, below=0) <= time.time()


async def test_what_kafka_does_not_tell_leaves_the_deadline_unknown() -> None:
    unlisted = {  # no DESCRIBE on the transactional id: Kafka leaves it out of the list
        "DescribeProducersRequest": open_producers(ErrorCode.none, producer_state(1, 0)),
        "ListTransactionsRequest": transactions(),
    }
    with pytest.raises(
        DeadlineUnknown, match=r"no broker lists the transaction of producers \[1\]"
    ):
        await Cluster({A: unlisted}).deadlines().latest("t", 0, below=1)
    leaderless = {"DescribeProducersRequest": open_producers(ErrorCode.not_leader_or_follower)}
    with pytest.raises(DeadlineUnknown, match="no broker that answered leads t/0"):
        await Cluster({A: leaderless}).deadlines().latest("t", 0, below=1)
    refused = {"DescribeProducersRequest": open_producers(ErrorCode.topic_authorization_failed)}
    with pytest.raises(DeadlineUnknown, match="topic_authorization_failed"):
        await Cluster({A: refused}).deadlines().latest("t", 0, below=1)


async def test_a_broker_that_does_not_answer_is_passed_over() -> None:
    """A broker that went down is often why a partition is being recovered; one that
    coordinated an open transaction leaves it unlisted, so its deadline unknown."""
    live = {
        "DescribeProducersRequest": open_producers(ErrorCode.none, producer_state(1, 0)),
        "ListTransactionsRequest": transactions(("tx-1", 1)),
        "DescribeTransactionsRequest": description("tx-1", "Ongoing", 60),
    }
    cluster = Cluster({A: {"any": ConnectionRefusedError("down")}, B: live})
    deadline = await cluster.deadlines().latest("t", 0, below=1)
    assert deadline == STARTED.timestamp() + 60 + ABORT_MARGIN_S
    coordinator_down = {**live, "ListTransactionsRequest": transactions()}
    cluster = Cluster({A: {"any": TimeoutError()}, B: coordinator_down})
    with pytest.raises(DeadlineUnknown, match="no broker lists"):
        await cluster.deadlines().latest("t", 0, below=1)
