"""``dedup-proxy demo``: the command, plugged into the product's CLI through the
``kafka_dedup_proxy.commands`` entry point group (deploy/pyproject.toml)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def demo(
    small: Annotated[bool, typer.Option(help="a reduced size (about a minute of load)")] = False,
    report: Annotated[
        Path | None, typer.Option(help="also write the report as JSON to this file")
    ] = None,
    work_dir: Annotated[
        Path | None, typer.Option(help="where sources, Spark's sink, chart and logs go")
    ] = None,
) -> None:
    """The main job: local Kafka + Redis + the proxy, loaders replaying files through the
    proxy and straight into Kafka while loaders, the proxy and the Spark job are killed,
    Spark reading both topics; a report, a chart and, with --report, JSON."""
    from deploy.demo.scenario import FULL, SMALL, run_demo

    raise typer.Exit(run_demo(SMALL if small else FULL, report_path=report, work_dir=work_dir))
