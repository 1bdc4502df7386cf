"""The chaos suite's producers, driven like the seed's: the value of message i is the
integer i (as ASCII decimal), at most 10,000 messages unacknowledged, retries without
limit for the run's duration, every positive and negative acknowledgement recorded.

Three clients:

- ``confluent-explicit``: confluent-kafka with the identity headers ``dedup.producer`` /
  ``dedup.sequence`` (sequence = value).
- ``confluent-implicit``: confluent-kafka's idempotent producer and no headers: the proxy
  keys records by the client's producer id and sequences.
- ``java-implicit``: Kafka's own `VerifiableProducer` from the tools jar, unmodified,
  idempotent (its values are 0, 1, 2, ... as the seed's are).

For the control runs (dedup disabled at the proxy) Kafka's own idempotence is off, as in
the seed, so a retried batch is written again. For dedup runs the confluent producers keep
librdkafka's idempotence on: it is what keeps retried messages in order (librdkafka never
lets batch n+1 overtake a retried batch n); the duplicates themselves reach Kafka unless
the proxy drops them, since Kafka only ever sees the proxy's producer id.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import uuid
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from confluent_kafka import KafkaError, Message, Producer

from dedup.identity import DEFAULT_PRODUCER_HEADER as PRODUCER_HEADER
from dedup.identity import DEFAULT_SEQUENCE_HEADER as SEQUENCE_HEADER
from deploy.local import java_tool_command

CLIENTS: Final = ("confluent-explicit", "confluent-implicit", "java-implicit")
Client = Literal["confluent-explicit", "confluent-implicit", "java-implicit"]
MAX_IN_FLIGHT: Final = 10_000  # the seed's limit on unacknowledged messages
ACK_NONE, ACK_POSITIVE, ACK_NEGATIVE = 0, 1, 2


@dataclass
class ProducerRun:
    """One run's sending side: what was sent and how each message was acknowledged."""

    messages: int
    sent: int = 0
    acked: int = 0  # acknowledgements so far, positive or negative
    acks: bytearray = field(init=False)  # per value: ACK_NONE / ACK_POSITIVE / ACK_NEGATIVE
    offsets: array[int] = field(init=False)  # per value: where its positive ack put it (or -1)
    error: str | None = None  # the producer itself failed (not a message)

    def __post_init__(self) -> None:
        self.acks = bytearray(self.messages)
        self.offsets = array("q", [-1]) * self.messages

    @property
    def acknowledged(self) -> int:
        return self.messages - self.acks.count(ACK_NONE)

    def record(self, value: int, positive: bool, offset: int = -1) -> None:
        """One acknowledgement; `offset`: the one a positive report named. The first
        acknowledgement of a value is the one kept, as the seed keeps it."""
        self.acked += 1
        if 0 <= value < self.messages and self.acks[value] == ACK_NONE:
            self.acks[value] = ACK_POSITIVE if positive else ACK_NEGATIVE
            if positive:
                self.offsets[value] = offset


def produce(
    client: Client,
    bootstrap: str,
    topic: str,
    run: ProducerRun,
    *,
    dedup: bool,
    on_sent: Callable[[int], None],
    retry_for_s: float,
    work_dir: Path,
) -> ProducerRun:
    """Send 0..run.messages-1 to partition 0 of `topic` and wait for every
    acknowledgement, recording them in `run`. ``on_sent(count)`` is called as messages go
    out (the runner injects the failure at its count)."""
    if client == "java-implicit":
        _java(
            run,
            bootstrap,
            topic,
            dedup=dedup,
            on_sent=on_sent,
            retry_for_s=retry_for_s,
            work_dir=work_dir,
        )
    else:
        _confluent(
            run, client, bootstrap, topic, dedup=dedup, on_sent=on_sent, retry_for_s=retry_for_s
        )
    return run


