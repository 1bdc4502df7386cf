"""A produce/consume round trip through a dedup proxy, as a standalone script: it needs only
confluent-kafka, so it runs on the host and in the proxy image alike (`python - ARGS` with
this file on stdin). Prints one JSON object.

It creates the topic, sends records 0..count-1 with explicit identities (headers
dedup.producer / dedup.sequence, keyed over the partitions), sends some of them again with
the same identity, then reads every partition back from the start, through --read-bootstrap
(default: the same proxy). The caller checks that each record is there exactly once and
that every broker address the clients were told is a proxy's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--read-bootstrap")
    parser.add_argument("--topic", required=True)
    parser.add_argument("--producer", required=True)
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--partitions", type=int, default=1)
    parser.add_argument("--replication-factor", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args()
    result = run(
        args.bootstrap,
        args.topic,
        args.producer,
        count=args.count,
        read_bootstrap=args.read_bootstrap,
        partitions=args.partitions,
        replication_factor=args.replication_factor,
        timeout_s=args.timeout_s,
    )
    print(json.dumps(result))
    return 0


def run(
    bootstrap: str,
    topic: str,
    producer: str,
    *,
    count: int = 200,
    read_bootstrap: str | None = None,
    partitions: int = 1,
    replication_factor: int = 1,
    timeout_s: float = 60.0,
) -> dict[str, Any]:
    """The round trip; what the caller checks: {"sent", "resent", "errors", "values" (every
    record read, sorted), "brokers" (every broker address the clients were told)}."""
    deadline = time.monotonic() + timeout_s
    create_topic(bootstrap, topic, partitions, replication_factor)
    resent = sorted({0, count // 2, count - 1})
    errors = produce(bootstrap, topic, producer, count, resent, deadline)
    values, brokers = consume(read_bootstrap or bootstrap, topic, deadline)
    return {
        "sent": count + len(resent),
        "resent": resent,
        "errors": errors,
        "values": values,
        "brokers": sorted(brokers | metadata_brokers(bootstrap)),
    }


def create_topic(bootstrap: str, topic: str, partitions: int, replication: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(topic, partitions, replication)])
    try:
        futures[topic].result(timeout=30)
    except KafkaException as exc:
        if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise


def produce(
    bootstrap: str, topic: str, producer_name: str, count: int, resent: list[int], deadline: float
) -> list[str]:
    producer = Producer(
        {"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 5}
    )
    errors: list[str] = []

    def delivered(error: KafkaError | None, _message: Any) -> None:
        if error is not None:
            errors.append(str(error))

    def send(sequence: int) -> None:
        headers = [("dedup.producer", producer_name.encode()), ("dedup.sequence", b"%d" % sequence)]
        producer.produce(
            topic,
            key=b"key-%d" % (sequence % 7),
            value=b"%d" % sequence,
            headers=headers,
            on_delivery=delivered,
        )

    for sequence in range(count):
        send(sequence)
    flush(producer, deadline)
    # The same identities again: a producer re-sending what it is unsure of.
    for sequence in resent:
        send(sequence)
    flush(producer, deadline)
    return errors


def flush(producer: Producer, deadline: float) -> None:
    if producer.flush(max(1.0, deadline - time.monotonic())) != 0:
        raise SystemExit("records still unacknowledged at the deadline")


def consume(bootstrap: str, topic: str, deadline: float) -> tuple[list[int], set[str]]:
    """Every record of the topic, read until each partition reports its end (offsets are not
    dense: fences leave transaction markers)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"roundtrip-{topic}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )
    try:
        metadata = consumer.list_topics(topic, timeout=30)
        partitions = sorted(metadata.topics[topic].partitions)
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        at_end: set[int] = set()
        values: list[int] = []
        while at_end != set(partitions):
            if time.monotonic() > deadline:
                raise SystemExit(f"read {len(values)} records by the deadline")
            message = consumer.poll(1.0)
            if message is None:
                continue
            error = message.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    at_end.add(message.partition())
                continue
            values.append(int(message.value()))
        brokers = {f"{b.host}:{b.port}" for b in metadata.brokers.values()}
        return sorted(values), brokers
    finally:
        consumer.close()


def metadata_brokers(bootstrap: str) -> set[str]:
    metadata = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=30)
    return {f"{b.host}:{b.port}" for b in metadata.brokers.values()}


if __name__ == "__main__":
    sys.exit(main())
