"""Produce requests decoded by hand, into the entities kio decodes them into, with each
partition's records copied out by a function the caller chooses.

Why: kio's decoder copies the records out of the frame while holding the GIL. For a large
request that copy is most of the decoding (some 17 ms for 32 MB), and in a worker thread it
would still hold the event loop, so every other connection of the proxy, for as long. Here
the structure around the records is read in Python (a few fields per partition) and the
records are copied by `copy`: from a worker thread, one that lets go of the GIL
(`dedup.batches.copy_of`). tests/unit/test_produce_decoder.py checks the entities against
kio's for every version; whatever this does not read as kio would (tagged fields, a
malformed body, trailing bytes) is None, and kio decodes it and says what is wrong.

Layout (Kafka's ProduceRequest.json, v3-v12; flexible from v9): transactional_id nullable
string, acks int16, timeout_ms int32, topic_data: array of {name string, partition_data:
array of {index int32, records nullable bytes, tagged fields}, tagged fields}, tagged
fields.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable
from datetime import timedelta
from types import ModuleType
from typing import Any, Final

from kio.index import load_request_schema
from kio.schema.types import TopicName, TransactionalId
from kio.static.primitive import Records, i16, i32, i32Timedelta

from proxy.kafka.api_keys import ApiKey

FIRST_FLEXIBLE_VERSION: Final = 9
_INT16 = struct.Struct(">h")
_INT32 = struct.Struct(">i")
_ACKS_TIMEOUT = struct.Struct(">hi")

Copy = Callable[[bytes, int, int], bytes]  # (data, start, end) -> data[start:end]


class _Unreadable(Exception):
    pass


class _Reader:
    __slots__ = ("data", "flexible", "pos")

    def __init__(self, data: bytes, pos: int, flexible: bool) -> None:
        self.data, self.pos, self.flexible = data, pos, flexible

    def take(self, size: int) -> int:
        """Step over `size` bytes; where they start."""
        start = self.pos
        if size < 0 or start + size > len(self.data):
            raise _Unreadable
        self.pos = start + size
        return start

    def fixed(self, layout: struct.Struct) -> tuple[Any, ...]:
        return layout.unpack_from(self.data, self.take(layout.size))

    def uvarint(self) -> int:
        value = shift = 0
        while True:
            if shift > 28:
                raise _Unreadable
            byte = self.data[self.take(1)]
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7

    def length(self, *, short: bool = False) -> int:
        """A length prefix, -1 for null: a uvarint of length + 1 in flexible versions, else
        int16 for strings (`short`) and int32 for bytes and arrays."""
        if self.flexible:
            return self.uvarint() - 1
        layout = _INT16 if short else _INT32
        (value,) = layout.unpack_from(self.data, self.take(layout.size))
        return int(value)

    def string(self) -> str | None:
        size = self.length(short=True)
        if size < 0:
            return None
        start = self.take(size)
        try:
            return self.data[start : start + size].decode()
        except UnicodeDecodeError as exc:
            raise _Unreadable from exc

    def no_tags(self) -> None:
        if self.flexible and self.uvarint() != 0:
            raise _Unreadable  # tagged fields: kio's to read or refuse


def _modules() -> dict[int, ModuleType]:
    return {
        version: sys.modules[load_request_schema(ApiKey.PRODUCE, version).__module__]
        for version in range(3, 13)
    }


_MODULES: Final = _modules()


def decode_produce_request(version: int, payload: bytes, offset: int, copy: Copy) -> Any | None:
    """The body at `offset` as kio's ProduceRequest of `version`, or None (see above)."""
    module = _MODULES.get(version)
    if module is None:
        return None
    reader = _Reader(payload, offset, version >= FIRST_FLEXIBLE_VERSION)
    try:
        transactional_id = reader.string()
        acks, timeout_ms = reader.fixed(_ACKS_TIMEOUT)
        topics = []
        for _ in range(_array_length(reader)):
            name = reader.string()
            if name is None:
                return None
            partitions = []
            for _ in range(_array_length(reader)):
                (index,) = reader.fixed(_INT32)
                size = reader.length()
                records = None
                if size >= 0:
                    start = reader.take(size)
                    records = Records(copy(payload, start, start + size))
                reader.no_tags()
                partitions.append(module.PartitionProduceData(index=i32(index), records=records))
            reader.no_tags()
            topics.append(
                module.TopicProduceData(name=TopicName(name), partition_data=tuple(partitions))
            )
        reader.no_tags()
    except _Unreadable:
        return None
    if reader.pos != len(payload):
        return None
    return module.ProduceRequest(
        transactional_id=None if transactional_id is None else TransactionalId(transactional_id),
        acks=i16(acks),
        timeout=i32Timedelta.parse(timedelta(milliseconds=timeout_ms)),
        topic_data=tuple(topics),
    )


def _array_length(reader: _Reader) -> int:
    size = reader.length()
    if size < 0:
        raise _Unreadable  # a null array: kio's to refuse
    return size
