"""Tail replay (`dedup.replay`) against a real Kafka: identities by the header rules, a
sub-range, transactions (read_committed up to the last stable offset, uncommitted past
it), a compacted log with gaps, a log start moved by DeleteRecords, and the errors.

Records are written directly to Kafka with confluent-kafka (not through the proxy), so the
log holds exactly what each test says, bad identities included.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from dedup.batches import HEADER_PRODUCER, HEADER_SEQUENCE, IdentityHeaders
from dedup.open_transactions import wait_for_open_transactions
from dedup.replay import SEQUENCE_MAX, ReplayError, ReplayResult, replay_partition
from deploy.local import EnvInfo
from tests.support.topics import new_topic

pytestmark = pytest.mark.integration

T0 = 1_700_000_000_000  # record timestamps: T0 + something, so last-seen times are exact
Headers = list[tuple[str, str | bytes | None]]


def ident(producer: bytes | None, sequence: bytes | None) -> Headers:
    return [(HEADER_PRODUCER, producer), (HEADER_SEQUENCE, sequence)]


def produce(
    bootstrap: str,
    topic: str,
    records: Sequence[tuple[Headers | None, int]],
    key: bytes | None = None,
    keys: Sequence[bytes] | None = None,
) -> list[int]:
    """Write (headers, timestamp) records in order to partition 0; their offsets."""
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 0})
    offsets: list[int] = []
    errors: list[Any] = []

    def delivered(err: Any, msg: Any) -> None:
        if err is not None:
            errors.append(err)
        else:
            offsets.append(msg.offset())

    for index, (headers, timestamp) in enumerate(records):
        producer.produce(
            topic,
            value=b"v%d" % index,
            key=keys[index] if keys is not None else key,
            partition=0,
            headers=headers,
            timestamp=timestamp,
            on_delivery=delivered,
        )
        producer.flush(30)  # one at a time: offsets in the order given
    assert not errors, errors
    return offsets


def high_watermark(bootstrap: str, topic: str) -> tuple[int, int]:
    """(log start, high watermark). read_uncommitted: with librdkafka's default
    (read_committed) the "high" watermark is the last stable offset."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "probe",
            "isolation.level": "read_uncommitted",
        }
    )
    try:
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=30)
        return int(low), int(high)
    finally:
        consumer.close()


