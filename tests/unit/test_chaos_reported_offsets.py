"""The chaos suite's check of delivery reports against the log: right, unknown, wrong."""

from __future__ import annotations

from array import array
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deploy.chaos.classify import ACK_NEGATIVE, ACK_NONE, ACK_POSITIVE, RunResult, classify_run
from deploy.chaos.producers import ProducerRun
from deploy.chaos.report import ResultsWriter, any_wrong_report, describe_reports
from deploy.chaos.reported_offsets import NOT_IN_LOG, ReportedOffsets, check_reported_offsets

pytestmark = pytest.mark.unit


def offsets(*values: int) -> array[int]:
    return array("q", values)


def test_each_kind_of_report_is_counted() -> None:
    # The log: 0, 1, 1 (a duplicate), 2, and no record at offset 4 (4 is past its end).
    log = offsets(0, 1, 1, 2)
    acks = bytes([ACK_POSITIVE] * 4 + [ACK_NEGATIVE, ACK_NONE])
    # 0 right; 1 right at its second copy; 2 wrong (offset 2 holds 1); 3 unknown (-1);
    # 4 and 5 not positive: not counted, whatever their entries say.
    reported = offsets(0, 2, 2, -1, 7, 9)
    assert check_reported_offsets(reported, acks, log) == ReportedOffsets(2, 1, 1, [(2, 2)])


def test_an_offset_past_the_log_or_where_nothing_was_read_is_wrong() -> None:
    log = offsets(0, NOT_IN_LOG)
    acks = bytes([ACK_POSITIVE] * 2)
    found = check_reported_offsets(offsets(5, 1), acks, log)
    assert (found.right, found.unknown, found.wrong) == (0, 0, 2)
    assert found.examples == [(0, 5), (1, 1)]


def test_any_negative_offset_is_unknown_however_far_below_the_log() -> None:
    # librdkafka's -1001, and a batch of 40 answered at -40 (as the proxy answers its
    # clients a batch without an offset): below zero, never read as an index from the end.
    acks = bytes([ACK_POSITIVE] * 3)
    found = check_reported_offsets(offsets(-1001, -40, -2), acks, offsets(2, 1, 0))
    assert found == ReportedOffsets(0, 3, 0, [])


def test_examples_are_bounded() -> None:
    acks = bytes([ACK_POSITIVE] * 10)
    found = check_reported_offsets(offsets(*[100] * 10), acks, offsets(), keep=3)
    assert found.wrong == 10 and len(found.examples) == 3
    assert found.describe() == "offsets right=0 unknown=0 wrong=10 [(0, 100), (1, 100), (2, 100)]"


@given(st.permutations(list(range(30))), st.data())
def test_reports_taken_from_the_log_are_all_right(order: list[int], data: st.DataObject) -> None:
    """Whatever the order the values landed in, a report that names where each is, or
    nothing, is never counted wrong; moving one report to another record's offset is."""
    where = {value: offset for offset, value in enumerate(order)}
    unknown = data.draw(st.sets(st.sampled_from(order), max_size=29))  # one report to move
    reported = offsets(*(-1 if v in unknown else where[v] for v in range(30)))
    acks = bytes([ACK_POSITIVE] * 30)
    assert check_reported_offsets(reported, acks, offsets(*order)) == ReportedOffsets(
        30 - len(unknown), len(unknown), 0
    )
    moved = data.draw(st.sampled_from([v for v in range(30) if v not in unknown]))
    reported[moved] = (where[moved] + 1) % 30
    assert check_reported_offsets(reported, acks, offsets(*order)).wrong == 1


def test_the_first_acknowledgement_of_a_value_keeps_its_offset() -> None:
    run = ProducerRun(3)
    run.record(0, True, 10)
    run.record(0, True, 11)  # a later report of the same value changes nothing
    run.record(1, False, 12)  # a negative one names no offset
    run.record(2, True)
    assert (list(run.offsets), list(run.acks)) == ([10, -1, -1], [1, 2, 1])


def test_the_writer_adds_a_row_per_run_to_the_offsets_file(tmp_path: Path) -> None:
    writer = ResultsWriter(tmp_path, "test-kill-tcp")
    for number, reported in ((1, ReportedOffsets(3, 1, 0)), (2, ReportedOffsets(4, 0, 0))):
        acks = bytes([ACK_POSITIVE] * 4)
        result = classify_run([0, 1, 2, 3], acks, dedup_enabled=True, run=number)
        writer.append(replace(result, reported_offsets=reported))
    assert writer.offsets_path.read_text().splitlines() == [
        "DedupEnabled,TestRun,PosAckCount,OffsetRight,OffsetUnknown,OffsetWrong",
        "true,1,4,3,1,0",
        "true,2,4,4,0,0",
    ]


def test_the_command_line_sums_each_settings_reports_and_flags_a_wrong_one() -> None:
    def outcome(dedup: bool, number: int, reported: ReportedOffsets) -> RunResult:
        result = classify_run([0], bytes([ACK_POSITIVE]), dedup_enabled=dedup, run=number)
        return replace(result, reported_offsets=reported)

    outcomes = [
        outcome(False, 1, ReportedOffsets(5, 0, 1)),
        outcome(True, 1, ReportedOffsets(3, 2, 0)),
        outcome(True, 2, ReportedOffsets(4, 1, 0)),
    ]
    assert describe_reports(outcomes) == [
        "delivery reports, dedup off: 5 at their record, 0 with no offset, "
        "1 naming another record's offset",
        "delivery reports, dedup on: 7 at their record, 3 with no offset, "
        "0 naming another record's offset",
    ]
    assert any_wrong_report(outcomes, dedup_enabled=False)
    assert not any_wrong_report(outcomes, dedup_enabled=True)


@given(
    st.lists(
        st.tuples(
            st.integers(0, 50),
            st.integers(0, 50),
            st.integers(0, 50),
            st.lists(st.tuples(st.integers(), st.integers()), max_size=6),
        ),
        max_size=8,
    ),
    st.integers(0, 10),
)
def test_a_total_sums_each_kind_and_keeps_the_first_examples(
    parts: list[tuple[int, int, int, list[tuple[int, int]]]], keep: int
) -> None:
    counts = [ReportedOffsets(r, u, w, examples) for r, u, w, examples in parts]
    total = ReportedOffsets.total(iter(counts), keep=keep)
    assert (total.right, total.unknown, total.wrong) == (
        sum(p[0] for p in parts),
        sum(p[1] for p in parts),
        sum(p[2] for p in parts),
    )
    assert total.examples == [example for p in parts for example in p[3]][:keep]
