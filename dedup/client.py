"""A producer that sets the dedup identity for you: confluent-kafka's Producer, plus names
and sequence ids (Pulsar's producer name, sequence id and getLastSequenceId).

    from dedup.client import DedupProducer

    producer = DedupProducer("proxy:9092", producer_name="orders-loader",
                             admin_url="http://proxy:9190")
    start = producer.last_sequence_id("orders") + 1     # resume after a restart
    for row_number, row in enumerate(rows[start:], start):
        producer.send("orders", row, sequence_id=row_number)
    producer.flush()

Without ``sequence_id`` the producer numbers messages itself, per topic, continuing from
``initial_sequence_id`` or, when that is None, from what the proxy persisted for this
producer (so a restarted producer does not reuse ids). Retries are unlimited by default:
a message is given up only when the caller says so (``message.timeout.ms``).
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

from confluent_kafka import Producer

from dedup.batches import HEADER_PRODUCER, HEADER_SEQUENCE

DeliveryCallback = Callable[[Any, Any], None]

# Unlimited retries, and the ordering guarantee that makes them safe: librdkafka's
# idempotent producer never lets message n+1 overtake a retried message n, so a re-sent
# message can never be classified as an old duplicate of a later one.
_DEFAULTS: dict[str, Any] = {
    "enable.idempotence": True,
    "message.timeout.ms": 0,
    "linger.ms": 5,
}


class DedupProducer:
    def __init__(
        self,
        bootstrap_servers: str,
        producer_name: str | None = None,
        initial_sequence_id: int | None = None,
        admin_url: str | None = None,
        **confluent_config: Any,
    ) -> None:
        self._admin_url = admin_url.rstrip("/") if admin_url else None
        self.producer_name = producer_name or self._assign_name()
        if not self.producer_name:
            raise ValueError("producer_name must not be empty")
        self._initial = initial_sequence_id
        self._next: dict[str, int] = {}
        config = {**_DEFAULTS, **confluent_config, "bootstrap.servers": bootstrap_servers}
        self._producer = Producer(config)

    def send(
        self,
        topic: str,
        value: bytes | str | None,
        key: bytes | str | None = None,
        sequence_id: int | None = None,
        partition: int | None = None,
        on_delivery: DeliveryCallback | None = None,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> int:
        """Queue one message; returns its sequence id. Ids of one producer must increase."""
        if sequence_id is None:
            sequence_id = self._next_sequence(topic)
        self._next[topic] = sequence_id + 1
        identity = [
            (HEADER_PRODUCER, self.producer_name.encode()),
            (HEADER_SEQUENCE, str(sequence_id).encode()),
        ]
        extra: dict[str, Any] = {} if partition is None else {"partition": partition}
        while True:
            try:
                self._producer.produce(
                    topic,
                    value,
                    key=key,
                    headers=[*(headers or []), *identity],
                    on_delivery=on_delivery,
                    **extra,
                )
                break
            except BufferError:  # local queue full: let deliveries drain, then retry
                self._producer.poll(0.1)
        self._producer.poll(0)
        return sequence_id

    def flush(self, timeout: float | None = None) -> int:
        """Wait for every queued message; returns how many are still queued."""
        remaining: int = (
            self._producer.flush() if timeout is None else self._producer.flush(timeout)
        )
        return remaining

    def poll(self, timeout: float = 0) -> int:
        served: int = self._producer.poll(timeout)
        return served

    def last_sequence_id(self, topic: str) -> int:
        """The highest sequence id of this producer that the topic holds (-1: none)."""
        answer = self._admin(
            "GET",
            f"/v1/topics/{_quote(topic)}/producers/{_quote(self.producer_name)}",
        )
        return int(answer["last_sequence_id"])

    def _next_sequence(self, topic: str) -> int:
        if topic not in self._next:
            if self._initial is not None:
                self._next[topic] = self._initial
            elif self._admin_url is not None:
                self._next[topic] = self.last_sequence_id(topic) + 1
            else:
                self._next[topic] = 0
        return self._next[topic]

    def _assign_name(self) -> str:
        if self._admin_url is None:
            return f"producer-{uuid.uuid4()}"
        return str(self._admin("POST", "/v1/producer-names")["producer_name"])

    def _admin(self, method: str, path: str) -> dict[str, Any]:
        if self._admin_url is None:
            raise RuntimeError("this needs the proxy's admin_url")
        request = urllib.request.Request(f"{self._admin_url}{path}", method=method)
        with urllib.request.urlopen(request, timeout=30) as answer:
            body: dict[str, Any] = json.load(answer)
            return body


def _quote(part: str) -> str:
    return urllib.parse.quote(part, safe="")
