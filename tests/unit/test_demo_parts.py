"""The demo's pure parts: loader checkpoints and the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.chaos.reported_offsets import ReportedOffsets
from deploy.demo.delivery import ReportWriter, check_reports, read_reports
from deploy.demo.loader import Checkpoint
from deploy.demo.report import DemoReport, PathReport

pytestmark = pytest.mark.unit


def test_checkpoint_round_trip_and_a_fresh_loader_starts_at_row_zero(tmp_path: Path) -> None:
    path = tmp_path / "loader.checkpoint.json"
    assert Checkpoint.load(path) == Checkpoint(next_row=0, sent=0, runs=0)
    Checkpoint(next_row=4000, sent=4321, runs=2).save(path)
    assert Checkpoint.load(path) == Checkpoint(next_row=4000, sent=4321, runs=2)
    assert not path.with_suffix(".tmp").exists()


def test_report_json_has_the_documented_keys_and_exactness(tmp_path: Path) -> None:
    exact = PathReport(100, 120, 100, 100, 0, 0)
    doubled = PathReport(100, 120, 120, 120, 20, 0)
    report = DemoReport(proxy=exact, control=doubled)
    report.write_json(tmp_path / "r.json")
    loaded = json.loads((tmp_path / "r.json").read_text())
    assert set(loaded) == {"proxy", "control"}
    for side in loaded.values():
        assert {"source_records", "topic_records", "spark_rows", "duplicates"} <= set(side)
        assert {"reports_right", "reports_unknown", "reports_wrong"} <= set(side)
    assert loaded["control"]["duplicates"] == 20
    assert exact.exact and not doubled.exact
    assert not PathReport(100, 100, 99, 99, 0, 1).exact


def test_chart_is_written(tmp_path: Path) -> None:
    report = DemoReport(PathReport(10, 12, 10, 10, 0, 0), PathReport(10, 12, 12, 12, 2, 0))
    report.write_chart(tmp_path / "demo.png")
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _Message:
    """What a delivery callback is given: confluent-kafka's Message, its position only."""

    def __init__(self, partition: int, offset: int | None) -> None:
        self._partition, self._offset = partition, offset

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int | None:
        return self._offset


def test_reports_are_appended_across_runs_and_a_line_cut_short_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "loader.reports.csv"
    first = ReportWriter(path)
    first.callback(0)(None, _Message(1, 10))
    first.callback(1)("an error", _Message(1, 11))  # a failed delivery is not a report
    first.callback(2)(None, _Message(0, None))  # librdkafka's -1: no offset
    first.close()
    second = ReportWriter(path)  # the loader restarted
    second.callback(0)(None, _Message(1, 10))
    second.close()
    with path.open("a") as handle:
        handle.write("3,1,")  # a SIGKILL mid-line
    assert list(read_reports(path)) == [(0, 1, 10), (2, 0, -1), (0, 1, 10)]
    assert list(read_reports(tmp_path / "none.csv")) == []


def test_a_report_is_right_only_where_the_record_at_its_offset_is_its_row() -> None:
    log = {
        (0, 0): (b"loader-1", b"0"),
        (0, 1): (b"loader-1", b"1"),
        (1, 0): (b"loader-2", b"2"),
        (1, 2): (b"loader-1", b"2"),  # offset 1 of partition 1: a fence's marker
    }
    reports = [
        (0, 0, 0),  # right
        (1, 0, 1),  # right
        (2, 1, 2),  # right
        (2, 1, 0),  # another producer's record
        (1, 1, 0),  # the right offset of another partition
        (0, 1, 1),  # no record there
        (2, 0, -1),  # unknown
    ]
    counted = check_reports(iter(reports), "loader-1", log, keep=2)
    assert counted == ReportedOffsets(3, 1, 3, [(2, 0), (1, 0)])
    assert ReportedOffsets.total([counted, ReportedOffsets(1, 0, 1, [(9, 9)])]) == ReportedOffsets(
        4, 1, 4, [(2, 0), (1, 0), (9, 9)]
    )
