"""``dedup-proxy chaos run``: the seed's dedup experiment against the proxy."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, cast

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from deploy.chaos.producers import CLIENTS, MAX_IN_FLIGHT, Client
from deploy.chaos.report import (
    any_wrong_report,
    describe_reports,
    plot_summary,
    render_table,
    summarize,
)
from deploy.chaos.runner import RunPlan, run_plan
from deploy.chaos.scenarios import SCENARIOS, FaultSettings
from deploy.chaos.topology import ChaosTopology, Topology

BACKENDS = ("local", "containers")

chaos_app = typer.Typer(
    help="The dedup experiment: faults under load, with and without dedup.\n\n"
    "Fault injection: producers through the proxy, checked for "
    "duplicates, losses and reordering."
)
console = Console()


@chaos_app.command("run")
def run(
    scenario: Annotated[
        str,
        typer.Option(help=f"one of: {', '.join(SCENARIOS)} (or several, comma separated), or all"),
    ] = "kill-tcp",
    runs: Annotated[int, typer.Option(min=1, help="runs per dedup setting")] = 5,
    messages: Annotated[int, typer.Option(min=1, help="messages per run")] = 100_000,
    fail_at: Annotated[int, typer.Option(min=0, help="inject the failure at this count")] = 20_000,
    dedup: Annotated[str, typer.Option(help="on, off or both")] = "both",
    client: Annotated[str, typer.Option(help=f"one of: {', '.join(CLIENTS)}")] = CLIENTS[0],
    fault_s: Annotated[float, typer.Option(help="how long the failure lasts")] = 10.0,
    latency_ms: Annotated[
        int, typer.Option(help="latency on the brokers' responses, every scenario (the seed's)")
    ] = 20,
    slow_latency_ms: Annotated[int, typer.Option(help="slow-network's latency, every hop")] = 100,
    retry_for_s: Annotated[float, typer.Option(help="how long producers retry")] = 300.0,
    results: Annotated[Path | None, typer.Option(help="results directory")] = None,
    keep_env: Annotated[bool, typer.Option(help="leave Kafka, Redis, Toxiproxy up")] = False,
    port_shift: Annotated[
        int,
        typer.Option(
            envvar="DEDUP_CHAOS_PORT_SHIFT",
            help="move every port of the chaos environment (22092.. by default) by this much",
        ),
    ] = 0,
    backend: Annotated[
        str,
        typer.Option(
            help="where Kafka, Redis, Toxiproxy and the proxy run: local (processes) or "
            "containers (the project's images, deploy/containers; ports 32092..)"
        ),
    ] = "local",
) -> None:
    """Run a scenario; exit 1 if any dedup-on run shows a duplicate, a loss, a jump, or a
    delivery report naming another record's offset."""
    # "all" is every scenario the backend can run; one named that it cannot is refused below.
    names = (
        [n for n, s in SCENARIOS.items() if backend in s.backends]
        if scenario == "all"
        else scenario.split(",")
    )
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise typer.BadParameter(f"unknown scenario {unknown[0]!r}; one of {', '.join(SCENARIOS)}")
    if client not in CLIENTS:
        raise typer.BadParameter(f"unknown client {client!r}; one of {', '.join(CLIENTS)}")
    settings = {"on": (True,), "off": (False,), "both": (False, True)}.get(dedup)
    if settings is None:
        raise typer.BadParameter("--dedup must be on, off or both")
    if not MAX_IN_FLIGHT < fail_at < messages:
        raise typer.BadParameter(
            f"--fail-at must be above the {MAX_IN_FLIGHT:,} messages in flight (so the failure "
            "meets writes that were acknowledged) and below --messages"
        )
    if backend not in BACKENDS:
        raise typer.BadParameter(f"--backend must be one of {', '.join(BACKENDS)}")
    refused = [n for n in names if backend not in SCENARIOS[n].backends]
    if refused:
        raise typer.BadParameter(
            f"scenario {refused[0]!r} cannot run on the {backend} backend (it runs on: "
            f"{', '.join(SCENARIOS[refused[0]].backends)}); use --backend local"
        )
    root = results or Path("chaos-results") / f"{time.strftime('%Y%m%d-%H%M%S')}-{backend}"
    root.mkdir(parents=True, exist_ok=True)
    # Which backend made these results, beside the CSVs, so runs compare side by side.
    (root / "run.json").write_text(
        json.dumps(
            {
                "backend": backend,
                "scenarios": names,
                "runs": runs,
                "messages": messages,
                "fail_at": fail_at,
                "dedup": dedup,
                "client": client,
                "fault_s": fault_s,
                "latency_ms": latency_ms,
            },
            indent=2,
        )
        + "\n"
    )
    topology = _topology(backend, port_shift)
    console.print(f"bringing up 3 Kafka brokers, Redis and Toxiproxy ({backend}) ...")
    try:
        topology.up()
    except Exception:
        topology.down()
        raise
    dirty = False
    try:
        for name in names:
            directory = root / name
            directory.mkdir(parents=True, exist_ok=True)
            plan = RunPlan(
                SCENARIOS[name],
                runs,
                messages,
                fail_at,
                settings,
                client=cast(Client, client),
                fault=FaultSettings(fault_s, latency_ms, slow_latency_ms),
                retry_for_s=retry_for_s,
            )
            with Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
            ) as bar:
                task = bar.add_task(name, total=messages)

                def progress(
                    what: str, done: int, total: int, task: TaskID = task, name: str = name
                ) -> None:
                    bar.update(task, description=f"{name} {what}", completed=done, total=total)

                outcomes = run_plan(plan, topology, directory, progress)
            csv_path = directory / f"test-{name}_dedup_output.csv"
            summary = summarize(csv_path)
            plot_summary(csv_path, directory / f"test-{name}.png", f"{name} ({client}, {backend})")
            console.print(render_table(summary))
            for line in describe_reports(outcomes):
                console.print(line)
            console.print(f"results in {directory}")
            # Control runs alone (--dedup off) have no verdict to fail.
            dirty = dirty or (dedup != "off" and not summary.dedup_on_clean)
            dirty = dirty or any_wrong_report(outcomes, dedup_enabled=True)
    finally:
        if not keep_env:
            topology.down()
    if dirty:
        console.print(
            "[red]a dedup-on run shows duplicates, losses or jumps, or a delivery report "
            "naming another record's offset[/]"
        )
        raise typer.Exit(1)


def _topology(backend: str, port_shift: int) -> Topology:
    if backend == "local":
        return ChaosTopology(port_shift)
    # Imported here: the local backend needs neither the engine nor its images.
    from deploy.chaos.containers import CONTAINER_PORT_SHIFT, ContainerTopology
    from deploy.containers import engine

    try:
        engine.ensure().activate()  # starts an engine and builds the images if need be
    except engine.EngineUnavailable as exc:
        console.print(f"[red]containers cannot run here: {exc}[/]")
        raise typer.Exit(2) from exc
    return ContainerTopology(CONTAINER_PORT_SHIFT + port_shift)
