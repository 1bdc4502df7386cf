"""The main job (`dedup-proxy demo --small`), run as a user runs it, its report checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.local import EnvInfo

pytestmark = pytest.mark.integration


def test_demo_small_is_exact_through_the_proxy_and_not_in_the_control(
    local_env: EnvInfo, tmp_path: Path
) -> None:
    report_path, work = tmp_path / "report.json", tmp_path / "work"
    command = [sys.executable, "-m", "dedup", "demo", "--small", "--report", str(report_path)]
    result = subprocess.run(
        [*command, "--work-dir", str(work)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads(report_path.read_text())
    proxy, control = report["proxy"], report["control"]
    for side in (proxy, control):
        assert {"source_records", "topic_records", "spark_rows", "duplicates"} <= side.keys()
        # Loaders crashed and sent rows again on both paths.
        assert side["sent_records"] > side["source_records"]
        assert side["missing"] == 0
    assert proxy["duplicates"] == 0
    assert proxy["topic_records"] == proxy["spark_rows"] == proxy["source_records"]
    assert control["duplicates"] > 0
    assert control["topic_records"] == control["spark_rows"]
    assert control["spark_rows"] == control["source_records"] + control["duplicates"]
    # Each delivery report at its record, or at none: never at another record's offset.
    for side in (proxy, control):
        assert side["reports_wrong"] == 0, side
        assert side["reports_right"] + side["reports_unknown"] >= side["source_records"], side
    assert control["reports_unknown"] == 0, "straight to Kafka, every report has its offset"
    # Every fault happened.
    for fault in ("crashed; restarted from row", "proxy killed", "Spark job killed"):
        assert fault in result.stdout, result.stdout
    assert (work / "demo.png").stat().st_size > 10_000
