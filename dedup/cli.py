"""``dedup-proxy policy ...`` and ``dedup-proxy producers ...``: the admin API from a shell."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from dedup.policies import Mode

AdminUrl = Annotated[
    str,
    typer.Option(envvar="DEDUP_PROXY_ADMIN_URL", help="the proxy's admin URL"),
]
DEFAULT_ADMIN_URL = "http://127.0.0.1:29080"

policy_app = typer.Typer(help="Read and change dedup policies (effective without restart).")
console = Console()


def _call(admin_url: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        admin_url.rstrip("/") + path,
        data=data,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
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


def _scope(scope: str) -> str:
    if scope not in ("global", "prefix", "topic"):
        raise typer.BadParameter(f"scope must be global, prefix or topic, not {scope!r}")
    return scope
