"""The chaos suite's results files, summary, table and plot."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from deploy.chaos.classify import ACK_POSITIVE, COLUMNS, RunResult, classify_run
from deploy.chaos.report import ResultsWriter, plot_summary, read_rows, render_table, summarize

pytestmark = pytest.mark.unit

SEED_HEADER = ",".join(COLUMNS)
# Rows from the seed's Kafka kill-tcp listing (control) and its dedup-on runs.
SEED_CSV = f"""{SEED_HEADER}
false,1,1000000,1000000,1000000,0,1013263,0,0,13263,0,10,9,10
false,2,1000000,1000000,1000000,0,1014168,0,0,14168,0,21,26,25
false,26,1000000,1000000,1000000,0,1000000,0,0,0,0,0,0,0
true,1,1000000,1000000,1000000,0,1000000,0,0,0,0,0,0,0
true,2,1000000,1000000,1000000,0,1000000,0,0,0,0,0,0,0
"""


def run(values: list[int], sent: int, *, dedup: bool, number: int) -> RunResult:
    acks = bytearray([ACK_POSITIVE]) * sent
    return classify_run(values, acks, dedup_enabled=dedup, run=number)


def test_two_runs_read_back_as_written(tmp_path: Path) -> None:
    control = run([0, 1, 2, 3, 1, 2, 3, 4], 5, dedup=False, number=1)
    dedup = run([0, 1, 2, 3, 4], 5, dedup=True, number=1)
    writer = ResultsWriter(tmp_path / "results", "test-kill-tcp")
    writer.append(control)
    writer.append(dedup)

    assert writer.csv_path == tmp_path / "results" / "test-kill-tcp_dedup_output.csv"
    lines = writer.csv_path.read_text().splitlines()
    assert lines[0] == SEED_HEADER
    assert lines[1:] == ["false,1,5,5,5,0,8,0,0,3,0,1,0,0", "true,1,5,5,5,0,5,0,0,0,0,0,0,0"]
    assert read_rows(writer.csv_path) == [control.row, dedup.row]
    assert writer.order_path.read_text() == (
        "DedupEnabled: false\nTest run: 1 DUPLICATE BLOCK - JUMP BACKWARDS 2 (3 -> 1)\n"
    )


def test_a_second_writer_appends_without_a_second_header(tmp_path: Path) -> None:
    ResultsWriter(tmp_path, "s").append(run([0, 2], 3, dedup=False, number=1))
    writer = ResultsWriter(tmp_path, "s")
    writer.append(run([0, 2], 3, dedup=False, number=2))
    writer.append(run([1, 0], 3, dedup=True, number=1))
    assert [r["TestRun"] for r in read_rows(writer.csv_path)] == [1, 2, 1]
    assert writer.order_path.read_text().splitlines() == [
        "DedupEnabled: false",
        "Test run: 1 JUMP FORWARDS 2 (0 -> 2)",
        "DedupEnabled: false",  # a new writer opens a new stretch
        "Test run: 2 JUMP FORWARDS 2 (0 -> 2)",
        "DedupEnabled: true",
        "Test run: 1 JUMP FORWARDS 2 (-1 -> 1)",
        "Test run: 1 JUMP BACKWARDS 1 (1 -> 0)",
    ]


def test_a_csv_with_other_columns_is_not_appended_to(tmp_path: Path) -> None:
    (tmp_path / "s_dedup_output.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="other columns"):
        ResultsWriter(tmp_path, "s")


def test_summarize_the_seeds_rows(tmp_path: Path) -> None:
    path = tmp_path / "test-kill-tcp_dedup_output.txt"
    path.write_text(SEED_CSV)
    summary = summarize(path)
    off, on = summary.settings[False], summary.settings[True]
    assert (off.runs, off.clean_runs, off.runs_with_duplicates) == (3, 1, 2)
    assert (off.duplicates, off.max_duplicates) == (13263 + 14168, 14168)
    assert (off.jumps, off.max_jumps, off.runs_with_jumps) == (29 + 72, 72, 2)
    assert (off.lost, off.received_no_ack, off.sent) == (0, 0, 3_000_000)
    assert not off.all_clean
    assert (on.runs, on.clean_runs, on.duplicates, on.jumps, on.lost) == (2, 2, 0, 0, 0)
    assert on.all_clean and summary.dedup_on_clean


def test_one_unclean_dedup_run_fails_the_verdict(tmp_path: Path) -> None:
    path = tmp_path / "s.csv"
    path.write_text(
        SEED_CSV + "true,3,1000000,1000000,1000000,0,999999,1,0,0,0,0,1,0\n"
    )  # one acknowledged message lost, the consumer jumped over it
    on = summarize(path).settings[True]
    assert (on.runs, on.clean_runs, on.lost, on.jumps) == (3, 2, 1, 1)
    assert not summarize(path).dedup_on_clean


def test_no_dedup_runs_is_not_a_clean_verdict(tmp_path: Path) -> None:
    path = tmp_path / "s.csv"
    path.write_text(SEED_CSV.replace("true,", "false,"))
    assert not summarize(path).dedup_on_clean


def test_the_seeds_dedup_header_is_read(tmp_path: Path) -> None:
    path = tmp_path / "s.txt"
    path.write_text(SEED_CSV.replace("DedupEnabled,", "Dedup,", 1))
    assert [r["DedupEnabled"] for r in read_rows(path)] == ["false"] * 3 + ["true"] * 2


def test_the_table_names_both_settings(tmp_path: Path) -> None:
    path = tmp_path / "s.csv"
    path.write_text(SEED_CSV)
    console = Console(width=250, file=io.StringIO(), record=True)
    console.print(render_table(summarize(path)))
    text = console.export_text()
    cells = {
        line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
        for line in text.splitlines()
        if line.startswith("│")
    }
    assert cells == {
        "off": ["3", "1", "27,431", "14,168", "101", "72", "0", "0"],
        "on": ["2", "2", "0", "0", "0", "0", "0", "0"],
    }
    assert "dedup on: 0 duplicates, 0 jumps, 0 lost in 2 runs" in text


def test_the_plot_is_a_png(tmp_path: Path) -> None:
    path = tmp_path / "s.csv"
    path.write_text(SEED_CSV)
    png = tmp_path / "out" / "s.png"
    plot_summary(path, png, "kill-tcp (seed rows)")
    data = png.read_bytes()
    assert len(data) > 0 and data.startswith(b"\x89PNG\r\n\x1a\n")


def test_the_plot_copes_with_one_setting_only(tmp_path: Path) -> None:
    writer = ResultsWriter(tmp_path, "s")
    writer.append(run([0, 1, 2], 3, dedup=True, number=1))
    png = tmp_path / "s.png"
    plot_summary(writer.csv_path, png, "dedup on only")
    assert png.read_bytes().startswith(b"\x89PNG")