def offsets_present(bootstrap: str, topic: str, end: int) -> list[int]:
    """The offsets of the records a consumer sees below `end` (independent of the replay)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "probe",
            "enable.partition.eof": True,
            "enable.auto.commit": False,
        }
    )
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        seen: list[int] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            message = consumer.poll(1)
            if message is None:
                continue
            if message.error() is not None:
                break  # partition EOF
            offset = message.offset()
            assert offset is not None
            seen.append(offset)
        return [o for o in seen if o < end]
    finally:
        consumer.close()


@pytest.fixture
def compacted_topic(local_env: EnvInfo) -> Iterator[str]:
    name = new_topic(
        local_env.bootstrap,
        config={
            "cleanup.policy": "compact",
            "segment.ms": "100",
            "min.cleanable.dirty.ratio": "0.01",
            "min.compaction.lag.ms": "0",
            "delete.retention.ms": "100",
        },
    )
    yield name
    admin = AdminClient({"bootstrap.servers": local_env.bootstrap})  # kept alive for the result
    admin.delete_topics([name])[name].result(30)


# --------------------------------------------------------------------------- the rules

MIXED: list[tuple[Headers | None, int]] = [
    (ident(b"a", b"1"), T0 + 0),  # 0
    (ident(b"a", b"5"), T0 + 1),  # 1
    (ident(b"a", b"3"), T0 + 5),  # 2 out of order: a's highest stays 5, its time rises
    (ident(b"b", b"-7"), T0 - 100),  # 3
    (None, T0 + 50),  # 4 no headers
    ([(HEADER_PRODUCER, b"a")], T0 + 50),  # 5 producer only
    (ident(b"a", b"abc"), T0 + 50),  # 6 not a number
    (ident(b"a", b"9223372036854775808"), T0 + 50),  # 7 beyond int64
    (ident(b"", b"8"), T0 + 50),  # 8 empty producer
    ([*ident(b"a", b"999"), (HEADER_SEQUENCE, b"2")], T0 + 7),  # 9 last wins: a/2
    ([(HEADER_PRODUCER, b"zzz"), *ident(b"c", b"+4")], T0 + 8),  # 10 last wins: c/4
    (ident(b"\xff\xfe", b"1"), T0 + 50),  # 11 producer not UTF-8
    (ident("d\u00e9j\u00e0".encode(), b"9223372036854775807"), T0 + 9),  # 12 int64 max
    ([("trace", b"x")], T0 + 50),  # 13 other headers only
    (ident(b"a", b"4"), T0 + 10),  # 14
    (ident(b"b", b"-8"), T0 + 11),  # 15
]


def test_replay_applies_the_identity_rules(local_env: EnvInfo, topic: str) -> None:
    produce(local_env.bootstrap, topic, MIXED)
    low, high = high_watermark(local_env.bootstrap, topic)
    assert (low, high) == (0, len(MIXED))
    progress: list[tuple[int, int]] = []

    result = replay_partition(
        local_env.bootstrap, topic, 0, 0, high, progress=lambda r, o: progress.append((r, o))
    )

    assert isinstance(result, ReplayResult)
    assert result.highest == {
        "a": (5, T0 + 10),
        "b": (-7, T0 + 11),
        "c": (4, T0 + 8),
        "d\u00e9j\u00e0": (SEQUENCE_MAX, T0 + 9),
    }
    assert (result.topic, result.partition, result.start, result.end) == (topic, 0, 0, high)
    assert (result.records, result.identified, result.skipped) == (16, 9, 7)
    assert not result.truncated_start
    assert result.seconds > 0
    assert progress[-1] == (16, high)


def test_replay_of_a_sub_range_counts_only_that_range(local_env: EnvInfo, topic: str) -> None:
    produce(local_env.bootstrap, topic, MIXED)
    result = replay_partition(local_env.bootstrap, topic, 0, 2, 10)  # records 2..9
    assert result.highest == {"a": (3, T0 + 7), "b": (-7, T0 - 100)}
    assert (result.records, result.identified, result.skipped) == (8, 3, 5)
    assert (result.start, result.end, result.truncated_start) == (2, 10, False)

    one = replay_partition(local_env.bootstrap, topic, 0, 12, 13)
    assert one.highest == {"d\u00e9j\u00e0": (SEQUENCE_MAX, T0 + 9)}
    assert one.records == 1


def test_replay_with_custom_header_names(local_env: EnvInfo, topic: str) -> None:
    names = IdentityHeaders(producer="app.id", sequence="app.seq")
    produce(
        local_env.bootstrap,
        topic,
        [
            ([("app.seq", b"3"), ("app.id", b"x")], T0),
            (ident(b"y", b"1"), T0),  # default names: no identity here
            ([("app.id", b"x"), ("app.seq", b"2")], T0 + 1),
        ],
    )
    result = replay_partition(local_env.bootstrap, topic, 0, 0, 3, names)
    assert result.highest == {"x": (3, T0 + 1)}
    assert (result.records, result.identified, result.skipped) == (3, 2, 1)


def test_empty_range_returns_at_once_without_kafka() -> None:
    result = replay_partition("127.0.0.1:1", "nowhere", 3, 7, 7)
    assert (result.records, result.highest, result.start, result.end) == (0, {}, 7, 7)
    assert replay_partition("127.0.0.1:1", "nowhere", 0, 9, 2).records == 0


# --------------------------------------------------------------------------- transactions


def test_aborted_transactions_do_not_count_and_open_ones_do(local_env: EnvInfo, topic: str) -> None:
    """read_committed up to the last stable offset: a record of a transaction aborted before
    the replay does not count (so a re-send of its sequence outside a transaction is
    written, not dropped while acknowledged); committed and plain records do; control
    records (the markers) are not records and leave gaps the replay steps over, also at the
    very end of the log. Past the last stable offset (a transaction still open), records
    are read uncommitted and count: the proxy's own writes after it must be read."""
    producer = Producer(
        {
            "bootstrap.servers": local_env.bootstrap,
            "transactional.id": f"replay-test-{uuid.uuid4().hex[:8]}",
            "linger.ms": 0,
        }
    )
    producer.init_transactions(30)

    def transaction(records: Sequence[tuple[bytes, bytes]], commit: bool) -> None:
        producer.begin_transaction()
        for name, sequence in records:
            producer.produce(topic, b"v", partition=0, headers=ident(name, sequence))
        producer.flush(30)
        if commit:
            producer.commit_transaction(30)
        else:
            producer.abort_transaction(30)

    transaction([(b"tx", b"10"), (b"tx", b"11"), (b"tx", b"12")], commit=False)
    transaction([(b"tx", b"1"), (b"other", b"3")], commit=True)
    produce(local_env.bootstrap, topic, [(ident(b"plain", b"7"), T0)])
    transaction([(b"late", b"50")], commit=False)  # the log ends with an abort marker
    _low, high = high_watermark(local_env.bootstrap, topic)
    assert high == 7 + 3  # 7 records, 3 markers

    result = replay_partition(local_env.bootstrap, topic, 0, 0, high, timeout_s=20)
    assert {p: s for p, (s, _t) in result.highest.items()} == {"tx": 1, "other": 3, "plain": 7}
    assert (result.records, result.identified, result.skipped) == (3, 3, 0)
    assert (result.end, result.uncommitted_from) == (high, None)

    # An open transaction (no marker yet), then a plain record after it, as the proxy's own
    # write would be: the last stable offset stays at the open transaction's first record,
    # and from there on records are read uncommitted, up to the high watermark.
    producer.begin_transaction()
    producer.produce(topic, b"v", partition=0, headers=ident(b"open", b"5"))
    producer.flush(30)
    produce(local_env.bootstrap, topic, [(ident(b"plain", b"8"), T0 + 1)])
    _low, high_open = high_watermark(local_env.bootstrap, topic)
    assert high_open == high + 2
    try:
        result = replay_partition(local_env.bootstrap, topic, 0, 0, high_open, timeout_s=20)
        assert {p: s for p, (s, _t) in result.highest.items()} == {
            "tx": 1,
            "other": 3,
            "plain": 8,
            "open": 5,
        }
        assert (result.records, result.uncommitted_from) == (5, high)
        # A range that starts at the open transaction is read uncommitted from its start.
        result = replay_partition(local_env.bootstrap, topic, 0, high, high_open, timeout_s=20)
        assert result.highest.keys() == {"open", "plain"}
        assert (result.records, result.uncommitted_from) == (2, high)
    finally:
        producer.abort_transaction(30)