def _confluent(
    run: ProducerRun,
    client: Client,
    bootstrap: str,
    topic: str,
    *,
    dedup: bool,
    on_sent: Callable[[int], None],
    retry_for_s: float,
) -> None:
    config: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "acks": "all",
        "enable.idempotence": dedup,
        "retries": 2_147_483_647,
        "message.timeout.ms": int(retry_for_s * 1000),  # the seed: retry for a few minutes
        "linger.ms": 5,
        "queue.buffering.max.messages": MAX_IN_FLIGHT,
        "reconnect.backoff.max.ms": 1000,
    }
    producer = Producer(config)
    name = f"chaos-{uuid.uuid4().hex[:8]}".encode()
    lock = threading.Lock()
    in_flight = [0]

    def delivered(err: KafkaError | None, message: Message) -> None:
        with lock:
            in_flight[0] -= 1
        offset = message.offset()
        run.record(int(message.value() or b"-1"), err is None, -1 if offset is None else offset)

    for value in range(run.messages):
        while in_flight[0] >= MAX_IN_FLIGHT:
            producer.poll(0.01)
        headers: list[tuple[str, str | bytes | None]] | None = None
        if client == "confluent-explicit":
            headers = [(PRODUCER_HEADER, name), (SEQUENCE_HEADER, str(value).encode())]
        while True:
            try:
                producer.produce(
                    topic, str(value).encode(), partition=0, headers=headers, on_delivery=delivered
                )
                break
            except BufferError:
                producer.poll(0.01)
        with lock:
            in_flight[0] += 1
        run.sent += 1
        on_sent(run.sent)
        producer.poll(0)
    deadline = time.monotonic() + retry_for_s + 60
    while producer.flush(1.0) > 0:
        if time.monotonic() > deadline:
            run.error = f"{producer.flush(0)} messages never acknowledged"
            break


def _java(
    run: ProducerRun,
    bootstrap: str,
    topic: str,
    *,
    dedup: bool,
    on_sent: Callable[[int], None],
    retry_for_s: float,
    work_dir: Path,
) -> None:
    """Kafka's VerifiableProducer: one JSON line per acknowledgement on stdout. It has no
    cap on unacknowledged messages; `buffer.memory` bounds them instead (about 10,000
    records of this size)."""
    # One file per dedup setting, written again each run: what the runs used, kept beside
    # their results once (the settings do not change from run to run).
    properties = work_dir / f"java-producer-dedup-{'on' if dedup else 'off'}.properties"
    properties.write_text(
        "\n".join(
            [
                f"enable.idempotence={'true' if dedup else 'false'}",
                "acks=all",
                "retries=2147483647",
                f"delivery.timeout.ms={int(retry_for_s * 1000)}",
                "linger.ms=5",
                "buffer.memory=1048576",
                "max.block.ms=600000",
                "reconnect.backoff.max.ms=1000",
            ]
        )
        + "\n"
    )
    command = java_tool_command(
        "org.apache.kafka.tools.VerifiableProducer",
        *("--bootstrap-server", bootstrap, "--topic", topic),
        *("--max-messages", str(run.messages), "--throughput", "-1", "--acks", "-1"),
        *("--command-config", str(properties)),
    )
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert process.stdout is not None
    acknowledged = 0
    for line in process.stdout:
        if not line.startswith("{"):
            continue
        event = json.loads(line)
        kind = event.get("name")
        if kind in ("producer_send_success", "producer_send_error"):
            ok = kind == "producer_send_success"
            run.record(int(event["value"]), ok, int(event.get("offset", -1)))
            acknowledged += 1
            # The tool reports acknowledgements, not sends: the fault goes in at the
            # acknowledged count, with up to a buffer of messages in flight beyond it.
            run.sent = max(run.sent, acknowledged)
            on_sent(acknowledged)
    if process.wait() != 0:
        run.error = f"VerifiableProducer exited with {process.returncode}"
    run.sent = run.messages if run.error is None else run.sent
