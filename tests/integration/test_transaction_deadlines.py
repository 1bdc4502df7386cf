"""When Kafka will have ended the transactions open in partitions (`dedup.transaction_deadlines`),
asked of a real Kafka: DescribeProducers over several topics and partitions in one request,
ListTransactions, DescribeTransactions; each partition's deadline from its own open
transactions, only those that began below its offset."""

from __future__ import annotations

import asyncio
import time

import pytest
from confluent_kafka import Producer

from dedup.transaction_deadlines import ABORT_MARGIN_S, DeadlineUnknown
from deploy.local import EnvInfo
from tests.support.kafka_io import end_offset
from tests.support.topics import new_topic
from tests.support.transactions import deadlines, open_transaction

pytestmark = pytest.mark.integration

UNCOMMITTED = {"isolation.level": "read_uncommitted"}  # the end, not the last stable offset


def test_each_partition_gets_the_deadline_of_its_own_open_transactions(
    local_env: EnvInfo,
) -> None:
    bootstrap = local_env.bootstrap
    many, one, quiet = (
        new_topic(bootstrap, partitions=2),
        new_topic(bootstrap),
        new_topic(bootstrap),
    )
    plain = Producer({"bootstrap.servers": bootstrap})
    for _ in range(2):  # many/0 holds two committed records before the transactions
        plain.produce(many, b"before", partition=0)
        plain.produce(quiet, b"before", partition=0)
    assert plain.flush(30) == 0
    began = time.time()
    short = open_transaction(bootstrap, 20, (many, 0), (many, 1), (one, 0))
    long = open_transaction(bootstrap, 40, (many, 1))
    opened = time.time()
    try:
        ends = {
            (topic, partition): end_offset(bootstrap, topic, partition, **UNCOMMITTED)
            for topic, partition in [(many, 0), (many, 1), (one, 0), (quiet, 0)]
        }
        asked = time.time()
        found = asyncio.run(deadlines(bootstrap, ends))
        answered = time.time()

        def ends_within(key: tuple[str, int], timeout_s: int) -> None:
            deadline = found[key]
            assert not isinstance(deadline, DeadlineUnknown), deadline
            low, high = began + timeout_s + ABORT_MARGIN_S, opened + timeout_s + ABORT_MARGIN_S
            assert low - 2 <= deadline <= high + 2, (key, deadline - low)

        ends_within((many, 0), 20)
        ends_within((one, 0), 20)
        ends_within((many, 1), 40)  # the later of its two transactions
        assert asked <= found[(quiet, 0)] <= answered, "nothing open: now"
        # Only transactions that began below the offset asked about: many/0's began at 2.
        before_it = asyncio.run(deadlines(bootstrap, {(many, 0): 2}))[(many, 0)]
        assert not isinstance(before_it, DeadlineUnknown) and before_it <= time.time()
        missing = asyncio.run(deadlines(bootstrap, {(many, 7): 1}))[(many, 7)]
        assert isinstance(missing, DeadlineUnknown), missing
    finally:
        short.abort_transaction(30)
        long.abort_transaction(30)
