"""Producer bindings for unit tests that never reach Redis: names under a configured prefix
are bound by the prefix alone (`dedup.bindings`), so any Redis call is a test failure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dedup.bindings import ProducerBindings


class NoRedis:
    def pipeline(self, **_: Any) -> Any:
        raise AssertionError("names under a configured prefix need no Redis")


def prefix_bindings(prefixes: Mapping[str, str]) -> ProducerBindings:
    """Bindings by prefix only (prefix -> principal)."""
    return ProducerBindings(NoRedis(), prefixes=dict(prefixes))  # type: ignore[arg-type]
