"""Commands other distributions add to ``dedup-proxy``, through an entry point group.

A distribution names, in its ``[project.entry-points."kafka_dedup_proxy.commands"]``, either
a Typer app (added as a command group under the entry point's name) or a function (added as a
command of that name). The lab (deploy/pyproject.toml) adds ``local``, ``chaos`` and ``demo``
this way, so the product never imports it. A plugin that cannot be loaded, is neither, or
would take a name the CLI already has is reported on stderr and left out: a broken plugin
never breaks the product's commands.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import typer

ENTRY_POINT_GROUP = "kafka_dedup_proxy.commands"


def add_plugin_commands(app: typer.Typer, plugins: Iterable[EntryPoint] | None = None) -> None:
    """Add every plugin's commands to `app`; call it after the app's own commands are
    registered. `plugins` defaults to the installed entry points of ENTRY_POINT_GROUP."""
    found = entry_points(group=ENTRY_POINT_GROUP) if plugins is None else plugins
    taken = _registered_names(app)
    for entry_point in sorted(found, key=lambda ep: ep.name):
        name = entry_point.name
        if name in taken:
            _skip(entry_point, f"the name {name!r} is taken by another command")
            continue
        try:
            plugin = entry_point.load()
        except Exception as exc:  # any failure: the product's own commands must still work
            _skip(entry_point, f"failed to load: {type(exc).__name__}: {exc}")
            continue
        if isinstance(plugin, typer.Typer):
            app.add_typer(plugin, name=name)
        elif callable(plugin):
            app.command(name)(plugin)
        else:
            _skip(entry_point, f"is a {type(plugin).__name__}, not a Typer app or a function")
            continue
        taken.add(name)


def _registered_names(app: typer.Typer) -> set[str]:
    names = {group.name for group in app.registered_groups if group.name}
    for command in app.registered_commands:
        if command.name:
            names.add(command.name)
        elif command.callback is not None:
            names.add(_command_name(command.callback))
    return names


def _command_name(callback: Callable[..., Any]) -> str:
    # Typer's default: the function's name with underscores as dashes.
    return callback.__name__.lower().replace("_", "-")


def _skip(entry_point: EntryPoint, why: str) -> None:
    print(
        f"dedup-proxy: plugin command {entry_point.name!r} ({entry_point.value}) left out: {why}",
        file=sys.stderr,
    )
