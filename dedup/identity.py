"""The identity rules, written once: header names, the sequence's text form, its bounds.

A record's dedup identity is (producer name, sequence): explicit in two headers, or
implicit from an idempotent batch (`dedup.batches`). The produce path (`dedup.batches`),
the replay, the client, the Redis state and the snapshots take these rules from here.

The sequence header holds a signed 64-bit integer in ASCII decimal, as Java's
``Long.parseLong`` reads it: an optional ``+`` or ``-``, then one or more digits ``0-9``
(leading zeros allowed), within [`INT64_MIN`, `INT64_MAX`]. Text longer than
`MAX_SEQUENCE_TEXT` bytes is refused whatever it says, leading zeros or not: a bound on the
work spent on a value a client controls.
"""

from __future__ import annotations

import enum
from typing import Final

DEFAULT_PRODUCER_HEADER: Final = "dedup.producer"
DEFAULT_SEQUENCE_HEADER: Final = "dedup.sequence"

INT64_MIN: Final = -(1 << 63)
INT64_MAX: Final = (1 << 63) - 1
INT64_DIGITS: Final = len(str(INT64_MAX))  # 19: no int64 needs more digits (sign aside)
MAX_SEQUENCE_TEXT: Final = 64  # bytes: room for zero-padded int64s, a cap on int()'s work


class SequenceFault(enum.Enum):
    """Which rule a sequence text breaks. The value is the phrase of the proxy's error
    message ("record at offset delta 3 has a dedup.sequence <phrase>: b'...'")."""

    NOT_DECIMAL = "that is not a decimal integer"
    OUT_OF_RANGE = "outside the signed 64-bit range"


def is_sequence_text(raw: bytes) -> bool:
    """The text rule alone: an optional sign, then ASCII digits, at most `MAX_SEQUENCE_TEXT`
    bytes. `bytes.isdigit` is ASCII-only (``str.isdigit`` is not), and it refuses what
    ``int()`` would take besides digits: spaces, ``_``, a second sign."""
    return len(raw) <= MAX_SEQUENCE_TEXT and (
        raw.isdigit() or (raw[:1] in b"+-" and raw[1:].isdigit())
    )


def parse_sequence(raw: bytes | None) -> int | None:
    """The sequence a header value says, or None when it is null or breaks a rule (the text
    rule, `is_sequence_text`, or the int64 range)."""
    if raw is None or not is_sequence_text(raw):
        return None
    sequence = int(raw)
    return sequence if INT64_MIN <= sequence <= INT64_MAX else None


def sequence_fault(raw: bytes) -> SequenceFault | None:
    """Which rule ``raw`` breaks, None when `parse_sequence` reads it (for error messages)."""
    if not is_sequence_text(raw):
        return SequenceFault.NOT_DECIMAL
    if parse_sequence(raw) is None:
        return SequenceFault.OUT_OF_RANGE
    return None
