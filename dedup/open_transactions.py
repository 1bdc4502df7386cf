"""Waiting for the transactions open in a partition's log to end, before a replay reads it.

A transaction still open below the end a recovery replays to holds the partition's last
stable offset below that end, and what it wrote is not decided yet:

- counted, and then aborted: its sequences read as persisted, so their re-send outside a
  transaction is dropped while acknowledged (lost);
- not counted, and then committed: their re-send is written a second time.

Only its end decides, so the recovery waits for it: until the last stable offset reaches
the end, up to a bound. A live client commits or aborts; a dead one's transaction is
aborted by Kafka's coordinator after its ``transaction.timeout.ms``, so the bound is that
deadline when Kafka tells it (`dedup.transaction_deadlines`), else
``replay_transaction_wait_s`` (60 s, the timeout's default). Past the bound the replay
reads the rest uncommitted, and that transaction's records count (`dedup.replay`): the
limit the README names.

The wait is asynchronous and outside the recovery's limit on parallel replays: a client
that dies in a transaction over many partitions holds each of them until Kafka aborts it,
and must not hold back the replays of every other partition meanwhile. librdkafka's calls
block, so each one runs in a worker thread, one at a time per waiting partition.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from confluent_kafka import Consumer, TopicPartition

POLL_S: Final = 0.1  # how often the last stable offset is asked while waiting
GROUP_ID: Final = "dedup-proxy-recovery"


@dataclass(frozen=True, slots=True)
class Waited:
    log_start: int  # the partition's log start offset, asked with `stable`
    stable: int  # the last stable offset when the wait ended
    seconds: float

    def decided(self, end: int) -> bool:
        """Whether every transaction below ``end`` ended (committed or aborted)."""
        return decided(self.stable, end)


def decided(stable: int, end: int) -> bool:
    """Whether every transaction below ``end`` ended, the last stable offset at ``stable``."""
    return stable >= end


def watermarks_consumer(bootstrap: str, config: Mapping[str, Any], *, committed: bool) -> Consumer:
    """A consumer that only asks watermarks: the log start and, ``committed``, the last
    stable offset, else the high watermark. ``config``: security settings."""
    return Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": GROUP_ID,
            "enable.auto.commit": False,
            "isolation.level": "read_committed" if committed else "read_uncommitted",
            "allow.auto.create.topics": False,
            **config,
        }
    )


async def wait_for_open_transactions(
    bootstrap: str,
    config: Mapping[str, Any],
    partition: TopicPartition,
    end: int,
    wait_s: float,
    *,
    request_timeout_s: float = 30.0,
    poll_s: float = POLL_S,
) -> Waited:
    """Ask the partition's last stable offset every ``poll_s`` until it reaches ``end`` or
    ``wait_s`` has passed (0: ask once). A failed request raises `KafkaException`."""
    if wait_s < 0:
        raise ValueError(f"wait_s must be >= 0, got {wait_s}")
    consumer = await asyncio.to_thread(watermarks_consumer, bootstrap, config, committed=True)
    began = time.monotonic()
    try:
        while True:
            low, stable = await asyncio.to_thread(
                consumer.get_watermark_offsets, partition, request_timeout_s
            )
            waited = Waited(low, stable, time.monotonic() - began)
            if waited.decided(end) or waited.seconds >= wait_s:
                return waited
            await asyncio.sleep(min(poll_s, wait_s - waited.seconds))
    finally:
        await asyncio.to_thread(consumer.close)
