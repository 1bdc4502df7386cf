"""`benchmarks.engine_path` runs the produce path it measures: every request written."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import engine_path

pytestmark = pytest.mark.unit


def test_the_benchmark_writes_every_request_and_measures_each_round() -> None:
    figures = engine_path._measure(requests=200, rounds=2)  # raises if one is not written
    assert len(figures) == 2
    assert all(wall > 0 and cpu > 0 for wall, cpu in figures)


def test_a_checkout_is_measured_in_a_process_of_its_own() -> None:
    wall, cpu = engine_path._run_checkout(Path(__file__).parents[2], 200)
    assert wall > 0 and cpu > 0
