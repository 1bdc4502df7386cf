"""A blind re-send through a dedup proxy (ab-resend.sh): N records of 100 B from one
producer (explicit identities, DedupProducer, linger.ms=5), then the same N sent again by a
new producer of the same name, as a producer that restarted without knowing what was
written. Prints the records/s of both.

    resend.py BOOTSTRAP TOPIC N
"""

import sys
import time

from dedup.client import DedupProducer

bootstrap, topic, count = sys.argv[1], sys.argv[2], int(sys.argv[3])


def send() -> float:
    producer = DedupProducer(bootstrap, producer_name="bench", **{"linger.ms": 5})
    started = time.monotonic()
    for sequence in range(count):
        producer.send(topic, b"x" * 100, sequence_id=sequence)
        if sequence % 10_000 == 0:
            producer.poll(0)
    assert producer.flush(120) == 0
    return count / (time.monotonic() - started)


first, again = send(), send()
print(f"first {first:.0f} rec/s  resend (all duplicates) {again:.0f} rec/s")
