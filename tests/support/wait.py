"""Waiting on a condition instead of sleeping a fixed time."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
    condition: Callable[[], object],
    timeout_s: float,
    what: str | Callable[[], str],
    interval_s: float = 0.2,
) -> None:
    """Return as soon as ``condition()`` is true; fail the test after ``timeout_s``. ``what``
    says what was awaited (a callable is asked only then, to report the state reached)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            description = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout_s}s waiting until {description}")
        time.sleep(interval_s)
