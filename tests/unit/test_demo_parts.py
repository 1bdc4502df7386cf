"""The demo's pure parts: loader checkpoints and the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
    assert loaded["control"]["duplicates"] == 20
    assert exact.exact and not doubled.exact
    assert not PathReport(100, 100, 99, 99, 0, 1).exact


def test_chart_is_written(tmp_path: Path) -> None:
    report = DemoReport(PathReport(10, 12, 10, 10, 0, 0), PathReport(10, 12, 12, 12, 2, 0))
    report.write_chart(tmp_path / "demo.png")
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
