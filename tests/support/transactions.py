"""Transactions left open by a client, and what the proxy's lookup of their deadlines
(`dedup.transaction_deadlines`) answers for them, against a real Kafka."""

from __future__ import annotations

import uuid
from typing import Any

from confluent_kafka import Producer

from dedup.links import UpstreamLinks
from dedup.transaction_deadlines import DeadlineUnknown, TransactionDeadlines
from proxy.kafka.topology import Endpoint
from proxy.kafka.upstream_client import PLAINTEXT, LinkSecurity

Partition = tuple[str, int]


def begun_transaction(
    bootstrap: str, timeout_s: float, transactional_id: str | None = None, **config: Any
) -> Producer:
    """A transactional client whose transaction has begun (Kafka aborts it after
    ``timeout_s`` unless it ends before); ``config``: security settings."""
    client = Producer(
        {
            "bootstrap.servers": bootstrap,
            "transactional.id": transactional_id or f"tx-{uuid.uuid4().hex[:8]}",
            "transaction.timeout.ms": int(timeout_s * 1000),
            **config,
        }
    )
    client.init_transactions(30)
    client.begin_transaction()
    return client


def open_transaction(
    bootstrap: str,
    timeout_s: int,
    *where: Partition,
    transactional_id: str | None = None,
    **config: Any,
) -> Producer:
    """A transactional client with a record in each of ``where`` and its transaction left
    open (Kafka aborts it after ``timeout_s``); ``config``: security settings."""
    client = begun_transaction(bootstrap, timeout_s, transactional_id, **config)
    for topic, partition in where:
        client.produce(topic, b"open", partition=partition)
    assert client.flush(30) == 0
    return client


async def deadlines(
    bootstrap: str, below: dict[Partition, int], security: LinkSecurity = PLAINTEXT
) -> dict[Partition, float | DeadlineUnknown]:
    """What the proxy's lookup answers, on connections of its own to the first broker."""
    broker = Endpoint.parse(bootstrap.split(",")[0])
    links = UpstreamLinks(10.0, security)
    try:
        return await TransactionDeadlines(links.get, lambda: [broker]).latest(below)
    finally:
        await links.close()
