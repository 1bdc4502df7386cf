"""The main job, on the embedded default.

Several loaders replay generated order files (row number = sequence id) into two topics at
once: through the proxy, and straight into Kafka as the control. Both paths use the same
client with Kafka's idempotent producer on, and both suffer the same faults:
- a loader crashes (SIGKILL) and its supervisor restarts it from its last checkpoint, so
  it sends rows again (twice over the run, two different loaders);
- the proxy is killed (SIGKILL) and restarted, cutting every connection through it;
- the Spark job is killed (SIGKILL) and restarted from its checkpoint.
The Spark job reads both topics with Spark's Kafka source into one exactly-once sink. The
report counts, per path, the source, what was sent, the topic, Spark's rows and duplicates,
and checks each delivery report the loaders got against the record at the offset it names.
"""

from __future__ import annotations

import csv
import json
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from deploy.chaos.reported_offsets import ReportedOffsets
from deploy.demo.delivery import check_reports, read_reports
from deploy.demo.processes import Loader, LoaderSpec, SparkJob
from deploy.demo.report import DemoReport, PathReport
from deploy.demo.topics import count_topic, create_topic
from deploy.launcher import ProxyProcess
from deploy.local import EnvInfo, LocalEnvironment

console = Console()


@dataclass(frozen=True)
class DemoSize:
    rows_per_producer: int
    rows_per_s: float  # per loader, so that the faults land mid-load
    checkpoint_every: int
    producers: int = 3
    partitions: int = 3


FULL = DemoSize(rows_per_producer=50_000, rows_per_s=2_500.0, checkpoint_every=2_000)
SMALL = DemoSize(rows_per_producer=6_000, rows_per_s=500.0, checkpoint_every=500)

# Where in the run (fraction of the rows through the proxy) the shared faults happen.
PROXY_KILL_AT = 0.45
SPARK_KILL_AT = 0.6
LOAD_TIMEOUT_S = 900.0
SPARK_CATCH_UP_TIMEOUT_S = 600.0
SPARK_START_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Paths:
    work: Path

    @property
    def sink(self) -> Path:
        return self.work / "spark-sink"

    @property
    def checkpoint(self) -> Path:
        return self.work / "spark-checkpoint"

    @property
    def spark_summary(self) -> Path:
        return self.work / "spark-summary.json"

    @property
    def chart(self) -> Path:
        return self.work / "demo.png"

    @property
    def logs(self) -> Path:
        return self.work / "logs"

    @property
    def spark_log(self) -> Path:
        return self.logs / "spark.log"

    @property
    def spark_ready(self) -> Path:
        return self.work / "spark.ready"


