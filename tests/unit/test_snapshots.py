"""Snapshot encoding: round trips over the whole value range, strict decoding (only
CorruptSnapshot, whatever the bytes), capping, and the placement of keys."""

from __future__ import annotations

import contextlib
import json
import zlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dedup.chunks import MAX_CHUNK_COUNT, MAX_TOTAL_SIZE, ChunkProgress
from dedup.recovery import latest_runs, without_reset
from dedup.snapshots import (
    APPENDS_PER_PRODUCER,
    MAGIC,
    RESETS_SLOT,
    AppendEntry,
    ChunkEntry,
    CorruptSnapshot,
    ProducerEntry,
    Snapshot,
    _parse_key,
    decode_resets,
    slot_key,
    snapshot_partition,
)

pytestmark = pytest.mark.unit

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

topics = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-",
    min_size=1,
    max_size=40,
).filter(lambda t: t not in {".", ".."})
entries = st.builds(
    ProducerEntry,
    sequence=st.integers(INT64_MIN, INT64_MAX),
    last_seen_ms=st.integers(0, INT64_MAX),
)


@st.composite
def chunk_entries(draw: st.DrawFn) -> ChunkEntry:
    count = draw(st.integers(2, MAX_CHUNK_COUNT))
    total = draw(st.integers(0, MAX_TOTAL_SIZE))
    progress = ChunkProgress(
        sequence=draw(st.integers(INT64_MIN, INT64_MAX)),
        uuid=draw(st.text(min_size=1, max_size=20)),
        chunk_id=draw(st.integers(0, count - 2)),
        chunk_count=count,
        total_size=total,
        size=draw(st.integers(0, total)),
    )
    return ChunkEntry(progress, draw(st.integers(0, INT64_MAX)))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def snapshots_of(draw: st.DrawFn) -> Snapshot:
    producers = draw(st.dictionaries(st.text(), entries, max_size=20))
    chunks = draw(
        st.dictionaries(
            st.text(max_size=3) | st.sampled_from(sorted(producers) or [""]),
            chunk_entries(),
            max_size=4,
        )
    )
    offset = draw(st.integers(0, INT64_MAX))
    appends = {}
    for name in draw(st.sets(st.sampled_from(sorted(producers)), max_size=3)) if producers else ():
        appends[name] = tuple(
            draw(append_entries(below=offset), label=name)
            for _ in range(draw(st.integers(1, APPENDS_PER_PRODUCER)))
        )
    return Snapshot(
        topic=draw(topics),
        partition=draw(st.integers(0, 2**31 - 1)),
        offset=offset,
        created_ms=draw(st.integers(0, INT64_MAX)),
        generation=draw(st.integers(0, INT64_MAX)),
        producers=producers,
        # A message in progress is above its producer's complete sequence.
        chunks={
            name: chunk
            for name, chunk in chunks.items()
            if name not in producers or chunk.progress.sequence > producers[name].sequence
        },
        topic_id=draw(st.none() | st.uuids().map(str)),
        appends=appends if offset > 0 else {},
    )


@st.composite
def append_entries(draw: st.DrawFn, below: int) -> AppendEntry:
    """An append that ends below offset `below` (> 0)."""
    base = draw(st.integers(0, max(0, below - 1)))
    count = draw(st.integers(1, max(1, min(below - base, 2**31 - 1))))
    appended = draw(st.integers(-1, INT64_MAX))
    return AppendEntry(draw(st.integers(INT64_MIN, INT64_MAX)), count, base, appended)


snapshots = snapshots_of()


def snapshot(**changes: Any) -> Snapshot:
    fields: dict[str, Any] = {
        "topic": "orders",
        "partition": 3,
        "offset": 1000,
        "created_ms": 1_700_000_000_000,
        "generation": 7,
        "producers": {"a": ProducerEntry(5, 100), "b": ProducerEntry(-1, 200)},
    }
    return Snapshot(**(fields | changes))


