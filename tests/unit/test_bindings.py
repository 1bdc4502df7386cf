"""Producer names under a configured prefix belong to the prefix's principal, whoever
used them first, and need no Redis (`dedup.bindings`; first-use bindings against real
Redis and a real proxy: tests/integration/test_tls.py)."""

from __future__ import annotations

import pytest

from dedup.bindings import ProducerBindings
from dedup.settings import DedupSettings
from tests.support.bindings import prefix_bindings

pytestmark = pytest.mark.unit


def bindings() -> ProducerBindings:
    prefixes = {"orders-": "User:orders", "orders-eu-": "User:eu", "audit": "User:audit"}
    return prefix_bindings(prefixes)


async def test_a_configured_prefix_decides_the_owner_and_the_longest_wins() -> None:
    owned = bindings()
    assert owned.configured_owner("orders-1") == "User:orders"
    assert owned.configured_owner("orders-eu-1") == "User:eu"
    assert owned.configured_owner("auditor") == "User:audit"
    assert owned.configured_owner("other") is None
    assert await owned.foreign("t", ["orders-1", "orders-2"], "User:orders") == {}
    assert await owned.foreign("t", ["orders-1", "orders-eu-1"], "User:orders") == {
        "orders-eu-1": "User:eu"
    }
    assert await owned.foreign("t", ["audit-x"], "User:orders") == {"audit-x": "User:audit"}


def test_prefixes_come_from_the_environment_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEDUP_PROXY_PRODUCER_NAME_PREFIXES", '{"orders-": "User:orders"}')
    assert DedupSettings().producer_name_prefixes == {"orders-": "User:orders"}
