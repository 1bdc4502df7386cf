"""The chaos scenarios through the containers backend: the same plans, producer,
classifier and CSV as tests/integration/test_chaos.py, with the three Kafka nodes, Redis,
Toxiproxy and the proxy in containers of the project's images (`docker kill` for the
proxy, Toxiproxy's API for the cuts). Scaled down further: a control run must still show
duplicates, a dedup run must be exact."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.chaos.classify import RunResult
from deploy.chaos.containers import ContainerTopology
from deploy.chaos.report import describe_runs, summarize
from deploy.chaos.runner import RunPlan, run_plan
from deploy.chaos.scenarios import SCENARIOS, FaultSettings
from deploy.containers.engine import Engine

pytestmark = [pytest.mark.docker, pytest.mark.integration, pytest.mark.timeout(600)]

MESSAGES = 20_000
FAIL_AT = 12_000  # above the 10,000 in flight: the failure meets acknowledged writes
FAULT = FaultSettings(fault_s=3.0)
CONTROL_TRIES = 3


@pytest.fixture(scope="module")
def topology(engine: Engine) -> Iterator[ContainerTopology]:
    del engine  # started, images built and pointed at by the session fixture
    chaos = ContainerTopology()
    try:
        chaos.up()
        yield chaos
    finally:
        chaos.down()


@pytest.mark.parametrize("scenario", ["kill-proxy", "kill-tcp"])
def test_scenario_control_fails_and_dedup_is_clean(
    topology: ContainerTopology, tmp_path: Path, scenario: str
) -> None:
    # A control run can miss: a kill that lands while nothing acknowledged is in flight
    # re-sends nothing (1 of 3 kill-proxy controls at 100,000 messages). Up to three
    # tries, so that the test fails only when the scenario stresses nothing.
    control: list[RunResult] = []
    for attempt in range(CONTROL_TRIES):
        plan = RunPlan(SCENARIOS[scenario], 1, MESSAGES, FAIL_AT, (False,), fault=FAULT)
        control += run_plan(plan, topology, tmp_path / f"control-{attempt}", lambda *_: None)
        if any(o.msgs_with_dups > 0 for o in control):
            break
    assert any(o.msgs_with_dups > 0 for o in control), (
        f"the control of {scenario} shows no duplicate: the scenario stresses nothing; "
        + describe_runs(control)
    )
    plan = RunPlan(SCENARIOS[scenario], 1, MESSAGES, FAIL_AT, (True,), fault=FAULT)
    dedup = run_plan(plan, topology, tmp_path / "dedup", lambda *_: None)
    summary = summarize(tmp_path / "dedup" / f"test-{scenario}_dedup_output.csv")
    assert summary.dedup_on_clean, describe_runs(dedup)
    assert all(o.msgs_with_dups == 0 for o in dedup), describe_runs(dedup)
    assert all(o.not_received == 0 and o.received == MESSAGES for o in dedup), describe_runs(dedup)
