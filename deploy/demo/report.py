"""The demo's result: one row of counts per path (through the proxy, and the control
written straight to Kafka), shown as a table, a chart and JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.table import Table


@dataclass(frozen=True)
class PathReport:
    source_records: int  # rows in the source files
    sent_records: int  # rows handed to producers, re-sends after crashes included
    topic_records: int  # data records in the topic (fence markers are not records)
    spark_rows: int  # rows in Spark's sink
    duplicates: int  # Spark rows whose (producer, sequence) an earlier row already had
    missing: int  # source rows absent from Spark's sink
    # The loaders' positive delivery reports checked against the topic (`deploy.demo.delivery`)
    reports_right: int = 0  # at the offset of the row's record
    reports_unknown: int = 0  # no offset (-1)
    reports_wrong: int = 0  # at another record's offset, or none's

    @property
    def exact(self) -> bool:
        return self.duplicates == 0 and self.missing == 0 and self.spark_rows == self.source_records


@dataclass(frozen=True)
class DemoReport:
    proxy: PathReport
    control: PathReport

    def to_json(self) -> dict[str, Any]:
        return {"proxy": asdict(self.proxy), "control": asdict(self.control)}

    def write_json(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")

    def table(self) -> Table:
        table = Table(title="One source, two paths, the same faults")
        table.add_column("")
        table.add_column("through the proxy", justify="right")
        table.add_column("control (straight to Kafka)", justify="right")
        for label, field in (*_ROWS, *_REPORT_ROWS):
            proxy, control = getattr(self.proxy, field), getattr(self.control, field)
            table.add_row(label, _cell(field, proxy), _cell(field, control))
        return table

    def write_chart(self, path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        labels = [label for label, _ in _ROWS]
        fields = [field for _, field in _ROWS]
        positions = range(len(labels))
        width = 0.38
        figure, axes = plt.subplots(figsize=(10, 5))
        for offset, (name, path_report, color) in enumerate(
            (("through the proxy", self.proxy, "#2b8a3e"), ("control", self.control, "#c92a2a"))
        ):
            values = [getattr(path_report, field) for field in fields]
            bars = axes.bar(
                [p + (offset - 0.5) * width for p in positions],
                values,
                width,
                label=name,
                color=color,
            )
            axes.bar_label(bars, labels=[f"{v:,}" for v in values], fontsize=8, padding=2)
        axes.set_xticks(list(positions), labels, rotation=15)
        axes.set_ylabel("records")
        axes.set_title("kafka-dedup-proxy demo: each record exactly once through the proxy")
        axes.legend()
        figure.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=110)
        plt.close(figure)


_ROWS = (
    ("records in the source", "source_records"),
    ("records sent (incl. re-sends)", "sent_records"),
    ("records in the topic", "topic_records"),
    ("rows in Spark's output", "spark_rows"),
    ("duplicates in Spark's output", "duplicates"),
    ("missing from Spark's output", "missing"),
)
# In the table, not the chart (the chart counts records)
_REPORT_ROWS = (
    ("delivery reports at their record", "reports_right"),
    ("delivery reports without an offset", "reports_unknown"),
    ("delivery reports at another record", "reports_wrong"),
)


def _cell(field: str, value: int) -> str:
    if field in ("duplicates", "missing", "reports_wrong"):
        return f"[green]{value:,}[/]" if value == 0 else f"[bold red]{value:,}[/]"
    return f"{value:,}"
