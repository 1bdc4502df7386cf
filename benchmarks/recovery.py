"""What recovery costs: rebuilding a partition's dedup state by replaying its log tail.

    .venv/bin/python -m benchmarks.recovery [--quick] [--out DIR]

Sections (one function per measurement, run in order by `run`; a section returns its CSV
rows and draws its own plot, so further sections, e.g. full recovery with snapshot + replay +
Redis load, or the snapshot's cost on produce throughput, slot in beside them):

- **replay** (`measure_replay`): one topic holds ``max(tails)`` records of ~100 B written
  directly to Kafka with the dedup identity headers, round-robin over 1000 producers; for each
  tail length N (1k, 10k, 100k, 1M) `dedup.replay.replay_partition` reads the last N records
  (``[end - N, end)``), R rounds interleaved across the tail lengths. Each result is checked:
  every record read and identified, every producer's highest sequence as written.
- **scan** (`measure_scan`): where a replay's time goes and the alternatives measured for
  its hot loop: librdkafka's consume alone, the conversion of a message's headers to Python,
  the shipped fold against other ways of finding the two headers and parsing the sequence
  (all checked to give the same result), and the replay with librdkafka's default fetch
  settings instead of `dedup.replay.CONSUMER_SETTINGS`, and read_uncommitted throughout
  (its isolation before it read committed records up to the last stable offset).

Results go to benchmarks/results/<timestamp>-recovery/ (or --out): ``recovery.csv`` and
``recovery.png`` (replay), ``recovery-scan.csv``, ``meta.json``. Timings are informational:
the exit code is non-zero only when the benchmark itself could not run or a check failed.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.passthrough import (
    BenchmarkError,
    Environment,
    close_environment,
    open_environment,
    sigterm_as_interrupt,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"

TAILS = (1_000, 10_000, 100_000, 1_000_000)
QUICK_TAILS = (1_000, 10_000, 100_000)
DEFAULT_ROUNDS = 3
DEFAULT_PRODUCERS = 1000
DEFAULT_VALUE_BYTES = 100
DEFAULT_SCAN_RECORDS = 200_000
QUICK_SCAN_RECORDS = 50_000
SCAN_ROUNDS = 3
PRODUCER_HEADER = "dedup.producer"
SEQUENCE_HEADER = "dedup.sequence"

# Writing the tail fast: big batches, no compression (random payload), one partition.
PRODUCER_SETTINGS: dict[str, Any] = {
    "acks": "all",
    "enable.idempotence": False,
    "linger.ms": 20,
    "batch.size": 1_000_000,
    "batch.num.messages": 100_000,
    "compression.type": "none",
    "queue.buffering.max.messages": 1_000_000,
    "queue.buffering.max.kbytes": 1_048_576,
    "delivery.report.only.error": True,
}

# The fetch settings of dedup.replay that differ from librdkafka's defaults, at the defaults
# (librdkafka 2.x) for the "default settings" comparison of the scan section.
LIBRDKAFKA_DEFAULT_FETCH = {
    "fetch.max.bytes": "52428800",
    "max.partition.fetch.bytes": "1048576",
    "fetch.wait.max.ms": "500",
    "fetch.queue.backoff.ms": "1000",
    "queued.min.messages": "100000",
    "queued.max.messages.kbytes": "65536",
    "check.crcs": "false",
}


# The replay's isolation before it read committed records below the last stable offset.
READ_UNCOMMITTED = {"isolation.level": "read_uncommitted"}


@dataclass(frozen=True)
class Settings:
    out: Path
    tails: tuple[int, ...]
    rounds: int
    producers: int
    value_bytes: int
    scan_records: int
    bootstrap: str | None
    redis: str | None
    keep_env: bool
    quick: bool


@dataclass
class Context:
    """What every section gets: where Kafka (and Redis) are, the settings, and a place for
    its findings. `oddities` collects failed checks (printed at the end, non-zero exit)."""

    settings: Settings
    environment: Environment
    run_id: str
    say: Callable[[str], None]
    meta: dict[str, Any] = field(default_factory=dict)
    oddities: list[str] = field(default_factory=list)
    topics: list[str] = field(default_factory=list)

    @property
    def bootstrap(self) -> str:
        return self.environment.bootstrap


@dataclass
class ReplayRow:
    """One replay of one tail (round 1..R) or the median over the rounds (round "median")."""

    tail_records: int
    round: str
    seconds: float
    records_per_s: float
    producers: int
    mb_per_s: float  # value payload read per second (10^6 B)
    records_read: int = 0
    identified: int = 0
    producers_found: int = 0


@dataclass
class ScanRow:
    """One variant of the scan section: time per record, per round or median."""

    variant: str
    records: int
    round: str
    seconds: float
    ns_per_record: float
    records_per_s: float
    note: str = ""


# ----------------------------------------------------------------------------- Kafka


def admin_client(bootstrap: str) -> Any:
    import logging

    from confluent_kafka.admin import AdminClient

    quiet = logging.getLogger("benchmarks.recovery.admin")
    quiet.propagate = False
    quiet.addHandler(logging.NullHandler())
    return AdminClient({"bootstrap.servers": bootstrap}, logger=quiet)


def create_topic(context: Context, slug: str) -> str:
    """A fresh single-partition topic (replication factor 1), deleted by `delete_topics`,
    returned once its leader answers ListOffsets."""
    from deploy.topics import create_topic as create

    topic = f"bench-recovery-{context.run_id}-{slug}"
    try:
        create(context.bootstrap, topic, partitions=1, replication_factor=1)
    except TimeoutError as exc:
        raise BenchmarkError(str(exc)) from exc
    finally:
        context.topics.append(topic)
    return topic


def delete_topics(context: Context) -> None:
    if not context.topics:
        return
    admin = admin_client(context.bootstrap)
    for topic, future in admin.delete_topics(context.topics, operation_timeout=30).items():
        try:
            future.result(60)
        except Exception as exc:
            context.say(f"  could not delete {topic}: {exc}")
    context.topics.clear()


def high_watermark(bootstrap: str, topic: str) -> int:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "bench-recovery",
            "isolation.level": "read_uncommitted",
        }
    )
    try:
        _low, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=30)
        return int(high)
    finally:
        consumer.close()


def produce_tail(
    bootstrap: str, topic: str, records: int, producers: int, value_bytes: int
) -> float:
    """Write `records` records to partition 0: record k is producer ``bench-<k % producers>``
    with sequence ``k // producers``; seconds taken."""
    from confluent_kafka import Producer

    failures: list[Any] = []

    def on_delivery(err: Any, _msg: Any) -> None:
        if err is not None:
            failures.append(err)

    producer = Producer({"bootstrap.servers": bootstrap, **PRODUCER_SETTINGS})
    value = os.urandom(value_bytes)
    names = [f"bench-{i:04d}".encode() for i in range(producers)]
    began = time.monotonic()
    produce = producer.produce
    for k in range(records):
        headers: list[tuple[str, str | bytes | None]] = [
            (PRODUCER_HEADER, names[k % producers]),
            (SEQUENCE_HEADER, b"%d" % (k // producers)),
        ]
        while True:
            try:
                produce(topic, value, partition=0, headers=headers, on_delivery=on_delivery)
                break
            except BufferError:
                producer.poll(0.05)
    remaining = producer.flush(120)
    seconds = time.monotonic() - began
    if remaining or failures:
        raise BenchmarkError(
            f"writing the tail failed: {remaining} undelivered, errors {failures[:3]}"
        )
    return seconds


def expected_highest(total: int, tail: int, producers: int) -> dict[str, int]:
    """The highest sequence per producer among the last `tail` of `total` records written by
    `produce_tail`: each producer's last record there."""
    highest: dict[str, int] = {}
    for k in range(total - 1, max(total - tail, total - producers) - 1, -1):
        highest.setdefault(f"bench-{k % producers:04d}", k // producers)
    return highest


# ----------------------------------------------------------------------------- replay section


@dataclass(frozen=True)
class Tail:
    """A topic (one partition) holding `records` records written by `produce_tail`."""

    topic: str
    records: int
    producers: int

    @property
    def end(self) -> int:
        return self.records


def write_tail(context: Context, slug: str, records: int) -> Tail:
    """A fresh topic with `records` identity-carrying records (`produce_tail`)."""
    settings = context.settings
    topic = create_topic(context, slug)
    context.say(
        f"  writing {records:,} records of {settings.value_bytes} B from "
        f"{settings.producers} producers to {topic} ..."
    )
    seconds = produce_tail(
        context.bootstrap, topic, records, settings.producers, settings.value_bytes
    )
    end = high_watermark(context.bootstrap, topic)
    if end != records:
        raise BenchmarkError(f"{topic} holds {end} records, {records} were written")
    context.meta.setdefault("tails", {})[slug] = {
        "topic": topic,
        "records": records,
        "produce_seconds": round(seconds, 2),
        "produce_records_per_s": round(records / seconds),
    }
    context.say(f"  written in {seconds:.1f} s ({records / seconds:,.0f} records/s)")
    return Tail(topic, records, settings.producers)


def measure_replay(context: Context, tail_topic: Tail) -> list[ReplayRow]:
    """Replay the last N records of `tail_topic` for every tail length N, R rounds
    interleaved over the tail lengths (a warm-up replay first, not recorded)."""
    from dedup.replay import replay_partition

    settings = context.settings
    topic, end, total = tail_topic.topic, tail_topic.end, tail_topic.records
    replay_partition(context.bootstrap, topic, 0, end - min(settings.tails), end)  # warm-up

    rows: list[ReplayRow] = []
    for round_no in range(1, settings.rounds + 1):
        for tail in settings.tails:
            result = replay_partition(context.bootstrap, topic, 0, end - tail, end)
            row = ReplayRow(
                tail_records=tail,
                round=str(round_no),
                seconds=result.seconds,
                records_per_s=result.records / result.seconds,
                producers=tail_topic.producers,
                mb_per_s=result.records * settings.value_bytes / result.seconds / 1e6,
                records_read=result.records,
                identified=result.identified,
                producers_found=len(result.highest),
            )
            rows.append(row)
            want = expected_highest(total, tail, tail_topic.producers)
            got = {p: s for p, (s, _t) in result.highest.items()}
            if result.records != tail or result.identified != tail or got != want:
                context.oddities.append(
                    f"replay of the last {tail:,} records, round {round_no}: read "
                    f"{result.records:,}, identified {result.identified:,}, "
                    f"{len(got)} producers (want {len(want)}), highest sequences "
                    f"{'as written' if got == want else 'WRONG'}"
                )
            context.say(
                f"  round {round_no}  tail {tail:>9,}  {result.seconds:8.3f} s  "
                f"{row.records_per_s:>11,.0f} records/s  {row.mb_per_s:6.1f} MB/s"
            )
    return rows + replay_medians(rows)


def replay_medians(rows: Sequence[ReplayRow]) -> list[ReplayRow]:
    medians = []
    for tail in dict.fromkeys(r.tail_records for r in rows):
        runs = [r for r in rows if r.tail_records == tail]
        seconds = statistics.median(r.seconds for r in runs)
        medians.append(
            ReplayRow(
                tail_records=tail,
                round="median",
                seconds=seconds,
                records_per_s=statistics.median(r.records_per_s for r in runs),
                producers=runs[0].producers,
                mb_per_s=statistics.median(r.mb_per_s for r in runs),
                records_read=runs[0].records_read,
                identified=runs[0].identified,
                producers_found=runs[0].producers_found,
            )
        )
    return medians


def plot_replay(path: Path, rows: Sequence[ReplayRow], title: str) -> None:
    """Replay time (log-log) and rate (log x) against the tail length: medians joined by a
    line, one dot per round, the median written at each point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    runs = [r for r in rows if r.round != "median"]
    medians = [r for r in rows if r.round == "median"]
    tails = [r.tail_records for r in medians]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5))
    panels: tuple[tuple[Any, str, str, Callable[[float], str]], ...] = (
        (left, "seconds", "replay time (s)", lambda v: f"{v:.3g} s"),
        (right, "records_per_s", "records/s", lambda v: f"{v / 1000:,.0f}k/s"),
    )
    for ax, attr, label, show in panels:
        ax.plot(
            tails,
            [getattr(r, attr) for r in medians],
            marker="o",
            color="tab:blue",
            label="median",
        )
        ax.scatter(
            [r.tail_records for r in runs],
            [getattr(r, attr) for r in runs],
            s=14,
            color="black",
            zorder=3,
            label="rounds",
        )
        for r in medians:
            value = getattr(r, attr)
            ax.annotate(
                show(value),
                (r.tail_records, value),
                xytext=(0, -16 if attr == "seconds" else 9),
                ha="left" if attr == "seconds" else "center",
                textcoords="offset points",
                fontsize=9,
            )
        ax.set_xscale("log")
        ax.set_xticks(tails, [f"{t:,}" for t in tails])
        ax.set_xlim(min(tails) / 2, max(tails) * 2)
        ax.set_xlabel("tail length (records replayed)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
        ax.legend(loc="upper left")
    left.set_yscale("log")
    left.set_title("Replay time vs tail length (log-log)", fontsize=10)
    right.set_ylim(0, max(r.records_per_s for r in runs) * 1.2)
    right.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v / 1000:,.0f}k"))
    right.set_title("Replay rate vs tail length", fontsize=10)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------- scan section
# Alternatives for the replay's hot loop, each a function (messages, names) -> highest, run
# on messages whose headers() were already converted (confluent-kafka caches that list), so
# they compare the Python work only. The shipped one is dedup.replay.Fold.add.

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_JAVA_LONG = re.compile(rb"[+-]?[0-9]+")


def _update(entries: dict[bytes, list[int]], producer: bytes, sequence: int, ts: int) -> None:
    entry = entries.get(producer)
    if entry is None:
        entries[producer] = [sequence, ts]
    else:
        if sequence > entry[0]:
            entry[0] = sequence
        if ts > entry[1]:
            entry[1] = ts


def _valid(raw: bytes) -> bool:
    return len(raw) <= 64 and (raw.isdigit() or (raw[:1] in b"+-" and raw[1:].isdigit()))


def scan_dict(messages: Sequence[Any], p_name: str, s_name: str) -> dict[bytes, list[int]]:
    """dict(headers): the last occurrence wins by construction."""
    entries: dict[bytes, list[int]] = {}
    for m in messages:
        headers = m.headers()
        if headers is None:
            continue
        found = dict(headers)
        producer, raw = found.get(p_name), found.get(s_name)
        if not producer or not raw or not _valid(raw):
            continue
        sequence = int(raw)
        if _INT64_MIN <= sequence <= _INT64_MAX:
            _update(entries, producer, sequence, m.timestamp()[1])
    return entries


def scan_forward(messages: Sequence[Any], p_name: str, s_name: str) -> dict[bytes, list[int]]:
    """A forward loop over the headers, later occurrences overwriting earlier ones."""
    entries: dict[bytes, list[int]] = {}
    for m in messages:
        headers = m.headers()
        if headers is None:
            continue
        producer = raw = None
        for name, value in headers:
            if name == p_name:
                producer = value
            elif name == s_name:
                raw = value
        if not producer or not raw or not _valid(raw):
            continue
        sequence = int(raw)
        if _INT64_MIN <= sequence <= _INT64_MAX:
            _update(entries, producer, sequence, m.timestamp()[1])
    return entries


def scan_reverse(messages: Sequence[Any], p_name: str, s_name: str) -> dict[bytes, list[int]]:
    """From the end of the header list, stopping once both names were found."""
    entries: dict[bytes, list[int]] = {}
    for m in messages:
        headers = m.headers()
        if headers is None:
            continue
        producer = raw = None
        have_p = have_s = False
        for name, value in reversed(headers):
            if name == p_name and not have_p:
                producer, have_p = value, True
                if have_s:
                    break
            elif name == s_name and not have_s:
                raw, have_s = value, True
                if have_p:
                    break
        if not producer or not raw or not _valid(raw):
            continue
        sequence = int(raw)
        if _INT64_MIN <= sequence <= _INT64_MAX:
            _update(entries, producer, sequence, m.timestamp()[1])
    return entries


def scan_regex(messages: Sequence[Any], p_name: str, s_name: str) -> dict[bytes, list[int]]:
    """Forward loop, the sequence checked by a regular expression (as dedup.batches does)."""
    entries: dict[bytes, list[int]] = {}
    match = _JAVA_LONG.fullmatch
    for m in messages:
        headers = m.headers()
        if headers is None:
            continue
        producer = raw = None
        for name, value in headers:
            if name == p_name:
                producer = value
            elif name == s_name:
                raw = value
        if not producer or not raw or len(raw) > 64 or not match(raw):
            continue
        sequence = int(raw)
        if _INT64_MIN <= sequence <= _INT64_MAX:
            _update(entries, producer, sequence, m.timestamp()[1])
    return entries


def scan_decode_each(messages: Sequence[Any], p_name: str, s_name: str) -> dict[bytes, list[int]]:
    """Forward loop, the producer name decoded for every record (keys are str)."""
    entries: dict[Any, list[int]] = {}
    for m in messages:
        headers = m.headers()
        if headers is None:
            continue
        producer = raw = None
        for name, value in headers:
            if name == p_name:
                producer = value
            elif name == s_name:
                raw = value
        if not producer or not raw or not _valid(raw):
            continue
        try:
            decoded = producer.decode("utf-8")
        except UnicodeDecodeError:
            continue
        sequence = int(raw)
        if _INT64_MIN <= sequence <= _INT64_MAX:
            _update(entries, decoded, sequence, m.timestamp()[1])
    return {k.encode(): v for k, v in entries.items()}


def scan_two_first(messages: Sequence[Any], p_name: str, s_name: str) -> dict[bytes, list[int]]:
    """Forward loop, with a fast path for exactly two headers (unpacked, no loop): what
    `Fold.add` does, as a plain function."""
    entries: dict[bytes, list[int]] = {}
    for m in messages:
        headers = m.headers()
        if headers is None:
            continue
        if len(headers) == 2:
            (n0, v0), (n1, v1) = headers
            if n0 == p_name and n1 == s_name:
                producer, raw = v0, v1
            elif n1 == p_name and n0 == s_name:
                producer, raw = v1, v0
            else:
                continue
        else:
            producer = raw = None
            for name, value in headers:
                if name == p_name:
                    producer = value
                elif name == s_name:
                    raw = value
        if not producer or not raw or not _valid(raw):
            continue
        sequence = int(raw)
        if _INT64_MIN <= sequence <= _INT64_MAX:
            _update(entries, producer, sequence, m.timestamp()[1])
    return entries


SCAN_VARIANTS: dict[str, Callable[[Sequence[Any], str, str], dict[bytes, list[int]]]] = {
    "forward loop, 2-header fast path (as shipped)": scan_two_first,
    "forward loop": scan_forward,
    "dict(headers)": scan_dict,
    "reverse loop, stop when both found": scan_reverse,
    "forward loop + regex check": scan_regex,
    "forward loop + decode per record": scan_decode_each,
}


def _consume(
    bootstrap: str, topic: str, start: int, count: int, per_message: Callable[[Any], Any] | None
) -> float:
    """Consume `count` records from `start` as the replay does (its settings, batch size and
    calls); `per_message` is called on each record if given. Seconds from the first call."""
    from confluent_kafka import Consumer, TopicPartition

    from dedup.replay import CONSUME_BATCH, CONSUMER_SETTINGS

    consumer = Consumer({"bootstrap.servers": bootstrap, **CONSUMER_SETTINGS})
    try:
        consumer.assign([TopicPartition(topic, 0, start)])
        seen = 0
        began = time.monotonic()
        deadline = began + 120
        while seen < count:
            batch = consumer.consume(CONSUME_BATCH, 0) or consumer.consume(1, 0.2)
            for message in batch:
                if message.error() is None:
                    seen += 1
                    if per_message is not None:
                        per_message(message)
            if time.monotonic() > deadline:
                raise BenchmarkError(f"consumed only {seen} of {count} records of {topic}")
        return time.monotonic() - began
    finally:
        consumer.close()


def _collect(bootstrap: str, topic: str, start: int, count: int) -> list[Any]:
    """`count` consumed records, kept in memory, their headers() already converted."""
    kept: list[Any] = []

    def keep(message: Any) -> None:
        message.headers()
        kept.append(message)

    _consume(bootstrap, topic, start, count, keep)
    return kept[:count]


def measure_scan(context: Context, tail: Tail) -> list[ScanRow]:
    """Where a replay's time goes, and the alternatives measured for it (module doc):

    - streaming, on the last `scan_records` records: consume() alone, consume() plus each
      message's headers() (librdkafka's headers -> a Python list of tuples), the replay;
    - the whole tail replayed with the shipped fetch settings and with librdkafka's
      defaults;
    - the hot loop's alternatives on records held in memory with headers() already
      converted (pure Python work), in a rotating order, each checked against `Fold`; and
      `Fold` following each producer's runs nowhere, throughout, and as shipped.
    """
    from dedup.replay import CONSUME_BATCH, RUNS_WINDOW, Fold, replay_partition

    topic, end = tail.topic, tail.end
    count = min(context.settings.scan_records, end)
    start = end - count
    rows: list[ScanRow] = []

    def add(variant: str, records: int, round_: int, seconds: float, note: str) -> None:
        rows.append(
            ScanRow(
                variant,
                records,
                str(round_),
                seconds,
                seconds * 1e9 / records,
                records / seconds,
                note,
            )
        )

    def headers(message: Any) -> None:
        message.headers()

    variants = list(SCAN_VARIANTS.items())
    for round_no in range(1, SCAN_ROUNDS + 1):
        streamed = (
            ("consume() only", None),
            ("consume() + msg.headers()", headers),
        )
        for label, per_message in streamed:
            seconds = _consume(context.bootstrap, topic, start, count, per_message)
            add(label, count, round_no, seconds, "streaming")
        result = replay_partition(context.bootstrap, topic, 0, start, end)
        add("replay_partition", count, round_no, result.seconds, "streaming")

        for label, config in (
            ("replay_partition, whole tail, shipped settings", {}),
            ("replay_partition, whole tail, librdkafka default fetch", LIBRDKAFKA_DEFAULT_FETCH),
            # The isolation before the replay read committed records below the last stable
            # offset: what read_committed costs where no transaction is open.
            ("replay_partition, whole tail, read_uncommitted", READ_UNCOMMITTED),
        ):
            result = replay_partition(context.bootstrap, topic, 0, 0, end, config=config)
            add(label, end, round_no, result.seconds, "streaming")

        messages = _collect(context.bootstrap, topic, start, count)
        # Each producer's runs (`Fold.runs`) followed in the last RUNS_WINDOW offsets as
        # shipped, nowhere, and throughout: what following them costs a record. In a
        # rotating order, as the alternatives below.
        folds = [
            ("Fold.add (shipped)", RUNS_WINDOW),
            ("Fold.add, runs followed nowhere", 0),
            ("Fold.add, runs followed throughout", count),
        ]
        turn = round_no % len(folds)
        for label, window in folds[turn:] + folds[:turn]:
            fold = Fold(end, runs_window=window)
            began = time.perf_counter()
            for i in range(0, len(messages), CONSUME_BATCH):
                fold.add(messages[i : i + CONSUME_BATCH])
            add(label, count, round_no, time.perf_counter() - began, "in memory")
        reference = {raw.encode(): [s, t] for raw, (s, t) in fold.highest().items()}
        shift = round_no % len(variants)
        for name, scan in variants[shift:] + variants[:shift]:
            began = time.perf_counter()
            got = scan(messages, PRODUCER_HEADER, SEQUENCE_HEADER)
            add(name, count, round_no, time.perf_counter() - began, "in memory")
            if got != reference:
                context.oddities.append(f"scan variant {name!r} disagrees with Fold")
        del messages
    medians = []
    for label in dict.fromkeys(r.variant for r in rows):
        runs = [r for r in rows if r.variant == label]
        seconds = statistics.median(r.seconds for r in runs)
        records = runs[0].records
        medians.append(
            ScanRow(
                label,
                records,
                "median",
                seconds,
                seconds * 1e9 / records,
                records / seconds,
                runs[0].note,
            )
        )
    return rows + medians


# ----------------------------------------------------------------------------- output


def write_csv(path: Path, rows: Sequence[Any]) -> None:
    if not rows:
        return
    columns = [f.name for f in fields(rows[0])]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            values = asdict(row)
            writer.writerow(
                {k: (round(v, 6) if isinstance(v, float) else v) for k, v in values.items()}
            )


def print_replay(console: Any, rows: Sequence[ReplayRow]) -> None:
    from rich.table import Table

    table = Table(title="Tail replay (median over rounds)")
    for column in ("tail records", "seconds", "records/s", "MB/s", "rounds: seconds"):
        table.add_column(column, justify="right")
    for median in (r for r in rows if r.round == "median"):
        runs = [r for r in rows if r.tail_records == median.tail_records and r.round != "median"]
        table.add_row(
            f"{median.tail_records:,}",
            f"{median.seconds:.3f}",
            f"{median.records_per_s:,.0f}",
            f"{median.mb_per_s:.1f}",
            " ".join(f"{r.seconds:.3f}" for r in runs),
        )
    console.print(table)


def print_scan(console: Any, rows: Sequence[ScanRow]) -> None:
    from rich.table import Table

    if not rows:
        return
    table = Table(title="Where the time goes (median over rounds)")
    for column in ("variant", "records", "ns/record", "records/s", "how"):
        table.add_column(column, justify="left" if column in ("variant", "how") else "right")
    for row in (r for r in rows if r.round == "median"):
        table.add_row(
            row.variant,
            f"{row.records:,}",
            f"{row.ns_per_record:,.0f}",
            f"{row.records_per_s:,.0f}",
            row.note,
        )
    console.print(table)


# ----------------------------------------------------------------------------- main


def run(context: Context) -> dict[str, list[Any]]:
    """The sections in order, each a function of the context (and of a tail topic) returning
    its rows; `main` writes them. A new section (full recovery: snapshot + replay + Redis
    load; snapshot cost on produce throughput) is one more function and one more entry here,
    with its own CSV and plot in `main`."""
    settings = context.settings
    results: dict[str, list[Any]] = {}
    context.say("[bold]replay[/]: replay_partition over log tails")
    tail = write_tail(context, "replay", max(settings.tails))
    results["replay"] = measure_replay(context, tail)
    if settings.scan_records:
        context.say("[bold]scan[/]: where the time goes, hot-loop alternatives")
        results["scan"] = measure_scan(context, tail)
    return results


def parse_tails(text: str) -> tuple[int, ...]:
    try:
        tails = tuple(sorted({int(t.replace("_", "")) for t in text.split(",")}))
    except ValueError:
        raise argparse.ArgumentTypeError("expected comma-separated record counts") from None
    if not tails or tails[0] < 1:
        raise argparse.ArgumentTypeError("tail lengths must be positive")
    return tails


def parse_args(argv: list[str] | None) -> Settings:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.recovery",
        description="Time to rebuild a partition's dedup state by replaying its log tail.",
    )
    parser.add_argument("--quick", action="store_true", help="tails up to 100k, smaller scan")
    parser.add_argument("--out", type=Path, help="output directory (default: results/<time>)")
    parser.add_argument("--rounds", type=int, help=f"rounds per tail (default {DEFAULT_ROUNDS})")
    parser.add_argument(
        "--tails", type=parse_tails, help="tail lengths, e.g. 1000,10000 (default 1k..1M)"
    )
    parser.add_argument(
        "--producers",
        type=int,
        default=DEFAULT_PRODUCERS,
        help=f"producer names, round-robin (default {DEFAULT_PRODUCERS})",
    )
    parser.add_argument(
        "--value-bytes",
        type=int,
        default=DEFAULT_VALUE_BYTES,
        help=f"record value size (default {DEFAULT_VALUE_BYTES})",
    )
    parser.add_argument(
        "--scan-records",
        type=int,
        help=f"records of the scan section (default {DEFAULT_SCAN_RECORDS:,}; 0 skips it)",
    )
    parser.add_argument("--bootstrap", help="an external Kafka instead of the local environment")
    parser.add_argument("--redis", help="Redis URL (required with --bootstrap)")
    parser.add_argument(
        "--keep-env",
        action="store_true",
        help="leave the local environment running if the benchmark had to start it",
    )
    args = parser.parse_args(argv)
    rounds = args.rounds or DEFAULT_ROUNDS
    tails = args.tails or (QUICK_TAILS if args.quick else TAILS)
    scan = args.scan_records
    if scan is None:
        scan = QUICK_SCAN_RECORDS if args.quick else DEFAULT_SCAN_RECORDS
    if rounds < 1 or args.producers < 1 or args.value_bytes < 0 or scan < 0:
        parser.error("--rounds and --producers must be positive, sizes not negative")
    if args.bootstrap and not args.redis:
        parser.error("--bootstrap needs --redis")
    out = args.out or RESULTS_DIR / (datetime.now().strftime("%Y%m%d-%H%M%S") + "-recovery")
    return Settings(
        out=out,
        tails=tails,
        rounds=rounds,
        producers=args.producers,
        value_bytes=args.value_bytes,
        scan_records=scan,
        bootstrap=args.bootstrap,
        redis=args.redis,
        keep_env=args.keep_env,
        quick=args.quick,
    )


def main(argv: list[str] | None = None) -> int:
    import confluent_kafka
    from rich.console import Console

    from dedup.replay import CONSUME_BATCH, CONSUMER_SETTINGS

    console = Console(width=None if sys.stdout.isatty() else 140)
    settings = parse_args(argv)
    settings.out.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {
        "started": datetime.now().isoformat(timespec="seconds"),
        "settings": {k: str(v) for k, v in asdict(settings).items()},
        "producer": PRODUCER_SETTINGS,
        "replay_consumer": dict(CONSUMER_SETTINGS),
        "replay_consume_batch": CONSUME_BATCH,
        "confluent_kafka": confluent_kafka.__version__,
        "librdkafka": confluent_kafka.libversion()[0],
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
    }
    console.print(
        f"[bold]recovery benchmark[/]: tails {', '.join(f'{t:,}' for t in settings.tails)}, "
        f"{settings.rounds} rounds, {settings.producers} producers, {settings.value_bytes} B "
        f"values; results in {settings.out}",
        highlight=False,
    )
    began = time.monotonic()
    environment: Environment | None = None
    context: Context | None = None
    results: dict[str, list[Any]] = {}
    try:
        with sigterm_as_interrupt():
            environment = open_environment(settings.bootstrap, settings.redis, settings.keep_env)
            meta["environment"] = environment.description
            context = Context(
                settings=settings,
                environment=environment,
                run_id=uuid.uuid4().hex[:8],
                say=lambda text: console.print(text, highlight=False),
                meta=meta,
            )
            console.print(f"  {environment.description}", highlight=False)
            try:
                results = run(context)
            finally:
                delete_topics(context)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130
    except Exception as exc:
        if not isinstance(exc, BenchmarkError):
            console.print_exception()
        console.print(f"[red]benchmark failed:[/] {type(exc).__name__}: {exc}", highlight=False)
        return 1
    finally:
        if environment is not None:
            close_environment(environment)
    assert context is not None
    meta["seconds"] = round(time.monotonic() - began, 1)
    meta["loadavg_end"] = os.getloadavg()
    meta["oddities"] = context.oddities
    written = []
    replay_rows = results.get("replay", [])
    if replay_rows:
        write_csv(settings.out / "recovery.csv", replay_rows)
        title = (
            f"Tail replay (dedup.replay.replay_partition): {settings.producers} producers, "
            f"{settings.value_bytes} B values, 1 partition; {os.cpu_count()} CPUs, librdkafka "
            f"{meta['librdkafka']}, {settings.rounds} rounds, {meta['started']}"
        )
        plot_replay(settings.out / "recovery.png", replay_rows, title)
        print_replay(console, replay_rows)
        written += ["recovery.csv", "recovery.png"]
    scan_rows = results.get("scan", [])
    if scan_rows:
        write_csv(settings.out / "recovery-scan.csv", scan_rows)
        print_scan(console, scan_rows)
        written.append("recovery-scan.csv")
    (settings.out / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    written.append("meta.json")
    for oddity in context.oddities:
        console.print(f"[yellow]check failed:[/] {oddity}", highlight=False)
    console.print(
        f"took {meta['seconds']:.0f} s; wrote {', '.join(written)} in {settings.out}",
        highlight=False,
    )
    return 1 if context.oddities else 0


if __name__ == "__main__":
    sys.exit(main())
