"""The dedup proxy's own time per Produce request, in process: no socket, Kafka or Redis.

    .venv/bin/python -m benchmarks.engine_path [--checkout DIR ...] [--rounds 5] [--out DIR]

What one request costs between the connection's read and its write, the steps that make
dedup cost more than the pass-through: the engine's (admit, read the batch, check it in
memory, judge, submit), the real idempotent writer (its sequence, the batch rebuilt with
the identity headers, the Produce request built and its answer read) on a link that answers
at once, and the client's answer written. Each request carries one batch of a Kafka
idempotent producer, 16 records of 1000 B (implicit identities): what Kafka's
ProducerPerformance sends with its defaults. One partition, one request at a time.

Several ``--checkout`` (a source tree each, e.g. `git worktree add` or `git archive` of a
commit, with `dedup/_records.abi3.so` beside its modules) are measured in turn in each round,
each in a process of its own, so machine noise hits them alike; the summary is each one's
median microseconds per request (wall, and CPU of the process). Results go to --out:
engine_path.csv and meta.json. The exit code is non-zero only when a run failed.

The fakes here stand in for the proxy's surroundings (ownership, recovery, Redis); they
answer at once, so what is measured is the proxy's Python and native code alone. The
figures are a tool for comparing two versions of the produce path; the end-to-end figures
are `benchmarks.kafka_tools`'.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

RESULTS_DIR = Path(__file__).parent / "results"
RECORDS_PER_BATCH = 16
RECORD_BYTES = 1000


def _measure(requests: int, rounds: int) -> list[tuple[float, float]]:
    """(wall µs, CPU µs) per request, per round, of the modules on sys.path (a checkout)."""
    import uvloop

    return uvloop.run(_rounds(requests, rounds))


async def _rounds(requests: int, rounds: int) -> list[tuple[float, float]]:
    # Imported here: from the checkout this process was started on.
    from kio.schema.produce.v9.request import PartitionProduceData, ProduceRequest
    from kio.schema.produce.v9.request import TopicProduceData as TopicData
    from kio.schema.types import TopicName
    from kio.static.primitive import Records, i16, i32, i32Timedelta

    from dedup.batches import IdentityHeaders, IncomingRecord, build_batch
    from dedup.engine import DedupEngine
    from dedup.fencing import ProducerIdentity
    from dedup.policies import Mode, PolicySnapshot
    from dedup.recovery import RecoveredPartition
    from dedup.recovery_scheduler import RecoveryScheduler
    from dedup.state import RecoveredState
    from dedup.writer import IdempotentWriter
    from proxy.kafka.topology import Endpoint
    from proxy.runtime.chain import encode_response

    try:  # the answer as the filter writes it; older checkouts build the entity
        from dedup.produce_filter import produce_answer as answer_of
    except ImportError:
        from dedup.produce_filter import produce_response as answer_of

    topic, broker = "orders", Endpoint("kafka", 9092)
    answered = SimpleNamespace(
        responses=[
            SimpleNamespace(
                name=topic,
                partition_responses=[
                    SimpleNamespace(
                        index=0,
                        error_code=0,
                        base_offset=42,
                        log_append_time=None,
                        log_start_offset=0,
                        error_message=None,
                    )
                ],
            )
        ]
    )
    loop = asyncio.get_running_loop()
    # A background task that fails (the persisted-marks flusher, say) only logs: a figure
    # measured without it would be of a path the proxy does not run.
    failures: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: failures.append(context))

    class Link:
        is_open = True

        def send(self, request: Any) -> asyncio.Future[Any]:
            answer: asyncio.Future[Any] = loop.create_future()
            loop.call_soon(answer.set_result, answered)
            return answer

    class ProducerIds:
        async def new_epoch(self) -> Any:
            return ProducerIdentity(1, 0)

        async def fence(self, partitions: Any) -> Any:
            return ProducerIdentity(1, 1)

    class State:
        async def mark_persisted(self, updates: Any, now_ms: int, tokens: Any = None) -> Any:
            return []  # the indexes of updates whose state was lost: none

        async def reset_pushed(self, topic: str, partition: int, token: Any = None) -> bool:
            return True

        async def forget_producers(self, *args: Any) -> None:
            return None

    class Recovery:
        async def run(self, partitions: Sequence[Any], later: Any) -> Any:
            loaded = RecoveredState({}, {})
            return {
                key: RecoveredPartition(*key, "token", 0, None, 0, 0, 0, 0.0, loaded, "id", False)
                for key in partitions
            }, {}

    class Owners:
        def ready(self) -> bool:
            return True

        def serves_here(self, key: Any) -> bool:
            return True

        def holds(self, key: Any) -> bool:
            return True

        def lease_valid(self, key: Any) -> bool:
            return True

        def redirect(self, key: Any, holder: Any = None) -> Any:
            return None

        async def learn_leader(self, key: Any) -> Any:
            return (0, 0)

        def let_go(self, key: Any) -> bool:
            return False

    class Policies:
        async def snapshot(self) -> Any:
            return PolicySnapshot(Mode.ENABLED)

    class TopicIds:
        async def of(self, topic: str, broker: Any = None) -> str:
            return "id"

        async def answers(self, topics: Sequence[str], broker: Any = None) -> Mapping[str, Any]:
            return dict.fromkeys(topics, "id")

    class Clock:
        def clock_ms(self) -> int:
            return int(time.time() * 1000)

    async def leader_of(topic: str, partition: int) -> Any:
        return broker

    link = Link()

    async def connect(endpoint: Any, lane: int) -> Any:
        return link

    scheduler = RecoveryScheduler(Recovery())  # type: ignore[arg-type]
    engine = DedupEngine(
        State(),  # type: ignore[arg-type]
        Policies(),
        IdempotentWriter(leader_of, ProducerIds(), connect, lanes=4),  # type: ignore[arg-type]
        IdentityHeaders(),
        scheduler,
        Clock(),
        Owners(),  # type: ignore[arg-type]
        check_state="memory",
        topic_ids=TopicIds(),
    )
    now_ms = int(time.time() * 1000)
    values = [bytes([i]) * RECORD_BYTES for i in range(RECORDS_PER_BATCH)]

    def request(base_sequence: int) -> Any:
        records = [
            IncomingRecord(i, now_ms, None, value, (), None) for i, value in enumerate(values)
        ]
        batch = build_batch(
            records,
            compression=0,
            timestamp_type=0,
            producer_id=40,
            producer_epoch=1,
            base_sequence=base_sequence,
            add_identity_headers=False,
        )
        return ProduceRequest(
            transactional_id=None,
            acks=i16(-1),
            timeout=i32Timedelta.parse(timedelta(seconds=30)),
            topic_data=(
                TopicData(
                    name=TopicName(topic),
                    partition_data=(PartitionProduceData(index=i32(0), records=Records(batch)),),
                ),
            ),
        )

    made = [request(n * RECORDS_PER_BATCH) for n in range((rounds + 1) * requests)]
    figures: list[tuple[float, float]] = []
    for round_ in range(rounds + 1):  # the first warms up (and recovers the partition)
        wall, cpu = time.perf_counter(), time.process_time()
        for produce in made[round_ * requests : (round_ + 1) * requests]:
            admission = await engine.admit(produce)
            answers = await engine.produce(produce, admission, broker)
            if answers[(topic, 0)].error_code:
                raise RuntimeError(f"a request was not written: {answers}")
            encode_response(7, answer_of(9, answers, produce))
        if round_:
            figures.append(
                (
                    (time.perf_counter() - wall) / requests * 1e6,
                    (time.process_time() - cpu) / requests * 1e6,
                )
            )
    await scheduler.close()
    await engine.close()
    gc.collect()  # a failed task that nobody awaited is reported when it is collected
    if failures:
        raise RuntimeError(f"a background task failed: {failures[0].get('message')}")
    return figures


def _run_checkout(checkout: Path, requests: int) -> tuple[float, float]:
    """One measurement of a checkout, in a process of its own: this file run as a script,
    the product's modules imported from the checkout."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--one", "--requests", str(requests)],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{checkout}: {done.stderr.strip()[-2000:]}")
    wall, cpu = json.loads(done.stdout.strip().splitlines()[-1])
    return float(wall), float(cpu)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", type=Path, action="append", default=[])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:  # a child: one round after a warm-up, on its own sys.path
        figures = _measure(args.requests, 1)
        print(json.dumps(figures[-1]))
        return 0
    checkouts = [c.resolve() for c in args.checkout] or [Path(__file__).resolve().parent.parent]
    out = args.out or RESULTS_DIR / f"engine-path-{datetime.now():%Y-%m-%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for round_ in range(1, args.rounds + 1):
        for checkout in checkouts:
            wall, cpu = _run_checkout(checkout, args.requests)
            rows.append(
                {"round": round_, "checkout": str(checkout), "wall_us": wall, "cpu_us": cpu}
            )
            print(
                f"round {round_} {checkout}: {wall:.1f} µs per request (CPU {cpu:.1f})", flush=True
            )
    with (out / "engine_path.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    first = None
    for checkout in checkouts:
        cpu = statistics.median(r["cpu_us"] for r in rows if r["checkout"] == str(checkout))
        first = first or cpu
        print(f"{checkout}: median {cpu:.1f} CPU-µs per request ({cpu / first:.3f} of the first)")
    meta = {
        "when": datetime.now().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "requests": args.requests,
        "rounds": args.rounds,
        "records_per_batch": RECORDS_PER_BATCH,
        "record_bytes": RECORD_BYTES,
        "checkouts": [str(c) for c in checkouts],
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
