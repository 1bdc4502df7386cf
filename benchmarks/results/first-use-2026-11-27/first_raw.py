"""first_raw.py PORT TOPIC PARTITIONS: one raw Produce request to every partition of TOPIC at
once (as Kafka's Java producer sends a broker's ready batches) through the proxy listening
on PORT; the seconds until every partition is answered written (the request re-sent to the
partitions still answered NOT_LEADER_OR_FOLLOWER while they recover)."""

import sys
import time

from tests.support.raw import (
    NOT_LEADER_OR_FOLLOWER,
    explicit_batch,
    produce_answers,
    produce_request,
)


class Listeners:
    """What `produce_answers` asks of a proxy: its broker 0 listener."""

    def __init__(self, port: int) -> None:
        self._port = port

    def broker_port(self) -> int:
        return self._port + 1


port, topic, partitions = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
started, requests = time.perf_counter(), 0
pending = set(range(partitions))
while pending:
    requests += 1
    batches = {p: explicit_batch([("first", 0)]) for p in sorted(pending)}
    answers = produce_answers(Listeners(port), produce_request(topic, batches))  # type: ignore[arg-type]
    assert all(a.error_code in (0, NOT_LEADER_OR_FOLLOWER) for a in answers.values()), answers
    pending = {p for (_, p), a in answers.items() if a.error_code != 0}
print(f"{time.perf_counter() - started:.3f} s, {requests} requests")
