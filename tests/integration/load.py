"""A producer that keeps writing 0, 1, 2, ... in the background while a test breaks things."""

from __future__ import annotations

import threading
import time
from typing import Any

from confluent_kafka import KafkaError, Producer


class BackgroundProducer:
    """Idempotent confluent-kafka producer writing ``str(i)`` for i in 0..total-1, paced."""

    def __init__(self, bootstrap: str, topic: str, total: int, **config: Any) -> None:
        self.topic = topic
        self.total = total
        self.errors: list[KafkaError] = []
        self.delivered = 0
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
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> BackgroundProducer:
        self._thread.start()
        return self

    def wait_delivered(self, count: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while self.delivered < count:
            assert time.monotonic() < deadline, f"only {self.delivered} of {count} delivered"
            time.sleep(0.05)

    def join(self, timeout_s: float = 240) -> None:
        """Wait for the end; every record must have been acknowledged, none failed."""
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the producer did not finish"
        assert self.errors == []
        assert self.delivered == self.total

    def _on_delivery(self, err: KafkaError | None, _message: object) -> None:
        if err is not None:
            self.errors.append(err)
        else:
            self.delivered += 1

    def _run(self) -> None:
        for index in range(self.total):
            self._producer.produce(self.topic, str(index).encode(), on_delivery=self._on_delivery)
            self._producer.poll(0)
            time.sleep(0.001)
        self._producer.flush(180)
