"""Tail replay without Kafka: the identity rules of one record (`record_identity`,
`parse_sequence`, `parse_producer`) and the hot loop (`Fold.add`) against them, on stand-ins
for confluent-kafka's messages: records, records past the end, partition EOF events."""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from confluent_kafka import (
    TIMESTAMP_CREATE_TIME,
    TIMESTAMP_LOG_APPEND_TIME,
    KafkaError,
    TopicPartition,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kio.schema.errors import ErrorCode

from dedup.batches import (
    HEADER_PRODUCER,
    HEADER_SEQUENCE,
    BadBatch,
    IdentityHeaders,
    _parse_sequence,
)
from dedup.recent_appends import BATCHES_PER_PRODUCER
from dedup.replay import (
    SEQUENCE_MAX,
    SEQUENCE_MIN,
    Fold,
    ReplayError,
    ReplayResult,
    _replay,
    parse_producer,
    parse_sequence,
    record_identity,
)

pytestmark = pytest.mark.unit

CASES = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
JAVA_LONG = re.compile(rb"[+-]?[0-9]+")
Headers = list[tuple[str, bytes | None]]


@dataclass
class FakeError:
    code_: int

    def code(self) -> int:
        return self.code_


@dataclass
class FakeMessage:
    """What `Fold.add` uses of a confluent_kafka.Message."""

    offset_: int | None  # None: an event that names no partition
    headers_: Headers | None = None
    timestamp_: int = 0
    error_: FakeError | None = None
    kind_: int = TIMESTAMP_CREATE_TIME

    def offset(self) -> int | None:
        return self.offset_

    def headers(self) -> Headers | None:
        # confluent-kafka: None for a message without headers and for an event
        return self.headers_ or None

    def timestamp(self) -> tuple[int, int]:
        return (self.kind_, self.timestamp_)

    def error(self) -> FakeError | None:
        return self.error_


EOF_CODE = -191


def eof(offset: int) -> FakeMessage:
    return FakeMessage(offset, error_=FakeError(EOF_CODE))


def ident(producer: bytes | None, sequence: bytes | None) -> Headers:
    return [(HEADER_PRODUCER, producer), (HEADER_SEQUENCE, sequence)]


# --------------------------------------------------------------------------- the rules


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b"0", 0),
        (b"42", 42),
        (b"+42", 42),
        (b"-42", -42),
        (b"-0", 0),
        (b"007", 7),
        (b"9223372036854775807", SEQUENCE_MAX),
        (b"+9223372036854775807", SEQUENCE_MAX),
        (b"-9223372036854775808", SEQUENCE_MIN),
        (b"9223372036854775808", None),
        (b"-9223372036854775809", None),
        (b"99999999999999999999999", None),
        (b"0" * 63 + b"5", 5),  # 64 bytes: leading zeros are fine
        (b"0" * 64 + b"5", None),  # 65 bytes: refused, as dedup.batches refuses it
        (b"", None),
        (None, None),
        (b"+", None),
        (b"-", None),
        (b"+-1", None),
        (b"--1", None),
        (b" 1", None),
        (b"1 ", None),
        (b"1\n", None),
        (b"1_000", None),
        (b"0x10", None),
        (b"1e3", None),
        (b"1.0", None),
        ("\u0663".encode(), None),  # ARABIC-INDIC DIGIT THREE: int() would take it as str
        (b"\xff", None),
    ],
)
def test_parse_sequence_reads_what_java_long_parse_long_reads(
    text: bytes | None, expected: int | None
) -> None:
    assert parse_sequence(text) == expected


@CASES
@given(st.binary(max_size=70) | st.integers().map(lambda n: str(n).encode()))
def test_parse_sequence_agrees_with_the_proxy(raw: bytes) -> None:
    """The replay must read a sequence exactly as the proxy's produce path (dedup.batches) does,
    and as Java's Long.parseLong (within the 64-byte cap both apply)."""
    try:
        proxy: int | None = _parse_sequence(raw, "record", HEADER_SEQUENCE)
    except BadBatch as exc:
        assert exc.error_code == ErrorCode.invalid_record
        proxy = None
    assert parse_sequence(raw) == proxy
    java_ok = JAVA_LONG.fullmatch(raw) is not None and SEQUENCE_MIN <= int(raw) <= SEQUENCE_MAX
    assert (parse_sequence(raw) is not None) == (java_ok and len(raw) <= 64)


