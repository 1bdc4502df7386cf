"""Whether a Fetch response carries KIP-951 broker endpoints, found by walking its structure.

A Fetch response is mostly record bytes; its `NodeEndpoints` (v16+) are a tagged field at
the very end. Decoding the response, or scanning megabytes of records for a host name, to
learn whether they are there costs the proxy's consumers a fifth of their throughput. The
walk below steps over each partition's records by their length prefix, so it costs per
partition, not per byte, and looks at the top-level tagged fields only.

Layout (Kafka's FetchResponse.json, flexible versions 12+): throttle_time_ms int32,
error_code int16, session_id int32, responses: compact array of {topic_id uuid (v13+) or
topic compact string (v12), partitions: compact array of {partition_index int32,
error_code int16, high_watermark int64, last_stable_offset int64, log_start_offset int64,
aborted_transactions: compact nullable array of {producer_id int64, first_offset int64,
tagged fields}, preferred_read_replica int32, records: compact nullable bytes, tagged
fields}, tagged fields}, tagged fields (tag 0: NodeEndpoints, v16+).
"""

from __future__ import annotations

from typing import Final

FIRST_VERSION_WITH_ENDPOINTS: Final = 16
NODE_ENDPOINTS_TAG: Final = 0
_PARTITION_FIXED: Final = 4 + 2 + 8 + 8 + 8  # index, error code, three offsets
_ABORTED_FIXED: Final = 8 + 8  # producer id, first offset


class _Malformed(Exception):
    pass


class _Reader:
    __slots__ = ("data", "end", "pos")

    def __init__(self, data: bytes, pos: int) -> None:
        self.data, self.pos, self.end = data, pos, len(data)

    def skip(self, size: int) -> None:
        if size < 0 or self.pos + size > self.end:
            raise _Malformed
        self.pos += size

    def uvarint(self) -> int:
        value, shift = 0, 0
        while True:
            if self.pos >= self.end or shift > 28:
                raise _Malformed
            byte = self.data[self.pos]
            self.pos += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7

    def tagged_fields(self) -> set[int]:
        tags = set()
        for _ in range(self.uvarint()):
            tags.add(self.uvarint())
            self.skip(self.uvarint())
        return tags

    def compact_length(self) -> int:
        """A compact array's or bytes' length; -1 for null."""
        return self.uvarint() - 1


def fetch_names_endpoints(version: int, payload: bytes, body_start: int) -> bool | None:
    """Whether this Fetch response body carries `NodeEndpoints`; None when the bytes do not
    walk as a Fetch response of this version (the caller then looks another way)."""
    if version < FIRST_VERSION_WITH_ENDPOINTS:
        return False
    reader = _Reader(payload, body_start)
    try:
        reader.skip(4 + 2 + 4)  # throttle time, error code, session id
        for _ in range(reader.compact_length()):
            reader.skip(16)  # topic id
            for _ in range(reader.compact_length()):
                _skip_partition(reader)
            reader.tagged_fields()
        tags = reader.tagged_fields()
    except _Malformed:
        return None
    if reader.pos != reader.end:
        return None
    return NODE_ENDPOINTS_TAG in tags


def _skip_partition(reader: _Reader) -> None:
    reader.skip(_PARTITION_FIXED)
    for _ in range(reader.compact_length()):  # aborted transactions (null: no loop)
        reader.skip(_ABORTED_FIXED)
        reader.tagged_fields()
    reader.skip(4)  # preferred read replica
    records = reader.compact_length()
    if records > 0:
        reader.skip(records)
    reader.tagged_fields()
