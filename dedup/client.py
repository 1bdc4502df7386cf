"""A producer that sets the dedup identity for you: confluent-kafka's Producer, plus names
and sequence ids (Pulsar's producer name, sequence id and getLastSequenceId).

    from dedup.client import DedupProducer

    producer = DedupProducer("proxy:9092", producer_name="orders-loader",
                             admin_url="http://proxy:9190")
    start = producer.last_sequence_id("orders") + 1     # resume after a restart
    for row_number, row in enumerate(rows[start:], start):
        producer.send("orders", row, sequence_id=row_number)
    producer.flush()

A message larger than ``chunk_size`` (default 1,000,000 bytes, below Kafka's default
``max.message.bytes`` of 1,048,588 with room for the key, headers and batch overhead) is
sent as chunks (`dedup.chunks`): one record per ``chunk_size`` bytes, all with the message's
sequence id and key, the caller's headers and the four chunk headers, in order, to one
partition (the key's, or for a message without key, one picked from the message's uuid and
the topic's partition count, so that a restarted producer re-sends it to the same one).
A message without key and without ``partition`` goes to a partition picked the same way
from (producer name, sequence id), whole or chunked: dedup is per partition, so a re-send
must meet its first send (a client's own partitioner picks at random for such messages).
``on_delivery`` is called once per message: at the first chunk that failed, or with the
last chunk once every chunk is delivered. Messages above ``max_message_size``
(default 64 MiB) are refused with ValueError. `dedup.chunked_consumer` reassembles them.

Without ``sequence_id`` the producer numbers messages itself, per topic, continuing from
``initial_sequence_id`` or, when that is None, from what the proxy persisted for this
producer (so a restarted producer does not reuse ids). Retries are unlimited by default:
a message is given up only when the caller says so (``message.timeout.ms``).
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.parse
import urllib.request
import uuid
import zlib
from collections.abc import Callable
from typing import Any

from confluent_kafka import Producer

from dedup.chunks import ChunkMeta, chunk_headers, split_payload
from dedup.identity import DEFAULT_PRODUCER_HEADER, DEFAULT_SEQUENCE_HEADER

DeliveryCallback = Callable[[Any, Any], None]

DEFAULT_CHUNK_SIZE = 1_000_000
DEFAULT_MAX_MESSAGE_SIZE = 64 * 1024 * 1024
# What a chunk's record may hold beyond its payload (key, headers, record framing): the
# producer's message.max.bytes is chunk_size plus this.
RECORD_ROOM = 48 * 1024

# Unlimited retries, and the ordering guarantee that makes them safe: librdkafka's
# idempotent producer never lets message n+1 overtake a retried message n, so a re-sent
# message can never be classified as an old duplicate of a later one.
_DEFAULTS: dict[str, Any] = {
    "enable.idempotence": True,
    "message.timeout.ms": 0,
    "linger.ms": 5,
}


# Where `DedupProducer` and the CLI find the admin API's bearer token when none is given,
# and, for an admin API on HTTPS, the CA its certificate chains to and a client certificate
# (mutual TLS) with its key.
ADMIN_TOKEN_ENV = "DEDUP_PROXY_ADMIN_TOKEN"
ADMIN_CA_FILE_ENV = "DEDUP_PROXY_ADMIN_CA_FILE"
ADMIN_CERT_FILE_ENV = "DEDUP_PROXY_ADMIN_CERT_FILE"
ADMIN_KEY_FILE_ENV = "DEDUP_PROXY_ADMIN_KEY_FILE"


def admin_tls_from_env() -> ssl.SSLContext | None:
    """The TLS context for the admin API that the environment describes (None: none)."""
    ca = os.environ.get(ADMIN_CA_FILE_ENV) or None
    cert = os.environ.get(ADMIN_CERT_FILE_ENV) or None
    if ca is None and cert is None:
        return None
    context = ssl.create_default_context(cafile=ca)
    if cert is not None:
        context.load_cert_chain(cert, os.environ.get(ADMIN_KEY_FILE_ENV) or None)
    return context


class DedupProducer:
    def __init__(
        self,
        bootstrap_servers: str,
        producer_name: str | None = None,
        initial_sequence_id: int | None = None,
        admin_url: str | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        admin_token: str | None = None,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        admin_tls: ssl.SSLContext | None = None,
        **confluent_config: Any,
    ) -> None:
        if chunk_size < 1 or max_message_size < 0:
            raise ValueError(
                f"chunk_size must be >= 1 and max_message_size >= 0, not {chunk_size} and "
                f"{max_message_size}"
            )
        self.chunk_size = chunk_size
        self.max_message_size = max_message_size
        self._partitions: dict[str, int] = {}
        self._admin_url = admin_url.rstrip("/") if admin_url else None
        # A read-scope token is enough for what a producer asks (docs/operations.md).
        self._admin_token = admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None
        # HTTPS to the admin API: its CA, and a client certificate where it asks for one.
        self._admin_tls = admin_tls or admin_tls_from_env()
        self.producer_name = producer_name or self._assign_name()
        if not self.producer_name:
            raise ValueError("producer_name must not be empty")
        self._initial = initial_sequence_id
        self._next: dict[str, int] = {}
        config = {
            **_DEFAULTS,
            "message.max.bytes": chunk_size + RECORD_ROOM,  # a chunk must fit
            **confluent_config,
            "bootstrap.servers": bootstrap_servers,
        }
        self._producer = Producer(config)

    def send(
        self,
        topic: str,
        value: bytes | str | None,
        key: bytes | str | None = None,
        sequence_id: int | None = None,
        partition: int | None = None,
        on_delivery: DeliveryCallback | None = None,
        headers: list[tuple[str, str | bytes | None]] | None = None,
    ) -> int:
        """Queue one message; returns its sequence id. Ids of one producer must increase.
        A value over ``chunk_size`` bytes goes as chunks (see the module's docstring)."""
        data = value.encode() if isinstance(value, str) else value
        if data is not None and len(data) > self.max_message_size:
            raise ValueError(
                f"message of {len(data)} bytes is over max_message_size {self.max_message_size}"
            )
        if sequence_id is None:
            sequence_id = self._next_sequence(topic)
        self._next[topic] = sequence_id + 1
        identity: list[tuple[str, str | bytes | None]] = [
            (DEFAULT_PRODUCER_HEADER, self.producer_name.encode()),
            (DEFAULT_SEQUENCE_HEADER, str(sequence_id).encode()),
        ]
        # Pulsar's uuid: a restarted producer re-sends a message under the same one.
        uuid_text = f"{self.producer_name}-{sequence_id}"
        if partition is None and key is None:  # where its first send went (and every chunk)
            partition = self._partition_for(topic, uuid_text)
        if data is None or len(data) <= self.chunk_size:
            self._produce(topic, data, key, [*(headers or []), *identity], partition, on_delivery)
        else:
            chunks = split_payload(data, self.chunk_size)
            whole = _WholeMessage(len(chunks), on_delivery)
            for chunk_id, chunk in enumerate(chunks):
                meta = ChunkMeta(uuid_text, chunk_id, len(chunks), len(data))
                extra = [*(headers or []), *identity, *chunk_headers(meta)]
                self._produce(topic, chunk, key, extra, partition, whole)
        self._producer.poll(0)
        return sequence_id

    def _produce(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | str | None,
        headers: list[tuple[str, str | bytes | None]],
        partition: int | None,
        on_delivery: DeliveryCallback | None,
    ) -> None:
        extra: dict[str, Any] = {} if partition is None else {"partition": partition}
        while True:
            try:
                self._producer.produce(
                    topic, value, key=key, headers=headers, on_delivery=on_delivery, **extra
                )
                return
            except BufferError:  # local queue full: let deliveries drain, then retry
                self._producer.poll(0.1)

    def _partition_for(self, topic: str, uuid_text: str) -> int:
        """The same partition for the same message, as long as the topic keeps its
        partition count: dedup is per partition, so a re-send must meet its first send."""
        count = self._partitions.get(topic)
        if count is None:
            found = self._producer.list_topics(topic, timeout=30).topics.get(topic)
            if found is None or found.error is not None or not found.partitions:
                raise RuntimeError(f"no partitions known for topic {topic!r}")
            count = self._partitions[topic] = len(found.partitions)
        return zlib.crc32(uuid_text.encode()) % count

    def flush(self, timeout: float | None = None) -> int:
        """Wait for every queued message; returns how many are still queued."""
        remaining: int = (
            self._producer.flush() if timeout is None else self._producer.flush(timeout)
        )
        return remaining

    def purge(self) -> None:
        """Drop every message not yet acknowledged, as a producer that gives up on them
        (their delivery callbacks report failure on the next poll)."""
        self._producer.purge()

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
        headers = {"Authorization": f"Bearer {self._admin_token}"} if self._admin_token else {}
        request = urllib.request.Request(f"{self._admin_url}{path}", method=method, headers=headers)
        with urllib.request.urlopen(request, timeout=30, context=self._admin_tls) as answer:
            body: dict[str, Any] = json.load(answer)
            return body


class _WholeMessage:
    """The delivery callback of a chunked message: once, at the first failed chunk or with
    the last chunk once all are delivered."""

    def __init__(self, chunks: int, callback: DeliveryCallback | None) -> None:
        self._left = chunks
        self._callback = callback
        self._done = False

    def __call__(self, error: Any, message: Any) -> None:
        if self._done:
            return
        self._left -= 1
        if error is not None or self._left == 0:
            self._done = True
            if self._callback is not None:
                self._callback(error, message)


def _quote(part: str) -> str:
    return urllib.parse.quote(part, safe="")