@CASES
@given(st.integers(min_value=SEQUENCE_MIN - 10, max_value=SEQUENCE_MAX + 10), st.booleans())
def test_parse_sequence_int64_bounds(value: int, plus: bool) -> None:
    text = (f"+{value}" if plus and value >= 0 else str(value)).encode()
    expected = value if SEQUENCE_MIN <= value <= SEQUENCE_MAX else None
    assert parse_sequence(text) == expected


def test_parse_producer() -> None:
    assert parse_producer(b"orders-1") == "orders-1"
    assert parse_producer("m\u00fcller \u2603".encode()) == "m\u00fcller \u2603"
    assert parse_producer(b"") is None
    assert parse_producer(None) is None
    assert parse_producer(b"\xff\xfe") is None
    assert parse_producer(b"\xed\xa0\x80") is None  # a UTF-16 surrogate is not UTF-8


def test_record_identity_examples() -> None:
    assert record_identity(ident(b"a", b"5")) == ("a", 5)
    assert record_identity(None) is None
    assert record_identity([]) is None
    assert record_identity([("other", b"x")]) is None
    assert record_identity([(HEADER_PRODUCER, b"a")]) is None
    assert record_identity([(HEADER_SEQUENCE, b"1")]) is None
    assert record_identity(ident(b"", b"1")) is None
    assert record_identity(ident(None, b"1")) is None
    assert record_identity(ident(b"a", None)) is None
    assert record_identity(ident(b"a", b"x")) is None
    # the last occurrence counts, even when it is the bad one
    assert record_identity([*ident(b"a", b"9"), (HEADER_SEQUENCE, b"3")]) == ("a", 3)
    assert record_identity([*ident(b"a", b"9"), (HEADER_PRODUCER, b"b")]) == ("b", 9)
    assert record_identity([*ident(b"a", b"9"), (HEADER_SEQUENCE, b"bad")]) is None
    assert record_identity([*ident(b"a", b"9"), (HEADER_PRODUCER, b"")]) is None
    assert record_identity([(HEADER_SEQUENCE, b"4"), ("x", None), (HEADER_PRODUCER, b"p")]) == (
        "p",
        4,
    )
    names = IdentityHeaders(producer="who", sequence="seq")
    assert record_identity(ident(b"a", b"1"), names) is None
    assert record_identity([("who", b"a"), ("seq", b"1")], names) == ("a", 1)


# --------------------------------------------------------------------------- strategies

header_names = st.sampled_from([HEADER_PRODUCER, HEADER_SEQUENCE, "other", "dedup.producers"])
producer_values = st.sampled_from([b"a", b"b", b"c", "\u00e9".encode(), b"", b"\xff", None])
sequence_values = (
    st.integers(min_value=-5, max_value=5).map(lambda n: str(n).encode())
    | st.sampled_from(
        [
            b"+3",
            b"9223372036854775807",
            b"-9223372036854775808",
            b"9223372036854775808",
            b"-9223372036854775809",
            b" 1",
            b"1_0",
            b"",
            b"x",
            None,
        ]
    )
    | st.binary(max_size=4)
)


@st.composite
def header_lists(draw: st.DrawFn) -> Headers:
    headers: Headers = []
    for name in draw(st.lists(header_names, max_size=5)):
        if name == HEADER_PRODUCER:
            headers.append((name, draw(producer_values)))
        elif name == HEADER_SEQUENCE:
            headers.append((name, draw(sequence_values)))
        else:
            headers.append((name, draw(st.none() | st.binary(max_size=3))))
    return headers