def body(**changes: Any) -> dict[str, Any]:
    """The JSON of a valid snapshot, with some fields replaced (or removed when set to ...)."""
    doc: dict[str, Any] = json.loads(snapshot().encode()[len(MAGIC) :])
    for name, value in changes.items():
        if value is ...:
            del doc[name]
        else:
            doc[name] = value
    return doc


def raw(doc: object) -> bytes:
    return MAGIC + json.dumps(doc).encode()


@settings(max_examples=300)
@given(snapshots)
def test_encode_decode_round_trip(original: Snapshot) -> None:
    encoded = original.encode()
    assert encoded.startswith(MAGIC)
    assert Snapshot.decode(encoded) == original


def test_the_encoding_is_compact_json_after_the_magic() -> None:
    encoded = snapshot().encode()
    assert encoded == (
        b'DDS1{"topic":"orders","partition":3,"offset":1000,"created_ms":1700000000000,'
        b'"generation":7,"producers":{"a":[5,100],"b":[-1,200]},"chunks":{}}'
    )


def test_the_int64_bounds_survive_exactly() -> None:
    original = snapshot(
        producers={"min": ProducerEntry(INT64_MIN, 0), "max": ProducerEntry(INT64_MAX, INT64_MAX)}
    )
    assert Snapshot.decode(original.encode()).producers == original.producers


@settings(max_examples=200)
@given(snapshots, st.data())
def test_every_truncation_is_corrupt(original: Snapshot, data: st.DataObject) -> None:
    encoded = original.encode()
    cut = data.draw(st.integers(0, len(encoded) - 1))
    with pytest.raises(CorruptSnapshot):
        Snapshot.decode(encoded[:cut])


@settings(max_examples=500)
@given(snapshots, st.data())
def test_flipped_bits_give_a_snapshot_or_corrupt_snapshot(
    original: Snapshot, data: st.DataObject
) -> None:
    damaged = bytearray(original.encode())
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(damaged) - 1))
        damaged[position] ^= 1 << data.draw(st.integers(0, 7))
    try:
        decoded = Snapshot.decode(bytes(damaged))
    except CorruptSnapshot:
        return
    assert isinstance(decoded, Snapshot)  # a flip in a digit can still be a valid snapshot


@settings(max_examples=500)
@given(st.binary(max_size=300) | st.binary(max_size=300).map(lambda b: MAGIC + b))
def test_random_bytes_are_corrupt(data: bytes) -> None:
    with pytest.raises(CorruptSnapshot):
        Snapshot.decode(data)