async def test_a_transaction_open_below_the_end_is_waited_for(
    local_env: EnvInfo, topic: str
) -> None:
    """A transaction open below the end holds the last stable offset back
    (`dedup.open_transactions`). A wait that runs out says where it stands; one during which
    the transaction aborts ends with it, and the replay after it reads everything committed:
    the aborted record does not count."""
    producer = Producer(
        {
            "bootstrap.servers": local_env.bootstrap,
            "transactional.id": f"replay-wait-{uuid.uuid4().hex[:8]}",
            "linger.ms": 0,
        }
    )
    producer.init_transactions(30)
    produce(local_env.bootstrap, topic, [(ident(b"plain", b"1"), T0)])
    producer.begin_transaction()
    producer.produce(topic, b"v", partition=0, headers=ident(b"open", b"5"))
    producer.flush(30)
    produce(local_env.bootstrap, topic, [(ident(b"plain", b"2"), T0 + 1)])
    _low, high = high_watermark(local_env.bootstrap, topic)
    assert high == 3
    where = TopicPartition(topic, 0)

    once = await wait_for_open_transactions(local_env.bootstrap, {}, where, high, 0)
    assert (once.stable, once.decided(high)) == (1, False)
    ran_out = await wait_for_open_transactions(local_env.bootstrap, {}, where, high, 0.5)
    assert (ran_out.stable, ran_out.decided(high)) == (1, False)
    assert 0.5 <= ran_out.seconds < 10

    aborting = threading.Timer(1.0, producer.abort_transaction, args=(30,))
    aborting.start()
    try:
        ended = await wait_for_open_transactions(local_env.bootstrap, {}, where, high, 60)
    finally:
        aborting.join()
    assert ended.decided(high) and 1.0 <= ended.seconds < 60, ended
    result = replay_partition(local_env.bootstrap, topic, 0, 0, high, timeout_s=20)
    assert {p: s for p, (s, _t) in result.highest.items()} == {"plain": 2}
    assert (result.records, result.end, result.uncommitted_from) == (2, high, None)