def model_identity(headers: Sequence[tuple[str, bytes | None]]) -> tuple[str, int] | None:
    """Java's `Headers.lastHeader` and `Long.parseLong`, written the slow, obvious way."""
    producer = sequence = None
    for name, value in reversed(headers):
        if name == HEADER_PRODUCER and producer is None:
            producer = (value,)
        if name == HEADER_SEQUENCE and sequence is None:
            sequence = (value,)
    if producer is None or sequence is None:
        return None
    (producer_raw,), (sequence_raw,) = producer, sequence
    if not producer_raw or sequence_raw is None:
        return None
    if len(sequence_raw) > 64 or not JAVA_LONG.fullmatch(sequence_raw):
        return None
    try:
        name = producer_raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    number = int(sequence_raw)
    return (name, number) if SEQUENCE_MIN <= number <= SEQUENCE_MAX else None


@CASES
@given(header_lists())
def test_record_identity_is_the_last_header_rule(headers: Headers) -> None:
    assert record_identity(headers) == model_identity(headers)


# --------------------------------------------------------------------------- the fold


def expected_fold(
    messages: Sequence[FakeMessage], end: int
) -> tuple[dict[str, tuple[int, int]], int, int]:
    highest: dict[str, tuple[int, int]] = {}
    records = skipped = 0
    for message in messages:
        if message.error_ is not None or message.offset_ >= end:
            continue
        records += 1
        identity = record_identity(message.headers_)
        if identity is None:
            skipped += 1
            continue
        producer, sequence = identity
        old_sequence, old_time = highest.get(producer, (SEQUENCE_MIN, -1))
        highest[producer] = (max(old_sequence, sequence), max(old_time, message.timestamp_))
    return highest, records, skipped


def expected_runs(
    messages: Sequence[FakeMessage], end: int
) -> dict[str, list[tuple[int, int, int, int]]]:
    """Each producer's records split where one is not the one before it plus one sequence
    and one offset, of the same log append time (-1 for create time); its latest 5 runs."""
    runs: dict[str, list[tuple[int, int, int, int]]] = {}
    for message in messages:
        if message.error_ is not None or message.offset_ >= end:
            continue
        identity = record_identity(message.headers_)
        if identity is None:
            continue
        producer, sequence = identity
        appended = message.timestamp_ if message.kind_ == TIMESTAMP_LOG_APPEND_TIME else -1
        produced = runs.setdefault(producer, [])
        if produced:
            first, count, offset, when = produced[-1]
            if (first + count, offset + count, when) == (sequence, message.offset_, appended):
                produced[-1] = (first, count + 1, offset, when)
                continue
        produced.append((sequence, 1, message.offset_, appended))
    return {producer: produced[-BATCHES_PER_PRODUCER:] for producer, produced in runs.items()}


@st.composite
def producer_streams(draw: st.DrawFn) -> list[FakeMessage]:
    """Two producers writing sequences mostly in a row, interleaved, with gaps in offsets
    and in sequences, sequences started again, and append times that change now and then."""
    kind = draw(st.sampled_from([TIMESTAMP_CREATE_TIME, TIMESTAMP_LOG_APPEND_TIME]))
    following = {b"p": 0, b"q": 5}
    messages = []
    offset = draw(st.integers(min_value=0, max_value=3))
    appended = 100
    for _ in range(draw(st.integers(min_value=0, max_value=40))):
        producer = draw(st.sampled_from([b"p", b"p", b"p", b"q"]))
        sequence = following[producer] + draw(st.sampled_from([0, 0, 0, 0, 1, -3]))
        following[producer] = sequence + 1
        appended += draw(st.sampled_from([0, 0, 0, 1]))
        timestamp = appended if kind == TIMESTAMP_LOG_APPEND_TIME else draw(st.integers(0, 50))
        headers = ident(producer, str(sequence).encode())
        messages.append(FakeMessage(offset, headers, timestamp, kind_=kind))
        offset += draw(st.sampled_from([1, 1, 1, 1, 2]))
    return messages


@CASES
@given(
    messages=producer_streams(),
    end=st.integers(min_value=1, max_value=60),
    chunk=st.integers(min_value=1, max_value=7),
)
def test_fold_runs_are_each_producers_latest_runs_of_records_in_a_row(
    messages: list[FakeMessage], end: int, chunk: int
) -> None:
    fold, _ = fold_in_calls(messages, end, chunk)
    assert fold.runs() == expected_runs(messages, end)


