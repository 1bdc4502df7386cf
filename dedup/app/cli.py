"""The ``dedup-proxy`` command line."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer

from dedup.app.admin_commands import (
    policy_app,
    producers,
    recover,
    reset_producer,
    snapshot,
    snapshots,
)
from dedup.app.plugins import add_plugin_commands
from dedup.app.settings import Settings, load_settings
from dedup.ownership.members import DuplicateInstance
from dedup.spark.cli import spark_app
from proxy.runtime.logs import configure_logging
from proxy.runtime.settings import ConfigError

app = typer.Typer(
    help="A Kafka-protocol proxy with Pulsar-style guaranteed deduplication.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(policy_app, name="policy", help="Read and change dedup policies.")
app.add_typer(spark_app, name="spark", help="The Spark job reading a deduplicated topic.")
app.command("producers")(producers)
app.command("snapshots")(snapshots)
app.command("snapshot")(snapshot)
app.command("recover")(recover)
app.command("reset-producer")(reset_producer)


@app.command()
def serve(
    config: Annotated[
        Path | None,
        typer.Option(help="TOML configuration file (environment and flags override it)"),
    ] = None,
    upstream: Annotated[
        str | None, typer.Option(help="Kafka bootstrap servers, HOST:PORT[,...]")
    ] = None,
    listen: Annotated[str | None, typer.Option(help="bootstrap listener, HOST:PORT")] = None,
    advertised_host: Annotated[
        str | None, typer.Option(help="host name clients are told to connect to")
    ] = None,
    broker_port_base: Annotated[
        int | None, typer.Option(help="port of broker node 0's listener (default: listen + 1)")
    ] = None,
    redis: Annotated[str | None, typer.Option(help="Redis URL")] = None,
    admin: Annotated[str | None, typer.Option(help="admin HTTP listener, HOST:PORT")] = None,
    no_dedup: Annotated[
        bool, typer.Option("--no-dedup", help="start with dedup disabled for unpoliced topics")
    ] = False,
    pass_through: Annotated[
        bool,
        typer.Option(
            "--pass-through",
            help="a plain Kafka proxy: no dedup at all, no Redis (policies cannot enable it)",
        ),
    ] = False,
    instance_id: Annotated[
        str | None, typer.Option(help="this instance's name, unique among live instances")
    ] = None,
    placement: Annotated[
        str | None, typer.Option(help="balanced (default) or sidecar: who owns each partition")
    ] = None,
    local_broker_id: Annotated[
        int | None, typer.Option(help="sidecar placement: the broker this instance is beside")
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            help="worker processes sharing the bootstrap port, each with broker and admin "
            "ports of its own (default 1: in this process)"
        ),
    ] = None,
    log_level: Annotated[str | None, typer.Option(help="debug, info, warning or error")] = None,
    log_format: Annotated[str | None, typer.Option(help="json or console")] = None,
) -> None:
    """Run the proxy in front of a Kafka cluster until SIGINT or SIGTERM."""
    from proxy.runtime.lifecycle import BackgroundFailure, install_event_loop, install_stack_dumps

    try:
        settings = load_settings(
            config,
            upstream=upstream,
            listen=listen,
            advertised_host=advertised_host,
            broker_port_base=broker_port_base,
            redis=redis,
            admin=admin,
            log_level=log_level,
            log_format=log_format,
            instance_id=instance_id,
            placement=placement,
            local_broker_id=local_broker_id,
            workers=workers,
            dedup=False if no_dedup else None,
            pass_through=True if pass_through else None,
        )
    except ConfigError as exc:
        typer.echo(f"dedup-proxy: {exc}", err=True)
        raise typer.Exit(2) from exc
    configure_logging(settings.log_level, settings.log_format, settings.log_stream)
    if settings.workers > 1:
        from dedup.app.workers import run_workers

        raise typer.Exit(run_workers(settings, config))
    install_event_loop()
    install_stack_dumps()
    try:
        asyncio.run(_serve(settings))
    except DuplicateInstance as exc:
        typer.echo(f"dedup-proxy: {exc}", err=True)
        raise typer.Exit(2) from exc
    except OSError as exc:
        typer.echo(f"dedup-proxy: cannot listen: {exc}", err=True)
        raise typer.Exit(1) from exc
    except BackgroundFailure as exc:  # logged with its traceback: shut down, restart me
        typer.echo(f"dedup-proxy: {exc}", err=True)
        raise typer.Exit(1) from exc


async def _serve(settings: Settings) -> None:
    from dedup.app.assemble import assemble
    from proxy.runtime.lifecycle import run_proxy

    proxy = assemble(settings)  # inside the loop: the dedup service binds to it
    await run_proxy(proxy.server, proxy.admin_routes)


# The lab's commands (local, chaos, demo) where it is installed; after the product's own,
# so none of them can be taken.
add_plugin_commands(app)


def main() -> None:
    app()
