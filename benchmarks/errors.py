"""The one error every benchmark reports as such: it could not run (not: slow)."""

from __future__ import annotations


class BenchmarkError(RuntimeError):
    """The benchmark could not run (not: the figures were bad)."""