def fold_in_calls(messages: list[FakeMessage], end: int, chunk: int) -> tuple[Fold, bool]:
    """The messages folded ``chunk`` at a time, as consume() calls hand them over, until the
    fold says the end was reached; and whether it did."""
    fold = Fold(end)
    for index in range(0, len(messages), chunk):
        if fold.add(messages[index : index + chunk]):
            return fold, True
    return fold, False


def test_fold_runs_examples() -> None:
    def at(offset: int, producer: bytes, sequence: int, appended: int) -> FakeMessage:
        headers = ident(producer, str(sequence).encode())
        return FakeMessage(offset, headers, appended, kind_=TIMESTAMP_LOG_APPEND_TIME)

    fold = Fold(100)
    fold.add(
        [
            at(10, b"p", 0, 7),
            at(11, b"p", 1, 7),
            at(12, b"q", 0, 7),  # q between: p's run ends at 11
            at(13, b"p", 2, 7),
            at(14, b"p", 3, 8),  # another batch, appended later: its own run
            at(15, b"p", 4, 8),
        ]
    )
    assert fold.runs() == {"p": [(0, 2, 10, 7), (2, 1, 13, 7), (3, 2, 14, 8)], "q": [(0, 1, 12, 7)]}
    created = Fold(100)  # create time: timestamps differ record by record, runs go on
    created.add([FakeMessage(i, ident(b"p", str(i).encode()), 50 - i) for i in range(5)])
    assert created.runs() == {"p": [(0, 5, 0, -1)]}
    near_the_end = Fold(100, runs_window=10)  # from the first call that reaches offset 90
    near_the_end.add([FakeMessage(i, ident(b"p", str(i).encode())) for i in range(85, 90)])
    near_the_end.add([FakeMessage(i, ident(b"p", str(i).encode())) for i in range(90, 95)])
    assert near_the_end.runs() == {"p": [(90, 5, 90, -1)]}
    assert near_the_end.highest() == {"p": (94, 0)}, "every record counts for the rest"
    many = Fold(100)  # a producer's latest 5 only, as Kafka keeps its last 5 batches
    many.add([FakeMessage(2 * i, ident(b"p", str(i).encode())) for i in range(7)])
    assert many.runs() == {"p": [(i, 1, 2 * i, -1) for i in range(2, 7)]}


@st.composite
def message_streams(draw: st.DrawFn) -> list[FakeMessage]:
    """Records at increasing offsets with gaps (compaction, transaction markers)."""
    messages = []
    offset = draw(st.integers(min_value=0, max_value=5))
    for _ in range(draw(st.integers(min_value=0, max_value=40))):
        headers = draw(header_lists() | st.builds(ident, producer_values, sequence_values))
        timestamp = draw(st.integers(min_value=-1, max_value=50))
        messages.append(FakeMessage(offset, headers, timestamp))
        offset += draw(st.sampled_from([1, 1, 1, 2, 5]))
    return messages


@CASES
@given(
    messages=message_streams(),
    end=st.integers(min_value=1, max_value=150),
    chunk=st.integers(min_value=1, max_value=7),
)
def test_fold_equals_the_rule_record_by_record(
    messages: list[FakeMessage], end: int, chunk: int
) -> None:
    fold, done = fold_in_calls(messages, end, chunk)
    highest, records, skipped = expected_fold(messages, end)
    assert fold.highest() == highest
    assert fold.runs() == expected_runs(messages, end)
    assert (fold.records, fold.skipped, fold.identified) == (records, skipped, records - skipped)
    assert done == any(m.offset_ >= end - 1 for m in messages)
    below = [m.offset_ for m in messages if m.offset_ < end]
    assert fold.last_offset == (below[-1] if below else -1)
    assert fold.events == []