@settings(max_examples=500)
@given(
    st.dictionaries(
        st.sampled_from(["topic", "partition", "offset", "created_ms", "generation"])
        | st.sampled_from(["producers", "chunks", "topic_id", "other"]),
        json_values | st.dictionaries(st.text(max_size=3), json_values, max_size=3),
        max_size=4,
    ),
    st.sets(st.sampled_from(["topic", "offset", "producers", "chunks"]), max_size=2),
)
def test_any_json_fields_decode_or_are_corrupt(replaced: dict[str, Any], removed: set[str]) -> None:
    doc = body(**replaced, **dict.fromkeys(removed - replaced.keys(), ...))
    with contextlib.suppress(CorruptSnapshot):
        assert isinstance(Snapshot.decode(raw(doc)), Snapshot)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "not a snapshot"),
        (b"DDS", "not a snapshot"),
        (b"PK\x03\x04garbage", "not a snapshot"),
        (b"DDS2{}", "unsupported snapshot format version b'DDS2'"),
        (MAGIC, "not valid JSON"),
        (MAGIC + b"{", "not valid JSON"),
        (MAGIC + b"\xff\xfe{}", "not valid JSON"),
        (MAGIC + b"[1, 2]", "body is a JSON list"),
        (MAGIC + b"{}", "missing fields"),
        (MAGIC + b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),  # recursion
        (MAGIC + b'{"a": NaN}', "NaN is not a valid number"),
        (MAGIC + b'{"a": 1, "a": 2}', "duplicate key 'a'"),
        (MAGIC + b"9" * 5000, "not valid JSON"),  # beyond Python's int digit limit
    ],
)
def test_decode_says_why(data: bytes, reason: str) -> None:
    with pytest.raises(CorruptSnapshot, match=reason.replace("[", r"\[").replace("(", r"\(")):
        Snapshot.decode(data)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"offset": -1}, "offset -1 is outside"),
        ({"offset": 2**63}, "offset 9223372036854775808 is outside"),
        ({"offset": 1.0}, "offset must be an integer, not float"),
        ({"offset": "1"}, "offset must be an integer, not str"),
        ({"partition": True}, "partition must be an integer, not bool"),
        ({"partition": 2**31}, "partition 2147483648 is outside"),
        ({"generation": -1}, "generation -1 is outside"),
        ({"created_ms": None}, "created_ms must be an integer, not NoneType"),
        ({"topic": "a/b"}, "not a legal Kafka topic name: 'a/b'"),
        ({"topic": ""}, "not a legal Kafka topic name"),
        ({"topic": 5}, "not a legal Kafka topic name: 5"),
        ({"producers": [["a", 1, 2]]}, "producers is a JSON list"),
        ({"producers": {"a": [2**63, 0]}}, "producer 'a': sequence 9223372036854775808 is outside"),
        ({"producers": {"a": [-(2**63) - 1, 0]}}, "producer 'a': sequence -9223372036854775809"),
        ({"producers": {"a": [1]}}, r"producer 'a': expected \[sequence, last_seen_ms\]"),
        ({"producers": {"a": {"sequence": 1}}}, "producer 'a': expected"),
        ({"producers": {"a": [1, -5]}}, "producer 'a': last_seen_ms -5 is outside"),
        ({"producers": {"a": [False, 0]}}, "producer 'a': sequence must be an integer, not bool"),
        ({"chunks": []}, "chunks is a JSON list"),
        ({"chunks": {"c": [1, 0, 2, 10, 5]}}, r"chunks of 'c': expected \[sequence, chunk_id"),
        ({"chunks": {"c": [1, 1, 2, 10, 5, "u", 0]}}, "chunks of 'c': chunk_id 1 is outside"),
        ({"chunks": {"c": [1, 0, 1, 10, 5, "u", 0]}}, "chunks of 'c': chunk_count 1 is outside"),
        ({"chunks": {"c": [1, 0, 2, 10, 11, "u", 0]}}, "chunks of 'c': size 11 is outside"),
        ({"chunks": {"c": [1, 0, 2, 10, 5, "", 0]}}, "chunks of 'c': uuid must be a non-empty"),
        ({"chunks": {"c": [1, 0, 2, 10, 5, 7, 0]}}, "chunks of 'c': uuid must be a non-empty"),
        ({"chunks": {"c": [1.5, 0, 2, 10, 5, "u", 0]}}, "chunks of 'c': sequence must be an"),
        ({"chunks": {"c": [1, 0, 2, 10, 5, "u", -1]}}, "chunks of 'c': last_seen_ms -1 is"),
        ({"chunks": {"a": [5, 0, 2, 10, 5, "u", 0]}}, "sequence 5 in progress is not above"),
        ({"chunks": ...}, r"missing fields \['chunks'\]"),
        ({"extra": 1}, r"unknown fields \['extra'\]"),
        ({"topic_id": 5}, "topic_id is not a lower-case UUID: 5"),
        ({"topic_id": None}, "topic_id is not a lower-case UUID: None"),
        ({"topic_id": "5C1A4F3E-0000-0000-0000-000000000000"}, "not a lower-case UUID"),
        ({"topic_id": "not-a-uuid"}, "not a lower-case UUID"),
        ({"appends": []}, "appends is a JSON list"),
        ({"appends": {"a": [1, 1, 0, -1]}}, r"appends of 'a': expected .*, got 1$"),
        ({"appends": {"a": [[1, 1, 0]]}}, r"appends of 'a': expected \[first, count"),
        ({"appends": {"a": [[1, 0, 0, -1]]}}, "appends of 'a': count 0 is outside"),
        ({"appends": {"a": [[1, 1, -1, -1]]}}, "appends of 'a': base_offset -1 is outside"),
        ({"appends": {"a": [[1, 1, 0, -2]]}}, "log_append_time_ms -2 is outside"),
        ({"appends": {"a": [[1, 1, 0, 1.5]]}}, "log_append_time_ms must be an integer"),
        ({"appends": {"a": [[1, 2, 999, -1]]}}, "2 at 999 reach past the snapshot's offset 1000"),
        ({"appends": {"a": []}}, "appends of 'a': 1 to 5 expected"),
        ({"appends": {"a": [[i, 1, i, -1] for i in range(6)]}}, "1 to 5 expected"),
        ({"appends": {"z": [[1, 1, 0, -1]]}}, "appends of 'z': not one of the producers"),
    ],
)
def test_decode_checks_every_field(changes: dict[str, Any], reason: str) -> None:
    with pytest.raises(CorruptSnapshot, match=reason):
        Snapshot.decode(raw(body(**changes)))


