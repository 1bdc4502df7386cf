"""The chaos suite's consumer-side classification, checked against the seed's worked
example and against a plain set-based reference on random streams."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deploy.chaos.classify import (
    ACK_NEGATIVE,
    ACK_NONE,
    ACK_POSITIVE,
    COLUMNS,
    JumpEvent,
    JumpKind,
    classify_run,
    trace,
)

pytestmark = pytest.mark.unit

# The seed's example: "JF, JB, JB, DJB, DJB, JF", as printed by its consumer.
WORKED_EXAMPLE = [
    *range(1, 11),
    *range(30, 41),
    *range(15, 30),
    *range(11, 15),
    *range(5, 11),
    *range(2, 5),
    *range(41, 45),
]
WORKED_EXAMPLE_LISTING = """\
1
2
3
4
5
6
7
8
9
10
30 JUMP FORWARDS 20 (10 -> 30)
31
32
33
34
35
36
37
38
39
40
15 JUMP BACKWARDS 25 (40 -> 15)
16
17
18
19
20
21
22
23
24
25
26
27
28
29
11 JUMP BACKWARDS 18 (29 -> 11)
12
13
14
5 DUPLICATE JUMP BACKWARDS 9 (14 -> 5)
6
7
8
9
10
2 DUPLICATE JUMP BACKWARDS 8 (10 -> 2)
3
4
41 JUMP FORWARDS 37 (4 -> 41)
42
43
44"""


def all_acked(count: int) -> bytearray:
    return bytearray([ACK_POSITIVE]) * count


def test_the_seeds_worked_example_gives_its_six_events() -> None:
    result = classify_run(WORKED_EXAMPLE, all_acked(44), start=1, dedup_enabled=False, run=1)
    assert [(e.kind, e.last, e.value, e.distance) for e in result.jumps] == [
        (JumpKind.JF, 10, 30, 20),
        (JumpKind.JB, 40, 15, 25),
        (JumpKind.JB, 29, 11, 18),
        (JumpKind.DJB, 14, 5, 9),
        (JumpKind.DJB, 10, 2, 8),
        (JumpKind.JF, 4, 41, 37),
    ]
    assert result.row == {
        "DedupEnabled": "false",
        "TestRun": 1,
        "SendCount": 44,
        "AckCount": 44,
        "PosAckCount": 44,
        "NegAckCount": 0,
        "Received": 44 + 9,
        "NotReceived": 0,
        "ReceivedNoAck": 0,
        "MsgsWithDups": 9,  # 2..10 were read twice
        "DJF": 0,
        "DJB": 2,
        "JF": 2,
        "JB": 2,
    }
    assert list(result.row) == list(COLUMNS)
    assert not result.clean


def test_the_seeds_worked_example_prints_as_in_the_seed() -> None:
    assert "\n".join(trace(WORKED_EXAMPLE, start=1)) == WORKED_EXAMPLE_LISTING


def test_order_log_lines_use_the_seeds_order_file_wording() -> None:
    result = classify_run(WORKED_EXAMPLE, all_acked(44), start=1, dedup_enabled=False, run=7)
    assert [e.log_line(7) for e in result.jumps] == [
        "Test run: 7 JUMP FORWARDS 20 (10 -> 30)",
        "Test run: 7 JUMP BACKWARDS 25 (40 -> 15)",
        "Test run: 7 JUMP BACKWARDS 18 (29 -> 11)",
        "Test run: 7 DUPLICATE BLOCK - JUMP BACKWARDS 9 (14 -> 5)",
        "Test run: 7 DUPLICATE BLOCK - JUMP BACKWARDS 8 (10 -> 2)",
        "Test run: 7 JUMP FORWARDS 37 (4 -> 41)",
    ]
    djf = JumpEvent(JumpKind.DJF, 3, 9, 4)
    assert djf.inline() == "9 DUPLICATE JUMP FORWARDS 6 (3 -> 9)"
    assert djf.log_line(2) == "Test run: 2 DUPLICATE BLOCK - JUMP FORWARDS 6 (3 -> 9)"


def test_a_resent_block_is_one_duplicate_jump_back_as_in_the_seeds_pulsar_runs() -> None:
    # Seed, Pulsar kill-tcp run 1: "DUPLICATE BLOCK - JUMP BACKWARDS 8999 (228805 -> 219806)"
    # with MsgsWithDups 9000 and DJB 1: the re-sent block 219806..228805 read twice.
    values = [*range(0, 228806), *range(219806, 1_000_000)]
    result = classify_run(values, all_acked(1_000_000), dedup_enabled=False, run=1)
    assert [e.log_line(1) for e in result.jumps] == [
        "Test run: 1 DUPLICATE BLOCK - JUMP BACKWARDS 8999 (228805 -> 219806)"
    ]
    assert list(result.row.values()) == [
        "false", 1, 1000000, 1000000, 1000000, 0, 1009000, 0, 0, 9000, 0, 1, 0, 0,
    ]  # fmt: skip


def test_repeating_the_previous_value_is_a_duplicate_jump_back_of_zero() -> None:
    result = classify_run([0, 1, 1, 2], all_acked(3), dedup_enabled=True, run=1)
    assert [(e.kind, e.distance, e.inline()) for e in result.jumps] == [
        (JumpKind.DJB, 0, "1 DUPLICATE JUMP BACKWARDS 0 (1 -> 1)"),
    ], "then 2 follows 1: in order again"
    assert result.msgs_with_dups == 1


def test_a_clean_run_and_the_acknowledgement_counters() -> None:
    acks = bytearray([ACK_POSITIVE, ACK_POSITIVE, ACK_NEGATIVE, ACK_NONE, ACK_POSITIVE])
    result = classify_run([10, 11, 12, 13, 14], acks, start=10, dedup_enabled=True, run=3)
    assert result.clean
    assert (result.ack_count, result.pos_ack_count, result.neg_ack_count) == (4, 3, 1)
    assert result.received_no_ack == 2  # 12 (negative) and 13 (none) arrived anyway
    assert result.report_lines()[:3] == [
        "Final send count: 5",
        "Final ack count: 4",
        "Final positive ack count: 3",
    ]


def test_a_lost_acknowledged_message_is_not_received_and_a_jump_forward() -> None:
    result = classify_run([0, 1, 3], all_acked(4), dedup_enabled=True, run=1)
    assert result.not_received == 1
    assert [(e.kind, e.distance) for e in result.jumps] == [(JumpKind.JF, 2)]
    assert not result.clean


def test_values_outside_the_sent_range_are_received_without_ack() -> None:
    result = classify_run([-5, 0, 1, 99, 99, 2], all_acked(3), dedup_enabled=True, run=1)
    assert result.received == 6
    assert result.received_no_ack == 2  # -5 and 99, never sent
    assert result.msgs_with_dups == 1  # 99 twice
    assert result.not_received == 0
    assert [e.kind for e in result.jumps] == [
        JumpKind.JB,  # -1 -> -5
        JumpKind.JF,  # -5 -> 0
        JumpKind.JF,  # 1 -> 99
        JumpKind.DJB,  # 99 -> 99
        JumpKind.JB,  # 99 -> 2
    ]


def test_acks_with_unknown_states_are_refused() -> None:
    with pytest.raises(ValueError, match="ACK_NONE"):
        classify_run([0], bytes([3]), dedup_enabled=True, run=1)


def test_an_empty_run() -> None:
    result = classify_run([], b"", dedup_enabled=True, run=1)
    assert result.clean
    assert list(result.row.values())[2:] == [0] * 12
    assert list(trace([])) == []


@given(
    start=st.integers(min_value=-1000, max_value=1000),
    size=st.integers(min_value=0, max_value=300),
)
def test_an_in_order_stream_is_clean(start: int, size: int) -> None:
    result = classify_run(
        range(start, start + size), all_acked(size), start=start, dedup_enabled=True, run=1
    )
    assert result.clean
    assert (result.received, result.not_received, result.received_no_ack) == (size, 0, 0)
    assert list(trace(range(start, start + size), start=start)) == [
        str(v) for v in range(start, start + size)
    ]


def reference(values: list[int], acks: bytes, start: int) -> dict[str, int]:
    """The counters computed the obvious way: sets and a Counter."""
    sent = {start + i for i in range(len(acks))}
    positive = {start + i for i, a in enumerate(acks) if a == ACK_POSITIVE}
    reads = Counter(values)
    kinds: Counter[str] = Counter()
    last, seen = start - 1, set()
    for value in values:
        if value > last + 1:
            kinds["DJF" if value in seen else "JF"] += 1
        elif value <= last:
            kinds["DJB" if value in seen else "JB"] += 1
        seen.add(value)
        last = value
    return {
        "Received": len(values),
        "NotReceived": len(positive - set(reads)),
        "ReceivedNoAck": len(set(reads) - positive),
        "MsgsWithDups": sum(1 for n in reads.values() if n > 1),
        "SendCount": len(sent),
        **{kind: kinds[kind] for kind in ("DJF", "DJB", "JF", "JB")},
    }


streams = st.integers(min_value=-50, max_value=50).flatmap(
    lambda start: st.tuples(
        st.just(start),
        st.binary(max_size=60).map(lambda raw: bytes(b % 3 for b in raw)),
        st.lists(st.integers(min_value=start - 5, max_value=start + 70), max_size=200),
    )
)


@given(streams)
def test_counters_match_a_set_based_reference(case: tuple[int, bytes, list[int]]) -> None:
    start, acks, values = case
    result = classify_run(values, acks, start=start, dedup_enabled=False, run=1)
    expected = reference(values, acks, start)
    assert {k: result.row[k] for k in expected} == expected


@given(
    st.lists(st.integers(min_value=0, max_value=40), max_size=120).flatmap(
        lambda picks: st.permutations([*range(41), *picks])  # all at least once, some again
    )
)
def test_any_permutation_or_duplication_keeps_the_counters_consistent(values: list[int]) -> None:
    result = classify_run(values, all_acked(41), dedup_enabled=False, run=1)
    reads = Counter(values)
    assert result.received == len(values)
    assert result.msgs_with_dups == sum(1 for n in reads.values() if n > 1)
    assert result.not_received == 0 and result.received_no_ack == 0
    breaks = [i for i, v in enumerate(values) if v != (values[i - 1] if i else -1) + 1]
    assert [e.position for e in result.jumps] == breaks
    for event in result.jumps:
        assert event.value == values[event.position]
        assert event.last == (values[event.position - 1] if event.position else -1)
        duplicate = event.value in values[: event.position]
        forwards = event.value > event.last + 1
        assert (
            event.kind
            is {
                (False, True): JumpKind.JF,
                (False, False): JumpKind.JB,
                (True, True): JumpKind.DJF,
                (True, False): JumpKind.DJB,
            }[(duplicate, forwards)]
        )
    assert result.clean == (values == list(range(41)))
