"""Whether a Fetch response names brokers, found by walking its structure.

A Fetch response is mostly record bytes. It names brokers in three places: its
`NodeEndpoints` (v16+, KIP-951), a tagged field at the very end; and, by id alone, each
partition's `PreferredReadReplica` (v11+, KIP-392: the replica in the consumer's rack) and
its tagged `CurrentLeader` (v12+). Decoding the response, or scanning megabytes of records
for a host name, to learn whether they are there costs the proxy's consumers a fifth of
their throughput. The walk below steps over each partition's records by their length
prefix, so it costs per partition, not per byte.

Layout (Kafka's FetchResponse.json): throttle_time_ms int32, error_code int16, session_id
int32, responses: array of {topic string (v11-12) or topic_id uuid (v13+), partitions:
array of {partition_index int32, error_code int16, high_watermark int64,
last_stable_offset int64, log_start_offset int64, aborted_transactions: nullable array of
{producer_id int64, first_offset int64}, preferred_read_replica int32, records: nullable
bytes}}. From v12 on (flexible versions) arrays, strings and bytes carry compact lengths and
every structure ends in tagged fields (a partition's tag 1: CurrentLeader; the response's
tag 0: NodeEndpoints).
"""

from __future__ import annotations

import struct
from typing import Final, NamedTuple

FIRST_VERSION_WITH_READ_REPLICA: Final = 11
FIRST_FLEXIBLE_VERSION: Final = 12
FIRST_VERSION_WITH_TOPIC_IDS: Final = 13
NODE_ENDPOINTS_TAG: Final = 0
CURRENT_LEADER_TAG: Final = 1
_PARTITION_FIXED: Final = 4 + 2 + 8 + 8 + 8  # index, error code, three offsets
_ABORTED_FIXED: Final = 8 + 8  # producer id, first offset
_INT32: Final = struct.Struct(">i").unpack_from
_TWO_INT32: Final = struct.Struct(">ii").unpack_from


class BrokerNames(NamedTuple):
    """Whether a response names brokers: by address, or by id alone."""

    endpoints: bool  # host and port (KIP-951 NodeEndpoints)
    ids: bool  # ids that come without an address (a preferred read replica, a current leader)


NONE_NAMED: Final = BrokerNames(endpoints=False, ids=False)


class _Malformed(Exception):
    pass


class _Reader:
    """Lengths as the version encodes them: compact (unsigned varint, plus one) in
    flexible versions, else fixed-size signed integers; -1 is null either way."""

    __slots__ = ("data", "end", "flexible", "pos")

    def __init__(self, data: bytes, pos: int, flexible: bool) -> None:
        self.data, self.pos, self.end, self.flexible = data, pos, len(data), flexible

    def skip(self, size: int) -> None:
        if size < 0 or self.pos + size > self.end:
            raise _Malformed
        self.pos += size

    def int_(self, size: int) -> int:
        start = self.pos
        self.skip(size)
        return int.from_bytes(self.data[start : self.pos], "big", signed=True)

    def uvarint(self) -> int:
        try:
            value, self.pos = _uvarint(self.data, self.pos)
        except IndexError:
            raise _Malformed from None
        return value

    def length(self, fixed_size: int) -> int:
        """An array's, string's or bytes' length; -1 for null."""
        return self.uvarint() - 1 if self.flexible else self.int_(fixed_size)

    def skip_sized(self, fixed_size: int) -> None:
        """A string (length in 2 bytes) or bytes (4), nullable."""
        size = self.length(fixed_size)
        if size > 0:
            self.skip(size)

    def tagged_fields(self, tag: int) -> bool:
        """Steps over tagged fields (flexible versions only); whether ``tag`` was one."""
        if not self.flexible:
            return False
        try:
            self.pos, found = _skip_tagged_fields(self.data, self.pos, tag)
        except IndexError:
            raise _Malformed from None
        return found


def fetch_broker_names(version: int, payload: bytes, body_start: int) -> BrokerNames | None:
    """What in this Fetch response body names brokers; None when the bytes do not walk as
    a Fetch response of this version (the caller then looks another way)."""
    if version < FIRST_VERSION_WITH_READ_REPLICA:
        return NONE_NAMED
    reader = _Reader(payload, body_start, version >= FIRST_FLEXIBLE_VERSION)
    ids = False
    try:
        reader.skip(4 + 2 + 4)  # throttle time, error code, session id
        for _ in range(reader.length(4)):
            if version >= FIRST_VERSION_WITH_TOPIC_IDS:
                reader.skip(16)
            else:
                reader.skip_sized(2)  # the topic's name
            ids = _partitions_name_a_broker(reader, reader.length(4)) or ids
            reader.tagged_fields(NODE_ENDPOINTS_TAG)  # the topic's (none of them names one)
        endpoints = reader.tagged_fields(NODE_ENDPOINTS_TAG)
    except _Malformed:
        return None
    if reader.pos != reader.end:
        return None
    return BrokerNames(endpoints=endpoints, ids=ids)


def _partitions_name_a_broker(reader: _Reader, count: int) -> bool:
    """Walks ``count`` partitions of a topic; True when one names a broker by id. The
    loop is written out, with the usual one-byte varint inline: it runs once per
    partition of every Fetch response, and a response can carry a thousand of them."""
    data, pos, end = reader.data, reader.pos, reader.end
    ids = False
    try:
        if not reader.flexible:
            for _ in range(count):
                (aborted,) = _INT32(data, pos + _PARTITION_FIXED)
                pos += _PARTITION_FIXED + 4 + max(aborted, 0) * _ABORTED_FIXED
                replica, size = _TWO_INT32(data, pos)
                pos += 8 + max(size, 0)
                if pos > end:
                    raise _Malformed
                ids = ids or replica >= 0
        else:
            for _ in range(count):
                pos += _PARTITION_FIXED
                aborted = data[pos]  # a compact array: its length plus one, 0 for null
                pos += 1
                if aborted >= 0x80:
                    aborted, pos = _uvarint(data, pos - 1)
                if aborted > 1:
                    for _ in range(aborted - 1):
                        pos = _skip_tagged_fields(data, pos + _ABORTED_FIXED, -1)[0]
                (replica,) = _INT32(data, pos)
                size = data[pos + 4]  # compact bytes: the size plus one, 0 for null
                pos += 5
                if size >= 0x80:
                    size, pos = _uvarint(data, pos - 1)
                if size > 1:
                    pos += size - 1
                    if pos > end:
                        raise _Malformed
                if data[pos]:  # tagged fields (usually none: a zero byte)
                    pos, names_current_leader = _skip_tagged_fields(data, pos, CURRENT_LEADER_TAG)
                    ids = ids or names_current_leader
                else:
                    pos += 1
                ids = ids or replica >= 0
    except (IndexError, struct.error):
        raise _Malformed from None
    reader.pos = pos
    return ids


def _uvarint(data: bytes, pos: int) -> tuple[int, int]:
    """An unsigned varint of at most five bytes at ``pos``, and the position after it."""
    value, shift = 0, 0
    while True:
        if shift > 28:
            raise _Malformed
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _skip_tagged_fields(data: bytes, pos: int, tag: int) -> tuple[int, bool]:
    """The position after the tagged fields at ``pos``, and whether ``tag`` was one."""
    count = data[pos]
    pos += 1
    if count >= 0x80:
        count, pos = _uvarint(data, pos - 1)
    found = False
    end = len(data)
    for _ in range(count):
        this, pos = _uvarint(data, pos)
        size, pos = _uvarint(data, pos)
        pos += size
        if pos > end:
            raise _Malformed
        found = found or this == tag
    return pos, found