def test_the_topic_id_is_kept_when_known_and_absent_before() -> None:
    """Snapshots written before topic ids were recorded have none, and still decode."""
    topic_id = "5c1a4f3e-9d2b-4c1e-8f00-0123456789ab"
    known = snapshot(topic_id=topic_id)
    assert json.loads(known.encode()[len(MAGIC) :])["topic_id"] == topic_id
    assert Snapshot.decode(known.encode()) == known
    assert "topic_id" not in json.loads(snapshot().encode()[len(MAGIC) :])
    assert Snapshot.decode(raw(body())).topic_id is None


def test_appends_are_written_only_when_there_are_any_and_read_back() -> None:
    """A snapshot without appends is the format readers before them read; one with them
    keeps each producer's latest batches below its offset."""
    assert "appends" not in json.loads(snapshot().encode()[len(MAGIC) :])
    carried = snapshot(appends={"a": (AppendEntry(3, 2, 10, -1), AppendEntry(5, 1, 20, 77))})
    assert carried.encode().endswith(b'"appends":{"a":[[3,2,10,-1],[5,1,20,77]]}}')
    assert Snapshot.decode(carried.encode()) == carried
    assert Snapshot.decode(raw(body())).appends == {}


def test_producers_left_out_take_their_appends_along() -> None:
    carried = snapshot(
        producers={"a": ProducerEntry(5, 100), "b": ProducerEntry(9, 200)},
        appends={"a": (AppendEntry(5, 1, 10, -1),), "b": (AppendEntry(9, 1, 11, -1),)},
    )
    assert carried.capped(1).appends == {"b": (AppendEntry(9, 1, 11, -1),)}
    assert without_reset(carried, {"b": 1000}).appends == {"a": (AppendEntry(5, 1, 10, -1),)}


def test_invalid_snapshots_cannot_be_built() -> None:
    with pytest.raises(ValueError, match="offset -1"):
        snapshot(offset=-1)
    with pytest.raises(ValueError, match="sequence"):
        ProducerEntry(2**63, 0)
    with pytest.raises(ValueError, match="not a ProducerEntry"):
        snapshot(producers={"a": 5})
    with pytest.raises(ValueError, match="chunks key must be a string"):
        snapshot(chunks={1: 2})
    with pytest.raises(ValueError, match="not a ChunkEntry"):
        snapshot(chunks={"a": {"uuid": "x"}})
    with pytest.raises(ValueError, match="not above its complete sequence 5"):
        snapshot(chunks={"a": ChunkEntry(ChunkProgress(5, "a-5", 0, 2, 10, 4), 0)})
    with pytest.raises(ValueError, match="appends of 'a': not an AppendEntry"):
        snapshot(appends={"a": ((3, 1, 0, -1),)})