def run_demo(size: DemoSize, report_path: Path | None, work_dir: Path | None) -> int:
    environment = LocalEnvironment()
    with console.status("Starting the local Kafka (KRaft) and Redis..."):
        env = environment.up(brokers=1)
    console.print(f"[green]✓[/] Kafka at [bold]{env.bootstrap}[/], Redis at {env.redis}")
    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:4]
    paths = Paths(work_dir or environment.home / "demo" / run_id)
    paths.logs.mkdir(parents=True, exist_ok=True)
    topics = {"proxy": f"demo-{run_id}-proxy", "control": f"demo-{run_id}-control"}
    for topic in topics.values():
        create_topic(env.bootstrap, topic, size.partitions)

    proxy = _proxy(env, run_id, paths)
    with console.status("Starting the proxy..."):
        proxy.start()
    console.print(f"[green]✓[/] Proxy at [bold]{proxy.bootstrap}[/] (admin {proxy.admin_url})")
    try:
        sources = _write_sources(paths.work / "sources", size)
        console.print(
            f"[green]✓[/] {size.producers} order files of {size.rows_per_producer:,} rows in "
            f"{sources[0].parent}"
        )
        job_args = [
            *("--bootstrap", env.bootstrap, "--topic", ",".join(topics.values())),
            *("--output", str(paths.sink), "--checkpoint", str(paths.checkpoint)),
            *("--summary", str(paths.spark_summary)),
        ]
        continuous = ["--trigger", "continuous", "--interval-s", "1"]
        streaming = SparkJob([*job_args, *continuous], paths.spark_log, paths.spark_ready)
        with console.status("Starting the Spark job (continuous, a micro-batch a second)..."):
            streaming.start()
            streaming.wait_ready(SPARK_START_TIMEOUT_S)
        console.print(f"[green]✓[/] Spark job reading both topics (log {paths.spark_log})")
        loaders = _loaders(size, sources, proxy, env, topics, paths)
        _run_load(size, loaders, proxy, streaming)
        with console.status("Stopping the streaming job (SIGTERM)..."):
            streaming.stop()
        with console.status("Spark catches up with both topics (trigger availableNow)..."):
            available_now = ["--trigger", "available-now"]
            catch_up = SparkJob([*job_args, *available_now], paths.spark_log, paths.spark_ready)
            catch_up.start()
            code = catch_up.wait(SPARK_CATCH_UP_TIMEOUT_S)
        if code != 0:
            console.print(f"[red]the Spark job failed ({code}); see {paths.spark_log}[/]")
            return 1
        with console.status("Counting the topics..."):
            report = _report(size, env, topics, loaders, paths)
    finally:
        with console.status("Stopping the proxy (draining in-flight requests)..."):
            proxy.stop()

    console.print(report.table())
    report.write_chart(paths.chart)
    console.print(f"Chart: {paths.chart}\nSpark's sink: {paths.sink}\nLogs: {paths.logs}")
    if report_path is not None:
        report.write_json(report_path)
        console.print(f"Report: {report_path}")
    console.print("Kafka and Redis keep running for the next command: `dedup-proxy local down`.")
    if not report.proxy.exact:
        console.print("[bold red]The proxy path is not exact.[/]")
        return 1
    if report.proxy.reports_wrong:
        console.print("[bold red]Delivery reports through the proxy named other records.[/]")
        return 1
    verdict = (
        f"the control has {report.control.duplicates:,} duplicates"
        if report.control.duplicates
        else "the control happened to get no duplicates this time"
    )
    console.print(f"[bold green]Through the proxy: every record exactly once[/]; {verdict}.")
    return 0


def _proxy(env: EnvInfo, run_id: str, paths: Paths) -> ProxyProcess:
    return ProxyProcess(
        upstream=env.bootstrap,
        env={
            "DEDUP_PROXY_REDIS": env.redis,
            "DEDUP_PROXY_REDIS_KEY_PREFIX": f"demo-{run_id}",
            # Stable across restarts: the restarted proxy fences its own predecessor.
            "DEDUP_PROXY_INSTANCE_ID": f"demo-{run_id}",
        },
        log_path=paths.logs / "proxy.log",
    )


def _write_sources(directory: Path, size: DemoSize) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    generator = random.Random(7)
    sources = []
    for index in range(size.producers):
        path = directory / f"orders-{index + 1}.csv"
        with path.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["order_id", "customer", "amount", "created"])
            for row in range(size.rows_per_producer):
                writer.writerow(
                    [
                        f"o-{index + 1}-{row}",
                        f"c-{generator.randrange(5000)}",
                        f"{generator.uniform(1, 500):.2f}",
                        1_700_000_000 + row,
                    ]
                )
        sources.append(path)
    return sources


