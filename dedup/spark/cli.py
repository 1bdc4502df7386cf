"""``dedup-proxy spark run|verify``: the Spark job and its verifier from a shell."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Annotated

import structlog
import typer
from rich.console import Console
from rich.table import Table

from dedup.spark.chunks import DEFAULT_EXPIRE_AFTER_S
from dedup.spark.job import JobConfig, SecondLine, Trigger
from dedup.spark.runtime import MissingRuntimeError, SparkResources
from dedup.spark.verify import Scope, SinkReport
from proxy.runtime.logs import configure_logging
from proxy.runtime.settings import DEFAULT_UPSTREAM

spark_app = typer.Typer(
    help="Read a deduplicated topic with Spark's Kafka source into an exactly-once sink.",
    no_args_is_help=True,
)
console = Console()
log = structlog.get_logger("dedup.spark")

Master = Annotated[str, typer.Option(help="Spark master; e.g. spark://host:7077 on a cluster")]
DriverMemory = Annotated[str, typer.Option(help="spark.driver.memory")]
ExecutorMemory = Annotated[
    str | None, typer.Option(help="spark.executor.memory (at most a worker's memory)")
]
ExecutorCores = Annotated[int | None, typer.Option(help="spark.executor.cores", min=1)]
SparkConf = Annotated[
    list[str] | None,
    typer.Option(help="any other Spark setting NAME=VALUE (repeatable), e.g. spark.cores.max=4"),
]


@spark_app.command("run")
def run(
    topic: Annotated[str, typer.Option(help="topic to read (or a comma-separated list)")],
    output: Annotated[Path, typer.Option(help="directory of the Parquet sink")],
    checkpoint: Annotated[
        Path | None, typer.Option(help="checkpoint directory (default: OUTPUT-checkpoint)")
    ] = None,
    bootstrap: Annotated[
        str, typer.Option(envvar="DEDUP_SPARK_BOOTSTRAP", help="Kafka bootstrap servers")
    ] = DEFAULT_UPSTREAM,
    trigger: Annotated[
        Trigger, typer.Option(help="available-now: what is there, then stop")
    ] = Trigger.AVAILABLE_NOW,
    interval_s: Annotated[float, typer.Option(help="micro-batch interval (continuous)")] = 2.0,
    max_offsets_per_trigger: Annotated[
        int | None, typer.Option(help="cap on records per micro-batch")
    ] = None,
    drop_duplicates_within: Annotated[
        str | None,
        typer.Option(help="second line of dedup: drop repeats of a key within this watermark"),
    ] = None,
    dedup_key_header: Annotated[
        str | None,
        typer.Option(help="header holding that key (default: producer and sequence)"),
    ] = None,
    summary: Annotated[
        Path | None,
        typer.Option(help="per-producer summary JSON written at the end (default: OUTPUT.json)"),
    ] = None,
    reassemble: Annotated[
        bool, typer.Option(help="join chunked messages into one row each")
    ] = True,
    chunk_expire_s: Annotated[
        float, typer.Option(help="an incomplete chunked message ends after this long")
    ] = DEFAULT_EXPIRE_AFTER_S,
    ready_file: Annotated[
        Path | None,
        typer.Option(help="created once the query runs (for supervisors and scripts)"),
    ] = None,
    kafka_option: Annotated[
        list[str] | None,
        typer.Option(help="extra Kafka source option NAME=VALUE (repeatable)"),
    ] = None,
    master: Master = "local[2]",
    driver_memory: DriverMemory = "1g",
    executor_memory: ExecutorMemory = None,
    executor_cores: ExecutorCores = None,
    spark_conf: SparkConf = None,
) -> None:
    """Run the job: available-now stops when it has read everything there is; continuous
    runs until SIGINT or SIGTERM. Either way a restart continues from the checkpoint."""
    from dedup.spark.job import run_query, start_query
    from dedup.spark.runtime import start_session
    from dedup.spark.verify import summarize_sink

    configure_logging("info", "console")
    if dedup_key_header is not None and drop_duplicates_within is None:
        raise typer.BadParameter("--dedup-key-header needs --drop-duplicates-within")
    config = JobConfig(
        bootstrap=bootstrap,
        topic=topic,
        output=output.resolve(),
        checkpoint=(checkpoint or output.with_name(output.name + "-checkpoint")).resolve(),
        trigger=trigger,
        interval_s=interval_s,
        max_offsets_per_trigger=max_offsets_per_trigger,
        second_line=(
            None
            if drop_duplicates_within is None
            else SecondLine(within=drop_duplicates_within, key_header=dedup_key_header)
        ),
        reassemble=reassemble,
        chunk_expire_s=chunk_expire_s,
        kafka_options=_options(kafka_option or []),
    )
    stop = threading.Event()

    def request_stop(signum: int, _frame: FrameType | None) -> None:
        log.info("stopping", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    resources = _resources(master, driver_memory, executor_memory, executor_cores, spark_conf)
    try:
        spark = start_session(resources)
    except MissingRuntimeError as exc:
        typer.echo(f"dedup-proxy: {exc}", err=True)
        raise typer.Exit(2) from exc
    query = start_query(spark, config)
    log.info("started", topic=topic, output=str(config.output), trigger=str(trigger))
    if ready_file is not None:
        ready_file.touch()
    run_query(query, on_progress=_log_progress, should_stop=stop.is_set)
    report = summarize_sink(spark, config.output)
    report.write(summary or config.output.with_name(config.output.name + ".json"))
    _print_report(report)
    spark.stop()


@spark_app.command("verify")
def verify(
    output: Annotated[Path, typer.Option(help="directory of the Parquet sink")],
    scope: Annotated[Scope, typer.Option(help="where sequence ids are unique")] = Scope.TOPIC,
    expect_rows: Annotated[
        int | None, typer.Option(help="fail unless the sink holds exactly this many rows")
    ] = None,
    json_file: Annotated[Path | None, typer.Option("--json", help="also write JSON")] = None,
    topic: Annotated[
        list[str] | None,
        typer.Option(help="only this topic's rows (repeatable), for a sink fed by several"),
    ] = None,
    master: Master = "local[2]",
    driver_memory: DriverMemory = "1g",
    executor_memory: ExecutorMemory = None,
    executor_cores: ExecutorCores = None,
    spark_conf: SparkConf = None,
) -> None:
    """Report duplicates per (producer, sequence) and gaps; exit 1 if there are any (or
    the row count differs from --expect-rows)."""
    from dedup.spark.runtime import start_session
    from dedup.spark.verify import summarize_sink

    resources = _resources(master, driver_memory, executor_memory, executor_cores, spark_conf)
    try:
        spark = start_session(resources)
    except MissingRuntimeError as exc:
        typer.echo(f"dedup-proxy: {exc}", err=True)
        raise typer.Exit(2) from exc
    try:
        report = summarize_sink(spark, output.resolve(), scope, topics=topic)
    except FileNotFoundError as exc:
        typer.echo(f"dedup-proxy: {exc}", err=True)
        raise typer.Exit(2) from exc
    finally:
        spark.stop()
    if json_file is not None:
        report.write(json_file)
    _print_report(report)
    wrong_count = expect_rows is not None and report.rows != expect_rows
    if wrong_count:
        console.print(f"[red]expected {expect_rows:,} rows, the sink holds {report.rows:,}[/]")
    raise typer.Exit(0 if report.clean and not wrong_count else 1)


def _resources(
    master: str,
    driver_memory: str,
    executor_memory: str | None,
    executor_cores: int | None,
    spark_conf: list[str] | None,
) -> SparkResources:
    return SparkResources(
        master=master,
        driver_memory=driver_memory,
        executor_memory=executor_memory,
        executor_cores=executor_cores,
        extra_conf=tuple(_options(spark_conf or []).items()),
    )


def _options(pairs: list[str]) -> dict[str, str]:
    options = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise typer.BadParameter(f"{pair!r} is not NAME=VALUE")
        options[name] = value
    return options


def _log_progress(progress: dict[str, object]) -> None:
    log.info(
        "micro-batch",
        batch=progress.get("batchId"),
        rows=progress.get("numInputRows"),
        rows_per_s=progress.get("processedRowsPerSecond"),
    )


def _print_report(report: SinkReport, limit: int = 20) -> None:
    table = Table(title="Spark sink, per producer")
    for column in ("topic", "producer", "rows", "min seq", "max seq", "duplicates", "gaps"):
        table.add_column(column, justify="right" if column not in ("topic", "producer") else "left")
    for p in report.producers[:limit]:
        table.add_row(
            p.topic if p.partition is None else f"{p.topic}/{p.partition}",
            p.producer,
            f"{p.rows:,}",
            str(p.min_sequence),
            str(p.max_sequence),
            _mark(p.duplicates),
            _mark(p.gaps),
        )
    if len(report.producers) > limit:
        table.add_row("…", f"{len(report.producers) - limit} more", "", "", "", "", "")
    console.print(table)
    console.print(
        f"rows {report.rows:,}, distinct (producer, sequence) {report.distinct:,}, "
        f"duplicates {_mark(report.duplicates)}, gaps {_mark(report.gaps)}, "
        f"rows without identity {_mark(report.rows_without_identity)}, "
        f"incomplete chunked messages {_mark(report.incomplete)}"
    )


def _mark(count: int) -> str:
    return f"[green]{count:,}[/]" if count == 0 else f"[red]{count:,}[/]"
