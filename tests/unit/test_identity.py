"""The identity rules of `dedup.identity` against a reference written the slow, obvious way,
and every reader of sequences (the produce path, the replay's hot loop) against them."""

from __future__ import annotations

import re

import pytest
from confluent_kafka import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kio.schema.errors import ErrorCode

from dedup import batches, replay, state
from dedup.batches import DEFAULT_HEADERS, BadBatch, IdentityHeaders, _parse_sequence
from dedup.identity import (
    DEFAULT_PRODUCER_HEADER,
    DEFAULT_SEQUENCE_HEADER,
    INT64_DIGITS,
    INT64_MAX,
    INT64_MIN,
    MAX_SEQUENCE_TEXT,
    SequenceFault,
    is_sequence_text,
    parse_sequence,
    sequence_fault,
)
from dedup.replay import Fold

pytestmark = pytest.mark.unit

CASES = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
JAVA_LONG = re.compile(rb"[+-]?[0-9]+")  # Long.parseLong's syntax, ASCII digits only
TIMESTAMP = 1_700_000_000_000


def reference(raw: bytes | None) -> int | None:
    """The rule as the module docstring states it, with a regular expression."""
    if raw is None or len(raw) > 64 or JAVA_LONG.fullmatch(raw) is None:
        return None
    number = int(raw)
    return number if -(2**63) <= number <= 2**63 - 1 else None


# Bytes that look like numbers more often than random bytes do, with what int() or
# str.isdigit() would take but the rule must not: spaces, "_", newlines, non-ASCII digits.
_pieces = st.sampled_from(
    [
        *(b"+", b"-", b"0", b"1", b"7", b"9", b" ", b"_", b"\n", b".", b"x", b"\x00", b"\xff"),
        *("\u0663".encode(), "\u00b2".encode(), "\uff11".encode()),
    ]
)
number_like = st.lists(_pieces, max_size=70).map(b"".join)
near_bounds = st.sampled_from([INT64_MIN, 0, INT64_MAX]).flatmap(
    lambda bound: st.integers(bound - 3, bound + 3)
)
numbers = st.integers(min_value=-(2**70), max_value=2**70) | near_bounds
int_text = numbers.map(lambda n: str(n).encode())


def _padded(sign: bytes, length: int, number: int) -> bytes:
    """``sign``, then ``abs(number)`` with leading zeros up to ``length`` bytes in all."""
    return sign + str(abs(number)).encode().rjust(length - len(sign), b"0")


# Leading zeros around the 64-byte cap, where only the length decides.
padded = st.builds(
    _padded,
    st.sampled_from([b"", b"+", b"-"]),
    st.integers(0, 70) | st.integers(MAX_SEQUENCE_TEXT - 2, MAX_SEQUENCE_TEXT + 2),
    numbers,
)
# A valid-looking number with one piece spliced in: one byte away from a sequence.
damaged = st.builds(
    lambda text, at, piece: text[:at] + piece + text[at:],
    int_text | padded,
    st.integers(0, 70),
    _pieces,
)
any_sequence = st.none() | st.binary(max_size=80) | number_like | int_text | padded | damaged


def test_constants() -> None:
    assert (INT64_MIN, INT64_MAX) == (-(2**63), 2**63 - 1)
    assert INT64_DIGITS == 19
    assert MAX_SEQUENCE_TEXT == 64
    assert DEFAULT_PRODUCER_HEADER == "dedup.producer"
    assert DEFAULT_SEQUENCE_HEADER == "dedup.sequence"


def test_every_module_takes_them_from_identity() -> None:
    assert IdentityHeaders(DEFAULT_PRODUCER_HEADER, DEFAULT_SEQUENCE_HEADER) == DEFAULT_HEADERS
    assert (batches.HEADER_PRODUCER, batches.HEADER_SEQUENCE) == (
        DEFAULT_PRODUCER_HEADER,
        DEFAULT_SEQUENCE_HEADER,
    )
    assert replay.parse_sequence is parse_sequence
    assert (replay.SEQUENCE_MIN, replay.SEQUENCE_MAX) == (INT64_MIN, INT64_MAX)
    assert (state.SEQUENCE_MIN, state.SEQUENCE_MAX) == (INT64_MIN, INT64_MAX)


