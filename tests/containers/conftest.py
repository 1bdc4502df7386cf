"""Fixtures of the container tests: an engine with the project's images, started and built
on first use (deploy/containers/engine.sh: minutes on a fresh machine, a second or two
after), or every test that needs it skipped with the reason containers cannot run here."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from deploy.containers import engine as containers
from deploy.containers.engine import Engine, EngineUnavailable


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    try:
        found = containers.ensure()
    except EngineUnavailable as exc:
        pytest.skip(f"containers cannot run here: {exc}")
    saved = {key: os.environ.get(key) for key in found.environ()}
    found.activate()
    yield found
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
