"""A scenario's results on disk, summarised, plotted and tabled.

Two files per scenario in the results directory, named as the seed's (with `.csv` for the
CSV, which the seed wrote as `<scenario>_dedup_output.txt`; the content is the same):

- ``<scenario>_dedup_output.csv``: one row per run, the seed's columns (`COLUMNS`).
- ``<scenario>_order_output.txt``: one line per jump event, the seed's wording
  (``Test run: 1 DUPLICATE BLOCK - JUMP BACKWARDS 8999 (228805 -> 219806)``). The seed's
  lines do not say which dedup setting a run had, so a ``DedupEnabled: true|false`` line
  opens each stretch of events from one setting; a run without events writes nothing.

And one of this project's own: ``<scenario>_reported_offsets.csv``, one row per run, how many
positive delivery reports named their record's offset, none, or a wrong one
(`deploy.chaos.reported_offsets`).

All are appended to and closed after every run, so a long campaign can be followed with
``tail -f`` and survives an interrupted run.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from deploy.chaos.classify import COLUMNS, RunResult
from deploy.chaos.reported_offsets import ReportedOffsets

if TYPE_CHECKING:
    from rich.table import Table

JUMP_COLUMNS: Final = ("DJF", "DJB", "JF", "JB")
OFFSET_COLUMNS: Final = (
    "DedupEnabled",
    "TestRun",
    "PosAckCount",
    "OffsetRight",
    "OffsetUnknown",
    "OffsetWrong",
)
Row = dict[str, str | int]  # as RunResult.row: DedupEnabled "true"/"false", the rest ints


def _flag(value: bool) -> str:
    return "true" if value else "false"


class ResultsWriter:
    """Appends each run of one scenario to its CSV and order log."""

    def __init__(self, results_dir: Path, scenario: str) -> None:
        self.csv_path = results_dir / f"{scenario}_dedup_output.csv"
        self.order_path = results_dir / f"{scenario}_order_output.txt"
        self.offsets_path = results_dir / f"{scenario}_reported_offsets.csv"
        self._section: bool | None = None  # the setting the order log's last events had
        results_dir.mkdir(parents=True, exist_ok=True)
        if self.csv_path.exists() and self.csv_path.stat().st_size > 0:
            with self.csv_path.open(newline="") as handle:
                header = next(csv.reader(handle), [])
            if tuple(header) != COLUMNS:
                raise ValueError(f"{self.csv_path} has other columns: {header}")
        else:
            with self.csv_path.open("w", newline="") as handle:
                csv.writer(handle).writerow(COLUMNS)

    def append(self, result: RunResult) -> None:
        """Write one run's rows and events (closing the files, so they are on disk)."""
        with self.csv_path.open("a", newline="") as handle:
            csv.writer(handle).writerow(result.row.values())
        if (reported := result.reported_offsets) is not None:
            new = not self.offsets_path.exists()
            with self.offsets_path.open("a", newline="") as handle:
                writer = csv.writer(handle)
                if new:
                    writer.writerow(OFFSET_COLUMNS)
                row = (_flag(result.dedup_enabled), result.run, result.pos_ack_count)
                writer.writerow((*row, reported.right, reported.unknown, reported.wrong))
        if not result.jumps:
            return
        with self.order_path.open("a") as handle:
            if self._section is not result.dedup_enabled:
                handle.write(f"DedupEnabled: {_flag(result.dedup_enabled)}\n")
                self._section = result.dedup_enabled
            handle.writelines(event.log_line(result.run) + "\n" for event in result.jumps)


def describe_runs(outcomes: list[RunResult]) -> str:
    """One line per run, for a failed check: dedup, duplicates, lost, jumps, counts."""
    return "; ".join(
        f"dedup={o.dedup_enabled} dups={o.msgs_with_dups} lost={o.not_received} "
        f"jumps={len(o.jumps)} sent={o.send_count} received={o.received}"
        + ("" if o.reported_offsets is None else f" {o.reported_offsets.describe()}")
        for o in outcomes
    )