def test_chunks_in_progress_round_trip_in_their_documented_form() -> None:
    original = snapshot(
        chunks={
            "a": ChunkEntry(ChunkProgress(6, "a-6", 1, 3, 2_500_000, 2_000_000), 300),
            "only-chunks": ChunkEntry(ChunkProgress(-4, "u u", 0, 2, 7, 0), 9),
        }
    )
    encoded = original.encode()
    assert encoded.endswith(
        b'"chunks":{"a":[6,1,3,2500000,2000000,"a-6",300],"only-chunks":[-4,0,2,7,0,"u u",9]}}'
    )
    assert Snapshot.decode(encoded) == original
    assert snapshot().chunks == {}


def test_capped_keeps_chunks_of_the_kept_producers() -> None:
    original = snapshot(
        producers={"old": ProducerEntry(1, 10), "new": ProducerEntry(2, 40)},
        chunks={
            "old": ChunkEntry(ChunkProgress(2, "x", 0, 2, 10, 5), 50),  # seen later in chunks
            "chunk-only": ChunkEntry(ChunkProgress(0, "y", 0, 2, 10, 5), 20),
        },
    )
    capped = original.capped(2)
    assert set(capped.producers) == {"old", "new"}
    assert set(capped.chunks) == {"old"}
    assert set(original.capped(1).chunks) == {"old"} and set(original.capped(1).producers) == {
        "old"
    }


def test_capped_keeps_the_most_recently_seen() -> None:
    original = snapshot(
        producers={
            "old": ProducerEntry(1, 10),
            "new": ProducerEntry(2, 40),
            "mid": ProducerEntry(3, 20),
            "tie-b": ProducerEntry(4, 30),
            "tie-a": ProducerEntry(5, 30),
        }
    )
    capped = original.capped(3)
    assert dict(capped.producers) == {
        "new": ProducerEntry(2, 40),
        "tie-b": ProducerEntry(4, 30),
        "tie-a": ProducerEntry(5, 30),
    }
    assert list(capped.producers) == ["new", "tie-b", "tie-a"]  # the original order
    assert (capped.topic, capped.offset, capped.generation) == ("orders", 1000, 7)
    # Ties go as Redis evicts: the lexicographically smaller name first.
    assert set(original.capped(2).producers) == {"new", "tie-b"}
    assert original.capped(5) is original
    assert original.capped(0).producers == {}
    with pytest.raises(ValueError):
        original.capped(-1)


@given(st.dictionaries(st.text(max_size=5), entries, max_size=30), st.integers(0, 40))
def test_capped_drops_only_less_recent_producers(
    producers: dict[str, ProducerEntry], limit: int
) -> None:
    capped = snapshot(producers=producers).capped(limit)
    assert len(capped.producers) == min(limit, len(producers))
    assert all(producers[name] == entry for name, entry in capped.producers.items())
    dropped = producers.keys() - capped.producers.keys()
    if dropped and capped.producers:
        assert max(producers[n].last_seen_ms for n in dropped) <= min(
            e.last_seen_ms for e in capped.producers.values()
        )


def test_keys_and_placement() -> None:
    assert slot_key("orders", 3, 7) == "orders/3/1" == snapshot().key
    assert slot_key("orders", 3, 8) == "orders/3/0"
    assert snapshot_partition("orders", 3, 8) == zlib.crc32(b"orders/3") % 8
    assert snapshot_partition("orders", 3, 1) == 0


# ----------------------------------------------------------------------------- producer resets


