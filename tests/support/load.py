"""Producers that keep writing 0, 1, 2, ... in the background while a test breaks things."""

from __future__ import annotations

import threading
import time
from typing import Any

from confluent_kafka import KafkaError, Producer

from tests.support.wait import wait_until


class _BackgroundLoad:
    """A sending thread, and the delivery reports it got: `_send_all` is the load."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.errors: list[KafkaError] = []
        self.delivered = 0
        self._thread = threading.Thread(target=self._send_all, daemon=True)

    def start(self) -> Any:
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        """Still sending (or not yet started)."""
        return self._thread.is_alive()

    def wait_delivered(self, count: int, timeout_s: float = 60) -> None:
        wait_until(
            lambda: self.delivered >= count,
            timeout_s,
            lambda: f"{count} are delivered (only {self.delivered} are)",
            interval_s=0.02,
        )

    def join(self, timeout_s: float = 240) -> None:
        """Wait for the end; every record must have been acknowledged, none failed."""
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the producer did not finish"
        assert self.errors == []
        assert self.delivered == self.expected

    def _on_delivery(self, err: KafkaError | None, _message: object) -> None:
        if err is not None:
            self.errors.append(err)
        else:
            self.delivered += 1

    def _send_all(self) -> None:
        raise NotImplementedError


class BackgroundProducer(_BackgroundLoad):
    """Idempotent confluent-kafka producer writing ``str(i)`` for i in 0..total-1, paced."""

    def __init__(self, bootstrap: str, topic: str, total: int, **config: Any) -> None:
        super().__init__(total)
        self.topic = topic
        self.total = total
        self._producer = Producer(
            {
                "bootstrap.servers": bootstrap,
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 2,
                "message.timeout.ms": 180_000,
                **config,
            }
        )

    def _send_all(self) -> None:
        for index in range(self.total):
            self._producer.produce(self.topic, str(index).encode(), on_delivery=self._on_delivery)
            self._producer.poll(0)
            time.sleep(0.001)
        self._producer.flush(180)


class SequencedProducer(_BackgroundLoad):
    """A DedupProducer writing str(i) with explicit sequence id i for i in start..total-1,
    paced; its own retries carry unacknowledged records over a fault. `keyed`: record i has
    key str(i), so a restarted producer's re-send goes to the partition of the first send
    (dedup is per partition; without a key the partitioner may pick another one).

    `held_tail` and `released`: the last ``held_tail`` records go one a second until
    ``released`` is set, then at the pace. A test whose next step waits on something slow
    (a job's first batches) is sure that records still arrive when it takes that step."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        name: str,
        total: int,
        start: int = 0,
        per_second: int = 5000,
        keyed: bool = False,
        held_tail: int = 0,
        released: threading.Event | None = None,
        **config: Any,
    ) -> None:
        from dedup.client import DedupProducer  # the product's own client

        super().__init__(total - start)
        self.topic = topic
        self.total = total
        self.start_at = start
        self.per_second = per_second
        self.keyed = keyed
        self._held_from = total - held_tail if released is not None else total
        self._released = released if released is not None else threading.Event()
        self._producer = DedupProducer(
            bootstrap,
            name,
            **{"reconnect.backoff.max.ms": 500, "linger.ms": 2, **config},
        )

    def finish(self, timeout_s: float = 60) -> int:
        """Wait for the sending thread and the deliveries it can still make; the number
        of records that failed (for producers that are allowed to give up)."""
        self._thread.join(timeout_s)
        self._producer.flush(timeout_s)
        return len(self.errors)

    def _send_all(self) -> None:
        for index in range(self.start_at, self.total):
            self._producer.send(
                self.topic,
                str(index).encode(),
                key=str(index) if self.keyed else None,
                sequence_id=index,
                on_delivery=self._on_delivery,
            )
            if index >= self._held_from and not self._released.is_set():
                self._released.wait(1.0)  # a trickle, until released
            elif index % 50 == 0:
                time.sleep(50 / self.per_second)  # paced, so a fault lands mid-stream
        self._producer.flush(180)
