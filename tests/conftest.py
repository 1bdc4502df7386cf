"""Shared fixtures. The local environment (real Kafka + Redis) is started once per test
session and left running afterwards: `up` is idempotent, so the next session reuses it,
and `dedup-proxy local down` stops it."""

from __future__ import annotations

import pytest

from deploy.local import EnvInfo, LocalEnvironment
from deploy.paths import MissingRuntimeError


@pytest.fixture(scope="session")
def local_environment() -> LocalEnvironment:
    """The manager of the local environment (for tests that kill and restart processes)."""
    return LocalEnvironment()


@pytest.fixture(scope="session")
def local_env(local_environment: LocalEnvironment) -> EnvInfo:
    """Addresses of a running single-broker Kafka and Redis."""
    try:
        return local_environment.up(brokers=1)
    except MissingRuntimeError as exc:
        pytest.fail(f"the local environment cannot start: {exc}", pytrace=False)