async def test_a_negative_wait_is_refused() -> None:
    with pytest.raises(ValueError, match="wait_s"):
        await wait_for_open_transactions("unused:9092", {}, TopicPartition("t", 0), 1, -1)


# --------------------------------------------------------------------------- gaps, log start


def test_compacted_log_with_gaps(local_env: EnvInfo, compacted_topic: str) -> None:
    """After compaction offsets have holes, also right before the replay's end: the replay
    ends by offset (a record at >= end - 1, or EOF), never by counting records."""
    topic = compacted_topic
    records: list[tuple[Headers | None, int]] = []
    keys: list[bytes] = []
    for i in range(40):  # producer c, keys k0..k9 four times: only sequences 30..39 survive
        records.append((ident(b"c", str(i).encode()), T0 + i))
        keys.append(b"k%d" % (i % 10))
    # Kafka rolls a segment by record timestamps (segment.ms = 100): 0..42 stay within 100 ms
    # of each other, so they share one segment; the roll record, 10 s later, starts the next.
    records.append((ident(b"d", b"1"), T0 + 60))  # 40: survives (own key)
    keys.append(b"d1")
    records.append((ident(b"d", b"50"), T0 + 61))  # 41: overwritten by 42 below
    keys.append(b"shared")
    records.append((ident(b"c", b"100"), T0 + 62))  # 42
    keys.append(b"shared")
    produce(local_env.bootstrap, topic, records, keys=keys)
    produce(local_env.bootstrap, topic, [(ident(b"e", b"1"), T0 + 10_000)], key=b"roll")
    _low, high = high_watermark(local_env.bootstrap, topic)
    assert high == 44

    deadline = time.monotonic() + 90  # the log cleaner wakes every 15 s by default
    while True:
        present = offsets_present(local_env.bootstrap, topic, high)
        if len(present) == 10 + 2 + 1:
            break
        assert time.monotonic() < deadline, f"not compacted: {present}"
        time.sleep(1)
    assert present == [*range(30, 41), 42, 43]

    full = replay_partition(local_env.bootstrap, topic, 0, 0, high, timeout_s=20)
    assert full.highest == {"c": (100, T0 + 62), "d": (1, T0 + 60), "e": (1, T0 + 10_000)}
    assert (full.records, full.skipped, full.start, full.truncated_start) == (13, 0, 0, False)

    # end - 1 = 41 was compacted away: the replay stops at the record at 42 without it
    sub = replay_partition(local_env.bootstrap, topic, 0, 0, 42, timeout_s=20)
    assert sub.highest == {"c": (39, T0 + 39), "d": (1, T0 + 60)}
    assert sub.records == 11
    # a range that lies wholly in a gap reads nothing and still ends
    hole = replay_partition(local_env.bootstrap, topic, 0, 5, 20, timeout_s=20)
    assert (hole.records, hole.highest) == (0, {})