def test_fold_highest_sequence_wins_whatever_the_order() -> None:
    fold = Fold(100)
    fold.add(
        [
            FakeMessage(0, ident(b"p", b"5"), 10),
            FakeMessage(1, ident(b"p", b"9"), 7),
            FakeMessage(2, ident(b"p", b"-3"), 30),
            FakeMessage(3, ident(b"q", b"1"), 1),
        ]
    )
    assert fold.highest() == {"p": (9, 30), "q": (1, 1)}


def test_fold_passes_events_on_and_stops_at_the_end() -> None:
    fold = Fold(10)
    assert not fold.add([FakeMessage(3, ident(b"p", b"1")), eof(4)])
    assert [e.offset() for e in fold.events] == [4]
    assert fold.last_offset == 3
    fold.events.clear()
    # offset 9 = end - 1: done; the record at 12 and the EOF after it are beyond the end
    assert fold.add([FakeMessage(9, ident(b"p", b"2")), FakeMessage(12, ident(b"p", b"99"))])
    assert fold.highest() == {"p": (2, 0)}
    assert fold.records == 2
    # a gap across the end: a record at >= end is seen first, nothing of it is folded
    gap = Fold(10)
    assert gap.add([FakeMessage(8, ident(b"p", b"1")), FakeMessage(11, ident(b"p", b"7"))])
    assert gap.highest() == {"p": (1, 0)}
    assert gap.last_offset == 8


def test_fold_bad_producer_names_are_skipped_every_time() -> None:
    fold = Fold(100)
    fold.add([FakeMessage(i, ident(b"\xff", str(i).encode())) for i in range(3)])
    fold.add([FakeMessage(3, ident(b"ok", b"1")), FakeMessage(4, None), FakeMessage(5, [])])
    assert fold.highest() == {"ok": (1, 0)}
    assert (fold.records, fold.skipped, fold.identified) == (6, 5, 1)


def test_fold_custom_header_names() -> None:
    names = IdentityHeaders(producer="who", sequence="seq")
    fold = Fold(100, names)
    fold.add(
        [
            FakeMessage(0, [("seq", b"4"), ("who", b"x")], 5),
            FakeMessage(1, ident(b"y", b"1")),  # the default names mean nothing here
        ]
    )
    assert fold.highest() == {"x": (4, 5)}
    assert fold.skipped == 1


# --------------------------------------------------------------------------- the read loop


@dataclass
class FakeKafkaError(FakeError):
    text: str = "boom"

    def str(self) -> str:
        return self.text


class FakeConsumer:
    """A scripted confluent_kafka.Consumer: `script` maps the assigned offset to the
    batches that consume() returns from there, in turn (then nothing)."""

    def __init__(self, low: int, script: dict[int, list[list[FakeMessage]]]) -> None:
        self.low = low
        self.script = script
        self.assigned: list[int] = []
        self.pending: list[list[FakeMessage]] = []

    def get_watermark_offsets(self, _tp: object, timeout: float) -> tuple[int, int]:
        return self.low, 10**9

    def assign(self, partitions: list[TopicPartition]) -> None:
        [tp] = partitions
        self.assigned.append(tp.offset)
        self.pending = list(self.script.get(tp.offset, []))

    def consume(self, num_messages: int, timeout: float) -> list[FakeMessage]:
        assert num_messages >= 1
        if self.pending:
            return self.pending.pop(0)
        time.sleep(min(timeout, 0.01))
        return []


def records(offsets: range, producer: bytes = b"p") -> list[FakeMessage]:
    return [FakeMessage(o, ident(producer, str(o).encode()), o) for o in offsets]


def run(consumer: FakeConsumer, start: int, end: int, **kwargs: object) -> ReplayResult:
    return _replay(
        consumer,
        "t",
        0,
        start,
        end,
        Fold(end),
        kwargs.get("progress"),  # type: ignore[arg-type]
        float(kwargs.get("timeout_s", 5.0)),  # type: ignore[arg-type]
        time.monotonic(),
    )


def test_loop_ends_at_partition_eof() -> None:
    consumer = FakeConsumer(0, {0: [records(range(0, 3)), [*records(range(5, 7)), eof(7)]]})
    result = run(consumer, 0, 7)
    assert (result.records, result.start, result.truncated_start) == (5, 0, False)
    assert result.highest == {"p": (6, 6)}