def _loaders(
    size: DemoSize,
    sources: list[Path],
    proxy: ProxyProcess,
    env: EnvInfo,
    topics: dict[str, str],
    paths: Paths,
) -> dict[str, list[Loader]]:
    # Loader 2 crashes early, loader 3 late, each well past its last checkpoint so that it
    # has many acknowledged rows to send again.
    def crash_point(fraction: float) -> int:
        boundary = int(size.rows_per_producer * fraction) // size.checkpoint_every
        return boundary * size.checkpoint_every + int(size.checkpoint_every * 0.8)

    crash_points = {1: crash_point(0.3), 2: crash_point(0.7)}
    bootstraps = {"proxy": proxy.bootstrap, "control": env.bootstrap}
    loaders: dict[str, list[Loader]] = {}
    for path_name, topic in topics.items():
        loaders[path_name] = []
        for index, source in enumerate(sources):
            name = f"loader-{index + 1}"
            spec = LoaderSpec(
                producer=name,
                source=source,
                topic=topic,
                bootstrap=bootstraps[path_name],
                checkpoint=paths.work / f"{path_name}-{name}.checkpoint.json",
                checkpoint_every=size.checkpoint_every,
                rows_per_s=size.rows_per_s,
                crash_after_row=crash_points.get(index),
                reports=paths.work / f"{path_name}-{name}.reports.csv",
            )
            spec.reports.unlink(missing_ok=True)  # appended by each of this loader's runs
            loaders[path_name].append(Loader(spec, paths.logs / f"{path_name}-{name}.log"))
    return loaders


def _run_load(
    size: DemoSize, loaders: dict[str, list[Loader]], proxy: ProxyProcess, spark: SparkJob
) -> None:
    total = size.producers * size.rows_per_producer
    faults: list[tuple[float, str, Callable[[], None]]] = [
        (PROXY_KILL_AT, "proxy killed (SIGKILL) and restarted", lambda: _restart_proxy(proxy)),
        (SPARK_KILL_AT, "Spark job killed (SIGKILL) and restarted", lambda: _restart(spark)),
    ]
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        tasks = {
            path: progress.add_task(f"rows acknowledged, {label}", total=total)
            for path, label in (("proxy", "through the proxy"), ("control", "control      "))
        }
        for group in loaders.values():
            for loader in group:
                loader.start()
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while not all(loader.done for group in loaders.values() for loader in group):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the loaders did not finish within {LOAD_TIMEOUT_S:.0f} s")
            for path, group in loaders.items():
                for loader in group:
                    event = loader.supervise()
                    if event is not None:
                        progress.console.print(f"[yellow]fault:[/] {event}")
                done = sum(loader.checkpoint().next_row for loader in group)
                progress.update(tasks[path], completed=done)
            proxy_done = progress.tasks[tasks["proxy"]].completed / total
            while faults and proxy_done >= faults[0][0]:
                _, label, inject = faults.pop(0)
                progress.console.print(f"[yellow]fault:[/] {label}")
                inject()
            time.sleep(0.1)


def _restart_proxy(proxy: ProxyProcess) -> None:
    proxy.kill()
    time.sleep(1.0)  # clients see refused connections for a moment, as with a real crash
    proxy.start()


def _restart(spark: SparkJob) -> None:
    spark.kill()
    spark.start()


def _report(
    size: DemoSize,
    env: EnvInfo,
    topics: dict[str, str],
    loaders: dict[str, list[Loader]],
    paths: Paths,
) -> DemoReport:
    summary = json.loads(paths.spark_summary.read_text())
    source = size.producers * size.rows_per_producer
    reports = {}
    for path, topic in topics.items():
        in_topic = count_topic(env.bootstrap, topic)
        delivered = ReportedOffsets.total(
            [
                check_reports(
                    read_reports(loader.spec.reports), loader.spec.producer, in_topic.identities
                )
                for loader in loaders[path]
            ]
        )
        producers = [p for p in summary["producers"] if p["topic"] == topic]
        rows = sum(p["rows"] for p in producers)
        distinct = sum(p["distinct"] for p in producers)
        reports[path] = PathReport(
            source_records=source,
            sent_records=sum(loader.checkpoint().sent for loader in loaders[path]),
            topic_records=in_topic.records,
            spark_rows=rows,
            duplicates=rows - distinct,
            missing=source - distinct,
            reports_right=delivered.right,
            reports_unknown=delivered.unknown,
            reports_wrong=delivered.wrong,
        )
    return DemoReport(proxy=reports["proxy"], control=reports["control"])