def describe_reports(outcomes: list[RunResult]) -> list[str]:
    """Per dedup setting, the positive delivery reports of its runs by kind."""
    lines = []
    for dedup in (False, True):
        found = [o.reported_offsets for o in outcomes if o.dedup_enabled is dedup]
        reports = [r for r in found if r is not None]
        if reports:
            total = ReportedOffsets.total(reports)
            lines.append(
                f"delivery reports, dedup {'on' if dedup else 'off'}: "
                f"{total.right} at their record, {total.unknown} with no offset, "
                f"{total.wrong} naming another record's offset"
            )
    return lines


def any_wrong_report(outcomes: list[RunResult], *, dedup_enabled: bool) -> bool:
    """Whether a run of that setting had a delivery report naming another record's offset."""
    return any(
        o.reported_offsets is not None and o.reported_offsets.wrong > 0
        for o in outcomes
        if o.dedup_enabled is dedup_enabled
    )


def read_rows(csv_path: Path) -> list[Row]:
    """The rows of a results CSV, each equal to the `RunResult.row` it was written from.
    Also reads the seed's own files (one of its listings names the first column
    ``Dedup``)."""
    rows: list[Row] = []
    with csv_path.open(newline="") as handle:
        for raw in csv.DictReader(handle):
            if "DedupEnabled" not in raw and "Dedup" in raw:
                raw["DedupEnabled"] = raw.pop("Dedup")
            flag = raw["DedupEnabled"].strip().lower()
            if flag not in ("true", "false"):
                raise ValueError(f"{csv_path}: DedupEnabled is {raw['DedupEnabled']!r}")
            rows.append({c: flag if c == "DedupEnabled" else int(raw[c]) for c in COLUMNS})
    return rows


def _int(row: Row, column: str) -> int:
    value = row[column]
    assert isinstance(value, int)
    return value


def jump_count(row: Row) -> int:
    """All four kinds of ordering event in a row."""
    return sum(_int(row, c) for c in JUMP_COLUMNS)


def is_clean(row: Row) -> bool:
    """`RunResult.clean` for a row read back."""
    return _int(row, "NotReceived") == 0 and _int(row, "MsgsWithDups") == 0 and jump_count(row) == 0


@dataclass(frozen=True)
class SettingSummary:
    """All runs with one dedup setting."""

    dedup_enabled: bool
    runs: int
    clean_runs: int
    sent: int
    received: int
    duplicates: int  # MsgsWithDups summed over the runs
    max_duplicates: int  # the worst run
    runs_with_duplicates: int
    jumps: int  # DJF + DJB + JF + JB summed over the runs
    max_jumps: int
    runs_with_jumps: int
    lost: int  # NotReceived summed: acknowledged, never read
    received_no_ack: int

    @property
    def all_clean(self) -> bool:
        return self.runs > 0 and self.clean_runs == self.runs

    @classmethod
    def of(cls, dedup_enabled: bool, rows: list[Row]) -> SettingSummary:
        dups = [_int(r, "MsgsWithDups") for r in rows]
        events = [jump_count(r) for r in rows]
        return cls(
            dedup_enabled=dedup_enabled,
            runs=len(rows),
            clean_runs=sum(1 for r in rows if is_clean(r)),
            sent=sum(_int(r, "SendCount") for r in rows),
            received=sum(_int(r, "Received") for r in rows),
            duplicates=sum(dups),
            max_duplicates=max(dups, default=0),
            runs_with_duplicates=sum(1 for d in dups if d),
            jumps=sum(events),
            max_jumps=max(events, default=0),
            runs_with_jumps=sum(1 for e in events if e),
            lost=sum(_int(r, "NotReceived") for r in rows),
            received_no_ack=sum(_int(r, "ReceivedNoAck") for r in rows),
        )


@dataclass(frozen=True)
class Summary:
    """Per dedup setting present in the file (False: the control, True: dedup on)."""

    settings: dict[bool, SettingSummary]

    @property
    def dedup_on_clean(self) -> bool:
        """The experiment's verdict: there were dedup-on runs and every one was clean."""
        on = self.settings.get(True)
        return on is not None and on.all_clean


def summarize(csv_path: Path) -> Summary:
    rows = read_rows(csv_path)
    by_setting: dict[bool, list[Row]] = {}
    for row in rows:
        by_setting.setdefault(row["DedupEnabled"] == "true", []).append(row)
    return Summary({flag: SettingSummary.of(flag, by_setting[flag]) for flag in sorted(by_setting)})