def test_start_below_the_log_start(local_env: EnvInfo, topic: str) -> None:
    produce(local_env.bootstrap, topic, [(ident(b"p", str(i).encode()), T0 + i) for i in range(10)])
    admin = AdminClient({"bootstrap.servers": local_env.bootstrap})
    for future in admin.delete_records([TopicPartition(topic, 0, 4)]).values():
        future.result(30)
    assert high_watermark(local_env.bootstrap, topic) == (4, 10)

    result = replay_partition(local_env.bootstrap, topic, 0, 0, 10)
    assert result.truncated_start
    assert (result.start, result.end, result.records) == (4, 10, 6)
    assert result.highest == {"p": (9, T0 + 9)}

    gone = replay_partition(local_env.bootstrap, topic, 0, 1, 3)  # wholly below the log start
    assert gone.truncated_start
    assert (gone.records, gone.highest) == (0, {})

    after = replay_partition(local_env.bootstrap, topic, 0, 6, 10)
    assert not after.truncated_start
    assert (after.start, after.records, after.highest) == (6, 4, {"p": (9, T0 + 9)})


def test_watermarks_the_caller_asked_are_used_and_a_stale_log_start_found_out(
    local_env: EnvInfo, topic: str
) -> None:
    """A recovery passes the log start and last stable offset it asked (`committed_watermarks`):
    the replay uses them, and reading finds out a log start that moved since."""
    produce(local_env.bootstrap, topic, [(ident(b"p", str(i).encode()), T0 + i) for i in range(10)])
    admin = AdminClient({"bootstrap.servers": local_env.bootstrap})
    for future in admin.delete_records([TopicPartition(topic, 0, 4)]).values():
        future.result(30)

    # Used, not asked again: Kafka's log start is 4, the one given 6.
    given = replay_partition(local_env.bootstrap, topic, 0, 0, 10, committed_watermarks=(6, 10))
    assert given.truncated_start
    assert (given.start, given.records, given.uncommitted_from) == (6, 4, None)
    # A last stable offset below the end: the rest is read uncommitted, from there.
    open_below = replay_partition(local_env.bootstrap, topic, 0, 4, 10, committed_watermarks=(4, 8))
    assert (open_below.records, open_below.uncommitted_from) == (6, 8)
    # Asked before the DeleteRecords: the read falls out of range and asks again.
    stale = replay_partition(local_env.bootstrap, topic, 0, 0, 10, committed_watermarks=(0, 10))
    assert stale.truncated_start
    assert (stale.start, stale.records, stale.highest) == (4, 6, {"p": (9, T0 + 9)})


# --------------------------------------------------------------------------- errors


def test_end_beyond_the_log_raises_after_the_timeout(local_env: EnvInfo, topic: str) -> None:
    produce(local_env.bootstrap, topic, [(ident(b"p", b"1"), T0)] * 3)
    began = time.monotonic()
    with pytest.raises(ReplayError, match=r"stalled at offset 3 .* before its end 10"):
        replay_partition(local_env.bootstrap, topic, 0, 0, 10, timeout_s=2)
    assert time.monotonic() - began < 15


def test_start_beyond_the_log_raises(local_env: EnvInfo, topic: str) -> None:
    produce(local_env.bootstrap, topic, [(ident(b"p", b"1"), T0)] * 3)
    with pytest.raises(ReplayError, match="out of range"):
        replay_partition(local_env.bootstrap, topic, 0, 50, 60, timeout_s=5)


def test_unknown_topic_raises(local_env: EnvInfo) -> None:
    with pytest.raises(ReplayError, match=r"t-missing-\w+/0"):
        replay_partition(
            local_env.bootstrap, f"t-missing-{uuid.uuid4().hex[:8]}", 0, 0, 5, timeout_s=3
        )
