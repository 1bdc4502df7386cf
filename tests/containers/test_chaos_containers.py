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
from deploy.chaos.report import summarize
from deploy.chaos.runner import RunPlan, run_plan
from deploy.chaos.scenarios import SCENARIOS, FaultSettings
from deploy.containers.engine import Engine

pytestmark = [pytest.mark.docker, pytest.mark.integration, pytest.mark.timeout(600)]

MESSAGES = 20_000
FAIL_AT = 12_000  # above the 10,000 in flight: the failure meets acknowledged writes
FAULT = FaultSettings(fault_s=3.0)


@pytest.fixture(scope="module")
def topology(engine: Engine) -> Iterator[ContainerTopology]:
    del engine  # started, images built and pointed at by the session fixture
    chaos = ContainerTopology()
    try:
        chaos.up()
        yield chaos
    finally:
        chaos.down()


def _describe(outcomes: list[RunResult]) -> str:
    return "; ".join(
        f"dedup={o.dedup_enabled} dups={o.msgs_with_dups} lost={o.not_received} "
        f"jumps={len(o.jumps)} sent={o.send_count} received={o.received}"
        for o in outcomes
    )


@pytest.mark.parametrize("scenario", ["kill-proxy", "kill-tcp"])
def test_scenario_control_fails_and_dedup_is_clean(
    topology: ContainerTopology, tmp_path: Path, scenario: str
) -> None:
    plan = RunPlan(SCENARIOS[scenario], 1, MESSAGES, FAIL_AT, (False, True), fault=FAULT)
    outcomes = run_plan(plan, topology, tmp_path, lambda *_: None)
    control = [o for o in outcomes if not o.dedup_enabled]
    dedup = [o for o in outcomes if o.dedup_enabled]
    summary = summarize(tmp_path / f"test-{scenario}_dedup_output.csv")
    assert summary.dedup_on_clean, _describe(outcomes)
    assert all(o.msgs_with_dups == 0 for o in dedup), _describe(dedup)
    assert all(o.not_received == 0 and o.received == MESSAGES for o in dedup), _describe(dedup)
    assert any(o.msgs_with_dups > 0 for o in control), (
        f"the control of {scenario} shows no duplicate: the scenario stresses nothing; "
        + _describe(control)
    )