def _verdict(s: SettingSummary) -> str:
    if s.all_clean:
        return f"0 duplicates, 0 jumps, 0 lost in {s.runs} runs"
    return (
        f"{s.duplicates:,} duplicates ({s.runs_with_duplicates} runs), {s.jumps:,} jumps "
        f"({s.runs_with_jumps} runs), {s.lost:,} lost in {s.runs} runs"
    )


def render_table(summary: Summary) -> Table:
    """The summary for the terminal: one line per dedup setting, the verdict as caption."""
    from rich.table import Table

    on = summary.settings.get(True)
    caption = (
        "no dedup-on runs"
        if on is None
        else f"[{'green' if on.all_clean else 'red'}]dedup on: {_verdict(on)}[/]"
    )
    table = Table(title="Producer dedup: control (off) vs on", caption=caption)
    for column in ("dedup", "runs", "clean", "dups", "max dups", "jumps", "max jumps", "lost"):
        table.add_column(column, justify="left" if column == "dedup" else "right")
    table.add_column("unacked read", justify="right")
    for flag, s in summary.settings.items():
        style = "green" if s.all_clean else ("red" if flag else "yellow")
        table.add_row(
            "on" if flag else "off",
            f"{s.runs}",
            f"[{style}]{s.clean_runs}[/]",
            f"{s.duplicates:,}",
            f"{s.max_duplicates:,}",
            f"{s.jumps:,}",
            f"{s.max_jumps:,}",
            f"{s.lost:,}",
            f"{s.received_no_ack:,}",
        )
    return table


def plot_summary(csv_path: Path, png_path: Path, title: str) -> None:
    """Per run: messages with duplicates, jump events and acknowledged-but-lost messages,
    the control (dedup off) and dedup on in side-by-side panels on one symlog y axis, so
    10,000 duplicates and 0 share a scale and a zero is a bar of no height. Each panel
    states its totals; an all-clean panel says "0 duplicates, 0 jumps, 0 lost in N runs"."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_rows(csv_path)
    summary = summarize(csv_path)
    series = (
        ("MsgsWithDups", "messages with duplicates", "tab:red"),
        ("jumps", "jumps (JF+JB+DJF+DJB)", "tab:orange"),
        ("NotReceived", "acked, not received", "tab:purple"),
    )
    width = 0.8 / len(series)
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5), sharey=True)
    top = 1
    for ax, flag in zip(axes, (False, True), strict=True):
        runs = [r for r in rows if (r["DedupEnabled"] == "true") is flag]
        numbers = [_int(r, "TestRun") for r in runs]
        for k, (column, label, color) in enumerate(series):
            heights = [jump_count(r) if column == "jumps" else _int(r, column) for r in runs]
            top = max([top, *heights])
            offsets = [n + (k - (len(series) - 1) / 2) * width for n in numbers]
            ax.bar(offsets, heights, width=width, color=color, label=label)
            # A zero has no bar: a dot on the zero line says it was measured.
            zeros = [x for x, h in zip(offsets, heights, strict=True) if h == 0]
            ax.plot(zeros, [0] * len(zeros), "o", markersize=2.5, color=color, zorder=3)
        ax.axhline(0, color="grey", linewidth=0.8)
        ax.set_title("dedup on" if flag else "dedup off (control)", fontsize=10)
        ax.set_xlabel("test run")
        ax.grid(alpha=0.3, axis="y", which="both")
        if numbers:
            ax.set_xlim(min(numbers) - 1, max(numbers) + 1)
        setting = summary.settings.get(flag)
        text = "no runs" if setting is None else _verdict(setting)
        clean = setting is not None and setting.all_clean
        ax.text(
            0.5,
            0.95,
            text,
            transform=ax.transAxes,
            ha="center",
            va="top",
            fontsize=11 if clean else 9,
            color="darkgreen" if clean else "black",
            bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.9},
        )
    left = axes[0]
    left.set_yscale("symlog", linthresh=1)
    left.set_ylim(-0.5, top * 30)  # room below zero for its dots, above for the text
    left.set_ylabel("count per run (symlog; dots: measured zero)")
    handles, labels = left.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(series), fontsize=9)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 0.95))
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
