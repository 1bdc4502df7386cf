"""What the dedup check costs per record, sent record by record or as runs of consecutive
sequences (`dedup.state.CheckEncoding`), against a real Redis.

Every call is `DedupState.check_and_push` of one partition batch of ``--records`` records
(default 1000) of one producer with consecutive sequences, under a recovery token as the
engine sends it. Four cases:

- **new**: each batch follows the previous one on its partition (the common case): all
  NotDup, one comparison per run;
- **retry**: the same acknowledged batch again and again: all Dup, and a run overlapping
  ``pushed`` that is acknowledged all through gets its status in a few comparisons too;
- **overlap**: a batch whose first half is acknowledged, on a partition of its own per call:
  the run is checked record by record in the script up to the first NotDup record;
- **overlap-huge**: the same with sequences from 2^60, beyond Lua's exact numbers: the
  script answers "expand" and the batch is re-sent record by record (two script calls).

Per case and encoding, ``--rounds`` rounds (interleaved: records, runs, records, ...) of
``--batches`` calls, each on a fresh key prefix. Measured: records/s through
`check_and_push` (one call at a time, so it includes the round trip and the Python side),
and Redis CPU per record: the growth of ``cmdstat_evalsha`` usec in ``INFO commandstats``
(the scripts' own time in Redis), divided by the records checked.

Without ``--redis`` a private redis-server is started on a free port (as the tests do) and
stopped at the end.

    .venv/bin/python -m benchmarks.check --out /tmp/bench-check [--redis redis://host:port]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Final

import redis
import redis.asyncio

from dedup.state import CheckEncoding, DedupState, PartitionCheck

CASES: Final = ("new", "retry", "overlap", "overlap-huge")
ENCODINGS: Final = (CheckEncoding.RECORDS, CheckEncoding.RUNS)
TOKEN: Final = "bench-token"


@dataclass(frozen=True)
class Row:
    case: str
    encoding: str
    round: int
    batches: int
    records: int
    seconds: float
    records_per_s: float
    redis_us_per_record: float
    evalsha_calls: int


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    """A throwaway redis-server on a free loopback port; its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (deploy/setup.sh installs it); or --redis")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="bench-check-") as data:
        server = subprocess.Popen(
            [
                *(binary, "--port", str(port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no", "--dir", data),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            _wait_for_ping(port, server)
            yield f"redis://127.0.0.1:{port}"
        finally:
            server.terminate()
            server.wait(10)


def _wait_for_ping(port: int, server: subprocess.Popen[bytes]) -> None:
    client = redis.Redis(port=port, socket_connect_timeout=1)
    deadline = time.monotonic() + 20
    try:
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise SystemExit("redis-server exited")
            with contextlib.suppress(redis.ConnectionError):
                if client.ping():
                    return
            time.sleep(0.05)
        raise SystemExit("redis-server did not answer PING")
    finally:
        client.close()


async def evalsha_stats(client: redis.asyncio.Redis) -> tuple[int, int]:
    """(calls, usec) of EVALSHA so far, from INFO commandstats."""
    stats: dict[str, Any] = await client.info("commandstats")
    entry = stats.get("cmdstat_evalsha", {})
    return int(entry.get("calls", 0)), int(entry.get("usec", 0))


def batch(first: int, records: int) -> list[tuple[str, int]]:
    return [("bench", s) for s in range(first, first + records)]


async def prepare(state: DedupState, case: str, batches: int, records: int) -> list[PartitionCheck]:
    """The calls to time, one partition batch each, with the state they need behind them."""
    if case == "new":  # on one partition, each batch after the one before
        await state.load_recovered("bench", 0, {}, TOKEN, now_ms=1)
        return [
            PartitionCheck("bench", 0, batch(i * records, records), TOKEN) for i in range(batches)
        ]
    if case == "retry":  # on one partition, the same acknowledged batch every time
        await state.load_recovered("bench", 0, {"bench": (records - 1, 1)}, TOKEN, now_ms=1)
        return [PartitionCheck("bench", 0, batch(0, records), TOKEN)] * batches
    # overlap: on a partition each, a batch whose first half is acknowledged
    base = 2**60 if case == "overlap-huge" else 0
    checks = []
    for i in range(batches):
        token = f"{TOKEN}-{i}"
        acknowledged = {"bench": (base + records // 2 - 1, 1)}
        await state.load_recovered("bench", i, acknowledged, token, now_ms=1)
        checks.append(PartitionCheck("bench", i, batch(base, records), token))
    return checks


async def measure(
    client: redis.asyncio.Redis,
    case: str,
    encoding: CheckEncoding,
    round_: int,
    batches: int,
    records: int,
) -> Row:
    prefix = f"bench-check-{uuid.uuid4().hex[:8]}"
    state = DedupState(client, key_prefix=prefix, check_encoding=encoding)
    checks = await prepare(state, case, batches, records)
    calls_before, usec_before = await evalsha_stats(client)
    start = time.perf_counter()
    for check in checks:
        (verdict,) = await state.check_and_push([check], 2)
        assert not verdict.refused and len(verdict.statuses) == records
    seconds = time.perf_counter() - start
    calls_after, usec_after = await evalsha_stats(client)
    await state.clear("bench")
    total = batches * records
    return Row(
        case,
        encoding.value,
        round_,
        batches,
        total,
        round(seconds, 4),
        round(total / seconds),
        round((usec_after - usec_before) / total, 3),
        calls_after - calls_before,
    )


async def run(url: str, rounds: int, batches: int, records: int) -> list[Row]:
    client = redis.asyncio.Redis.from_url(url)
    rows = []
    try:
        for case in CASES:
            # Warm-up: scripts loaded, connection open, the interpreter's caches filled.
            for encoding in ENCODINGS:
                await measure(client, case, encoding, 0, max(1, batches // 10), records)
            for round_ in range(1, rounds + 1):
                for encoding in ENCODINGS:
                    row = await measure(client, case, encoding, round_, batches, records)
                    print(row, flush=True)
                    rows.append(row)
    finally:
        await client.aclose()
    return rows


def write_csv(out: Path, rows: list[Row]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "check.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, [field.name for field in fields(Row)])
        writer.writeheader()
        writer.writerows(asdict(row) for row in rows)


def summary(rows: list[Row]) -> str:
    """Medians per case and encoding, as a Markdown table."""
    lines = [
        "| case | encoding | records/s | Redis µs/record | EVALSHA per batch |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for case in CASES:
        for encoding in ENCODINGS:
            mine = [r for r in rows if r.case == case and r.encoding == encoding.value]
            if not mine:
                continue
            rate = statistics.median(r.records_per_s for r in mine)
            cpu = statistics.median(r.redis_us_per_record for r in mine)
            per_batch = statistics.median(r.evalsha_calls / r.batches for r in mine)
            lines.append(
                f"| {case} | {encoding.value} | {rate:,.0f} | {cpu:.3f} | {per_batch:.0f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for check.csv")
    parser.add_argument("--redis", help="a Redis URL; default: a private redis-server")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=200, help="calls per measurement")
    parser.add_argument("--records", type=int, default=1000, help="records per batch")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        url = args.redis or stack.enter_context(private_redis())
        rows = asyncio.run(run(url, args.rounds, args.batches, args.records))
    write_csv(args.out, rows)
    table = summary(rows)
    (args.out / "summary.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