@pytest.mark.parametrize(
    ("raw", "expected", "fault"),
    [
        (b"0", 0, None),
        (b"-0", 0, None),
        (b"+42", 42, None),
        (b"0" * 63 + b"5", 5, None),
        (b"-" + b"0" * 62 + b"5", -5, None),
        (b"9223372036854775807", INT64_MAX, None),
        (b"-9223372036854775808", INT64_MIN, None),
        (b"9223372036854775808", None, SequenceFault.OUT_OF_RANGE),
        (b"-9223372036854775809", None, SequenceFault.OUT_OF_RANGE),
        (b"9" * 64, None, SequenceFault.OUT_OF_RANGE),
        (b"0" * 64 + b"5", None, SequenceFault.NOT_DECIMAL),  # 65 bytes
        (b"", None, SequenceFault.NOT_DECIMAL),
        (b"+", None, SequenceFault.NOT_DECIMAL),
        (b"+-1", None, SequenceFault.NOT_DECIMAL),
        (b" 1", None, SequenceFault.NOT_DECIMAL),
        (b"1_000", None, SequenceFault.NOT_DECIMAL),
        ("\u0663".encode(), None, SequenceFault.NOT_DECIMAL),
    ],
)
def test_examples(raw: bytes, expected: int | None, fault: SequenceFault | None) -> None:
    assert parse_sequence(raw) == expected
    assert sequence_fault(raw) is fault


def test_null() -> None:
    assert parse_sequence(None) is None


@CASES
@given(any_sequence)
def test_parse_sequence_agrees_with_the_reference(raw: bytes | None) -> None:
    assert parse_sequence(raw) == reference(raw)


@CASES
@given(any_sequence.filter(lambda raw: raw is not None))
def test_sequence_fault_names_the_rule_broken(raw: bytes) -> None:
    fault = sequence_fault(raw)
    assert (fault is None) == (parse_sequence(raw) is not None)
    assert is_sequence_text(raw) == (len(raw) <= 64 and JAVA_LONG.fullmatch(raw) is not None)
    if fault is SequenceFault.NOT_DECIMAL:
        assert not is_sequence_text(raw)
    elif fault is SequenceFault.OUT_OF_RANGE:
        assert not INT64_MIN <= int(raw) <= INT64_MAX


@CASES
@given(st.integers(INT64_MIN, INT64_MAX))
def test_every_int64_round_trips(number: int) -> None:
    assert parse_sequence(str(number).encode()) == number
    if number >= 0:
        assert parse_sequence(b"+%d" % number) == number


@CASES
@given(st.integers(INT64_MAX + 1, 10**64 - 1) | st.integers(-(10**63 - 1), INT64_MIN - 1))
def test_beyond_int64_is_refused(number: int) -> None:
    """Up to 64 bytes of text: refused for the range, not the length."""
    text = str(number).encode()
    assert parse_sequence(text) is None
    assert sequence_fault(text) is SequenceFault.OUT_OF_RANGE


def old_batches_message(raw: bytes) -> str | None:
    """`dedup.batches._parse_sequence`'s messages before `dedup.identity` existed."""
    where, name = "record at offset delta 3", DEFAULT_SEQUENCE_HEADER
    shown = repr(raw) if len(raw) <= 40 else f"{raw[:40]!r}... ({len(raw)} bytes)"
    if len(raw) > 64 or not JAVA_LONG.fullmatch(raw):
        return f"{where} has a {name} that is not a decimal integer: {shown}"
    if not INT64_MIN <= int(raw) <= INT64_MAX:
        return f"{where} has a {name} outside the signed 64-bit range: {shown}"
    return None


@CASES
@given(any_sequence.filter(lambda raw: raw is not None))
def test_the_produce_path_keeps_its_messages(raw: bytes) -> None:
    try:
        sequence = _parse_sequence(raw, "record at offset delta 3", DEFAULT_SEQUENCE_HEADER)
    except BadBatch as exc:
        assert exc.error_code == ErrorCode.invalid_record
        assert exc.message == old_batches_message(raw)
    else:
        assert old_batches_message(raw) is None
        assert sequence == parse_sequence(raw)


def fold_one(headers: list[tuple[str, bytes | None]]) -> int | None:
    """The sequence `Fold.add` (the replay's hot loop) takes from one real confluent-kafka
    message, None when it skips the record."""
    message = Message(
        topic="t", partition=0, offset=0, value=b"v", headers=headers, timestamp=(1, TIMESTAMP)
    )
    fold = Fold(end=100)
    assert not fold.add([message])
    highest = fold.highest()
    assert fold.records == 1
    assert fold.skipped == (0 if highest else 1)
    return highest["p"][0] if highest else None


@CASES
@given(any_sequence, st.booleans())
def test_the_replays_inline_check_is_parse_sequence(raw: bytes | None, swap: bool) -> None:
    """`Fold.add` inlines `parse_sequence` for speed (see its comment); both paths of its
    loop, exactly two headers and any other count, take exactly what `parse_sequence` takes."""
    two: list[tuple[str, bytes | None]] = [
        (DEFAULT_PRODUCER_HEADER, b"p"),
        (DEFAULT_SEQUENCE_HEADER, raw),
    ]
    if swap:
        two.reverse()
    assert fold_one(two) == parse_sequence(raw)
    assert fold_one([("other", b"x"), *two]) == parse_sequence(raw)
