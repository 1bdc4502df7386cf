"""``dedup-proxy policy|producers|snapshots|snapshot|recover``: the admin API from a shell."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from dedup.client import ADMIN_TOKEN_ENV, admin_tls_from_env
from dedup.policies import Mode

AdminUrl = Annotated[
    str,
    typer.Option(envvar="DEDUP_PROXY_ADMIN_URL", help="the proxy's admin URL"),
]
DEFAULT_ADMIN_URL = "http://127.0.0.1:29080"

policy_app = typer.Typer(help="Read and change dedup policies (effective without restart).")
console = Console()


def _call(
    admin_url: str,
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
    timeout_s: float = 30.0,
) -> Any:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    token = os.environ.get(ADMIN_TOKEN_ENV)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(
        admin_url.rstrip("/") + path, data=data, method=method, headers=headers
    )
    try:
        context = admin_tls_from_env()  # DEDUP_PROXY_ADMIN_CA_FILE, _CERT_FILE, _KEY_FILE
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as answer:
            return json.load(answer)
    except urllib.error.HTTPError as exc:
        typer.echo(f"dedup-proxy: {exc.code} {exc.read().decode(errors='replace')}", err=True)
        raise typer.Exit(1) from exc
    except (urllib.error.URLError, OSError) as exc:
        typer.echo(f"dedup-proxy: cannot reach the admin API at {admin_url}: {exc}", err=True)
        raise typer.Exit(1) from exc


def _policy_path(scope: str, name: str | None) -> str:
    if scope == "global":
        return "/v1/policies/global"
    if not name:
        raise typer.BadParameter(f"a {scope} policy needs a name")
    kind = {"prefix": "prefixes", "topic": "topics"}[scope]
    return f"/v1/policies/{kind}/{urllib.parse.quote(name, safe='')}"


Scope = Annotated[str, typer.Argument(help="global, prefix or topic")]


@policy_app.command("show")
def show(admin_url: AdminUrl = DEFAULT_ADMIN_URL, json_output: bool = False) -> None:
    """Every policy, and the start-up default."""
    policies = _call(admin_url, "GET", "/v1/policies")
    if json_output:
        typer.echo(json.dumps(policies))
        return
    table = Table(title="dedup policies (most specific wins: topic > prefix > global > default)")
    table.add_column("scope")
    table.add_column("name")
    table.add_column("mode")
    table.add_row("default", "", policies["default"])
    table.add_row("global", "", policies["global"] or "(not set)")
    for prefix, mode in policies["prefixes"].items():
        table.add_row("prefix", prefix, mode)
    for topic, mode in policies["topics"].items():
        table.add_row("topic", topic, mode)
    for where, value in policies.get("invalid", {}).items():
        scope, _, name = where.partition(" ")
        table.add_row(scope, name, f"{value!r}: not a mode, ignored")
    console.print(table)


@policy_app.command("set")
def set_policy(
    scope: Scope,
    mode: Annotated[Mode, typer.Argument(help="enabled, require or disabled")],
    name: Annotated[str | None, typer.Argument(help="the prefix or topic")] = None,
    admin_url: AdminUrl = DEFAULT_ADMIN_URL,
) -> None:
    """Set a policy, e.g. `policy set topic require orders` or `policy set global disabled`."""
    answer = _call(admin_url, "PUT", _policy_path(_scope(scope), name), {"mode": mode.value})
    if answer.get("cleared_topics"):
        typer.echo(f"dedup state cleared for: {', '.join(answer['cleared_topics'])}")
    typer.echo("ok")


@policy_app.command("clear")
def clear_policy(
    scope: Scope,
    name: Annotated[str | None, typer.Argument(help="the prefix or topic")] = None,
    admin_url: AdminUrl = DEFAULT_ADMIN_URL,
) -> None:
    """Remove a policy: the next less specific one applies."""
    _call(admin_url, "DELETE", _policy_path(_scope(scope), name))
    typer.echo("ok")


def producers(
    topic: Annotated[str, typer.Argument(help="the topic")],
    partition: Annotated[int, typer.Option(help="the partition")] = 0,
    name: Annotated[
        str | None, typer.Option(help="one producer: its last persisted sequence id")
    ] = None,
    admin_url: AdminUrl = DEFAULT_ADMIN_URL,
    json_output: bool = False,
) -> None:
    """The producers a partition tracks, or one producer's last sequence id."""
    quoted = urllib.parse.quote(topic, safe="")
    if name is not None:
        who = urllib.parse.quote(name, safe="")
        answer = _call(admin_url, "GET", f"/v1/topics/{quoted}/producers/{who}")
        typer.echo(json.dumps(answer) if json_output else str(answer["last_sequence_id"]))
        return
    answer = _call(admin_url, "GET", f"/v1/topics/{quoted}/partitions/{partition}/producers")
    if json_output:
        typer.echo(json.dumps(answer))
        return
    table = Table(title=f"producers of {topic}/{partition}")
    for column in ("producer", "pushed", "persisted", "last seen (ms)"):
        table.add_column(column)
    for producer, state in answer["producers"].items():
        table.add_row(
            producer, str(state["pushed"]), str(state["persisted"]), str(state["last_seen_ms"])
        )
    console.print(table)


