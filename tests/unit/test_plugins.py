"""Commands plugged into ``dedup-proxy`` through the entry point group."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest
import typer
from typer.testing import CliRunner

from dedup.app.plugins import ENTRY_POINT_GROUP, add_plugin_commands

pytestmark = pytest.mark.unit

group_app = typer.Typer(help="A plugged-in group.")


@group_app.command("hello")
def hello() -> None:
    """Say hello."""
    typer.echo("hello from the group")


def greet(name: str = "world") -> None:
    """A plugged-in command."""
    typer.echo(f"greetings, {name}")


NOT_A_COMMAND = 42


def entry_point(name: str, attribute: str, module: str = __name__) -> EntryPoint:
    return EntryPoint(name=name, value=f"{module}:{attribute}", group=ENTRY_POINT_GROUP)


def product_app() -> typer.Typer:
    app = typer.Typer(no_args_is_help=True)

    @app.command()
    def serve() -> None:
        typer.echo("serving")

    @app.command("policy-list")
    def policies() -> None:
        typer.echo("policies")

    return app


def test_groups_and_functions_are_added_under_their_entry_point_names() -> None:
    app = product_app()
    add_plugin_commands(app, [entry_point("grp", "group_app"), entry_point("greet", "greet")])
    runner = CliRunner()
    assert runner.invoke(app, ["grp", "hello"]).output == "hello from the group\n"
    assert runner.invoke(app, ["greet", "--name", "lab"]).output == "greetings, lab\n"
    assert runner.invoke(app, ["serve"]).output == "serving\n"


def test_a_broken_plugin_is_reported_and_skipped(capsys: pytest.CaptureFixture[str]) -> None:
    app = product_app()
    add_plugin_commands(
        app,
        [
            entry_point("gone", "anything", module="no_such_module_for_dedup_proxy"),
            entry_point("odd", "NOT_A_COMMAND"),
            entry_point("missing", "no_such_attribute"),
            entry_point("greet", "greet"),
        ],
    )
    err = capsys.readouterr().err
    for name in ("gone", "odd", "missing"):
        assert f"plugin command {name!r}" in err
    assert "ModuleNotFoundError" in err
    assert "greet" not in err
    result = CliRunner().invoke(app, ["greet"])
    assert result.exit_code == 0
    assert result.output == "greetings, world\n"


def test_a_plugin_cannot_replace_a_product_command(capsys: pytest.CaptureFixture[str]) -> None:
    app = product_app()
    add_plugin_commands(
        app, [entry_point("serve", "greet"), entry_point("policy-list", "group_app")]
    )
    err = capsys.readouterr().err
    assert "'serve'" in err
    assert "'policy-list'" in err
    runner = CliRunner()
    assert runner.invoke(app, ["serve"]).output == "serving\n"
    assert runner.invoke(app, ["policy-list"]).output == "policies\n"


def test_the_lab_plugs_in_local_chaos_and_demo() -> None:
    """deploy/pyproject.toml's entry points, as installed by deploy/setup.sh."""
    app = product_app()
    add_plugin_commands(app)
    names = {group.name for group in app.registered_groups}
    names |= {command.name for command in app.registered_commands if command.name}
    assert {"local", "chaos", "demo"} <= names