def test_loop_waits_past_an_eof_below_the_end() -> None:
    consumer = FakeConsumer(0, {0: [[*records(range(0, 2)), eof(2)], [], records(range(2, 4))]})
    assert run(consumer, 0, 4).records == 4


def test_loop_moves_to_the_log_start_when_it_passed_the_replay() -> None:
    """Retention deletes records under a running replay: Kafka answers out of range, the
    replay goes on from the new log start and says it is truncated."""
    reset = FakeMessage(5, error_=FakeKafkaError(KafkaError._AUTO_OFFSET_RESET, "out of range"))
    consumer = FakeConsumer(0, {0: [records(range(0, 5)), [reset]], 8: [records(range(8, 10))]})
    lows = iter([0, 8])
    consumer.get_watermark_offsets = lambda _tp, timeout: (next(lows), 10)  # type: ignore[method-assign]
    result = run(consumer, 0, 10)
    assert consumer.assigned == [0, 8]
    assert result.truncated_start
    assert (result.start, result.records) == (0, 7)
    assert result.highest == {"p": (9, 9)}


def test_loop_raises_on_an_out_of_range_start() -> None:
    reset = FakeMessage(50, error_=FakeKafkaError(KafkaError._AUTO_OFFSET_RESET, "out of range"))
    with pytest.raises(ReplayError, match="t/0 at offset 50: out of range"):
        run(FakeConsumer(0, {50: [[reset]]}), 50, 60)


def test_loop_raises_on_a_kafka_error() -> None:
    error = FakeMessage(3, error_=FakeKafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART, "no topic"))
    with pytest.raises(ReplayError, match="no topic"):
        run(FakeConsumer(0, {0: [records(range(0, 3)), [error]]}), 0, 9)


def test_loop_reads_on_past_a_refused_group_lookup() -> None:
    """The replay's consumer names a group (librdkafka wants one) but joins none: a
    principal without an ACL on it gets the coordinator lookup refused, an event without a
    partition or an offset, alone in a batch or after records. It changes nothing of the
    read (before, it failed every recovery: TypeError on the missing offset)."""
    refused = FakeKafkaError(KafkaError.GROUP_AUTHORIZATION_FAILED, "Group authorization failed")
    lookup = FakeMessage(None, error_=refused)
    consumer = FakeConsumer(
        0, {0: [[lookup], [*records(range(0, 3)), lookup], [*records(range(3, 5)), eof(5)]]}
    )
    result = run(consumer, 0, 5)
    assert (result.records, result.highest) == (5, {"p": (4, 4)})


def test_loop_raises_when_stalled() -> None:
    began = time.monotonic()
    with pytest.raises(ReplayError, match=r"stalled at offset 2 for 0.2 s before its end 9"):
        run(FakeConsumer(0, {0: [records(range(0, 2))]}), 0, 9, timeout_s=0.2)
    assert time.monotonic() - began < 2


def test_loop_starts_at_the_log_start() -> None:
    consumer = FakeConsumer(4, {4: [records(range(4, 6))]})
    result = run(consumer, 1, 6)
    assert consumer.assigned == [4]
    assert (result.start, result.records, result.truncated_start) == (4, 2, True)
    nothing = FakeConsumer(7, {})
    gone = run(nothing, 1, 6)
    assert (gone.start, gone.records, gone.truncated_start) == (7, 0, True)
    assert nothing.assigned == []


def test_loop_reports_progress_at_most_twice_a_second() -> None:
    batches = [records(range(i, i + 1)) for i in range(0, 60)]
    calls: list[tuple[int, int]] = []

    class Slow(FakeConsumer):
        def consume(self, num_messages: int, timeout: float) -> list[FakeMessage]:
            time.sleep(0.02)  # 60 batches: about 1.2 s
            return super().consume(num_messages, timeout)

    run(Slow(0, {0: batches}), 0, 60, progress=lambda r, o: calls.append((r, o)))
    assert 2 <= len(calls) <= 4
    assert calls[-1] == (60, 60)
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(calls))