def test_a_reset_at_or_past_the_snapshot_drops_the_producer_from_it() -> None:
    taken = snapshot(offset=1000)
    assert without_reset(taken, {}) is taken
    assert without_reset(taken, {"a": 999}) is taken  # reset before: the snapshot is after it
    assert set(without_reset(taken, {"a": 1000}).producers) == {"b"}  # maybe taken before it
    assert set(without_reset(taken, {"a": 5000, "b": 1001}).producers) == set()
    assert without_reset(taken, {"zzz": 5000}) is taken  # not in the snapshot


def test_a_recovery_seeds_the_snapshots_appends_then_the_tails_runs() -> None:
    """Where each loaded producer's latest batches are: the snapshot's appends (below its
    offset), then what the replay followed after it; the latest five."""
    taken = snapshot(
        appends={
            "a": tuple(AppendEntry(i, 1, 900 + i, -1) for i in range(4)),
            "b": (AppendEntry(-1, 1, 950, -1),),
        }
    )
    tail = {"a": [(4, 10, 1000, -1), (14, 5, 1012, -1)], "c": [(0, 3, 1020, -1)]}
    assert latest_runs(taken, tail, {"a", "c"}) == {
        # The tail's 2 after the snapshot's 4, of which the oldest is left out
        "a": [(1, 1, 901, -1), (2, 1, 902, -1), (3, 1, 903, -1), *tail["a"]],
        "c": [(0, 3, 1020, -1)],
    }, "b not loaded: none of its"
    assert latest_runs(None, tail, {"a"}) == {"a": tail["a"]}
    assert latest_runs(taken, {}, {"b"}) == {"b": [(-1, 1, 950, -1)]}


def test_resets_records_decode_or_are_corrupt() -> None:
    assert decode_resets(b'{"resets": {"p": 51, "q": 0}}') == {"p": 51, "q": 0}
    for bad in (
        b"",
        b"[]",
        b'{"resets": []}',
        b'{"resets": {"p": -1}}',
        b'{"resets": {"p": "51"}}',
        b'{"resets": {"p": true}}',
        b'{"other": {}}',
    ):
        with pytest.raises(CorruptSnapshot):
            decode_resets(bad)


def test_a_resets_key_names_its_partition() -> None:
    assert _parse_key(b"orders/3/resets") == ("orders", 3, RESETS_SLOT)
    assert _parse_key(b"orders/3/1") == ("orders", 3, 1)
    assert _parse_key(b"orders/3/reset") == ("orders", 3, None)


def test_a_snapshot_over_its_byte_bound_keeps_the_most_recently_seen_that_fit() -> None:
    long_names = {("p" * 4000) + str(n): ProducerEntry(n, last_seen_ms=1000 + n) for n in range(50)}
    taken = snapshot(producers=long_names)
    assert taken.within_bytes(len(taken.encode())) == (taken, taken.encode())
    assert taken.within_bytes(len(taken.encode()))[0] is taken
    bound = len(taken.encode()) // 3
    fitted, encoded = taken.within_bytes(bound)
    assert encoded == fitted.encode()
    assert len(fitted.encode()) <= bound
    kept = sorted(entry.sequence for entry in fitted.producers.values())
    assert kept == list(range(50 - len(kept), 50)), "the most recently seen are kept"
    one_more = taken.capped(len(kept) + 1)
    assert len(one_more.encode()) > bound, "as many as fit"
    assert taken.within_bytes(10)[0].producers == {}


def test_a_snapshot_over_its_byte_bound_leaves_its_appends_out_first() -> None:
    producers = {f"p{n}": ProducerEntry(n, last_seen_ms=n) for n in range(20)}
    appends = {name: (AppendEntry(1, 1, 10, -1),) * APPENDS_PER_PRODUCER for name in producers}
    carried = snapshot(producers=producers, appends=appends)
    bare = snapshot(producers=producers)
    fitted, encoded = carried.within_bytes(len(bare.encode()))
    assert (fitted, encoded) == (bare, bare.encode()), "every producer kept, no append"
    assert carried.within_bytes(len(carried.encode()))[0] is carried