def snapshots(admin_url: AdminUrl = DEFAULT_ADMIN_URL, json_output: bool = False) -> None:
    """Per partition the proxy writes: recovered or not, latest snapshot offset and age."""
    answer = _call(admin_url, "GET", "/v1/snapshots")
    if json_output:
        typer.echo(json.dumps(answer))
        return
    table = Table(title=f"snapshots (topic {answer['snapshot_topic']})")
    columns = ("partition", "recovered", "snapshot offset", "age (s)", "acknowledged end")
    for column in columns:
        table.add_column(column)
    for p in answer["partitions"]:
        table.add_row(
            f"{p['topic']}/{p['partition']}",
            "yes" if p["recovered"] else "recovering",
            "-" if p["snapshot_offset"] is None else str(p["snapshot_offset"]),
            "-" if p["snapshot_age_s"] is None else f"{p['snapshot_age_s']:.1f}",
            str(p["acknowledged_end"]),
        )
    console.print(table)


def snapshot(
    topic: Annotated[str, typer.Argument(help="the topic")],
    partition: Annotated[int, typer.Argument(help="the partition")],
    admin_url: AdminUrl = DEFAULT_ADMIN_URL,
) -> None:
    """Snapshot one partition's dedup state now."""
    quoted = urllib.parse.quote(topic, safe="")
    answer = _call(admin_url, "POST", f"/v1/topics/{quoted}/partitions/{partition}/snapshot")
    typer.echo(
        f"snapshot of {topic}/{partition} at offset {answer['offset']} "
        f"(generation {answer['generation']}, {answer['producers']} producers)"
    )


def recover(
    topic: Annotated[str, typer.Argument(help="the topic")],
    partition: Annotated[int, typer.Argument(help="the partition")],
    wait_s: Annotated[float, typer.Option(help="how long to wait for it")] = 120.0,
    admin_url: AdminUrl = DEFAULT_ADMIN_URL,
) -> None:
    """Rebuild one partition's dedup state from its snapshot and log now."""
    quoted = urllib.parse.quote(topic, safe="")
    path = f"/v1/topics/{quoted}/partitions/{partition}/recover?wait_s={wait_s}"
    answer = _call(admin_url, "POST", path, timeout_s=wait_s + 10)
    typer.echo(
        f"{topic}/{partition} recovered up to offset {answer['end']} "
        f"(from snapshot offset {answer['snapshot_offset']})"
    )


def reset_producer(
    topic: Annotated[str, typer.Argument(help="the topic")],
    partition: Annotated[
        str, typer.Argument(help="the partition, or `all`: every one this instance owns")
    ],
    producer: Annotated[str, typer.Argument(help="the producer name")],
    admin_url: AdminUrl = DEFAULT_ADMIN_URL,
) -> None:
    """Forget one producer on a partition (or on all of a topic's partitions this instance
    owns): its next record is new whatever its sequence (recorded in the snapshot topic, so
    a recovery honours it)."""
    quoted, name = urllib.parse.quote(topic, safe=""), urllib.parse.quote(producer, safe="")
    if partition == "all":
        answer = _call(admin_url, "POST", f"/v1/topics/{quoted}/producers/{name}/reset")
        for number, offset in sorted(answer["reset"].items(), key=lambda item: int(item[0])):
            typer.echo(f"producer {producer} reset on {topic}/{number} at offset {offset}")
        if answer["not_owned_here"]:
            typer.echo(
                f"not owned by this instance (reset them on their owners): partitions "
                f"{', '.join(str(p) for p in answer['not_owned_here'])}"
            )
        return
    if not partition.isdigit():
        raise typer.BadParameter(f"partition must be a number or `all`, not {partition!r}")
    path = f"/v1/topics/{quoted}/partitions/{int(partition)}/producers/{name}/reset"
    answer = _call(admin_url, "POST", path)
    typer.echo(f"producer {producer} reset on {topic}/{partition} at offset {answer['offset']}")


def _scope(scope: str) -> str:
    if scope not in ("global", "prefix", "topic"):
        raise typer.BadParameter(f"scope must be global, prefix or topic, not {scope!r}")
    return scope
