"""A scaled-down pass of every chaos scenario: a control run (of up to three) must show the
failure it is meant to cause (duplicates or reordering), each dedup run must be clean.

The full experiment (the seed's 50 runs of 1,000,000 messages) is `dedup-proxy chaos run`;
this is the same code with small counts, on the chaos topology's own environment (three
brokers behind Toxiproxy), brought up once for the module.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from deploy.chaos.classify import RunResult
from deploy.chaos.producers import Client
from deploy.chaos.report import describe_runs, summarize
from deploy.chaos.runner import RunPlan, run_plan
from deploy.chaos.scenarios import SCENARIOS, FaultSettings
from deploy.chaos.topology import ChaosTopology

pytestmark = pytest.mark.integration

MESSAGES = 60_000
FAIL_AT = 25_000  # above the 10,000 in flight: the failure meets acknowledged writes
FAULT = FaultSettings(fault_s=4.0)
CONTROL_TRIES = 3


@pytest.fixture(scope="module")
def topology() -> Iterator[ChaosTopology]:
    # As the command: DEDUP_CHAOS_PORT_SHIFT moves every port when the planned ones are taken.
    chaos = ChaosTopology(int(os.environ.get("DEDUP_CHAOS_PORT_SHIFT", "0")))
    chaos.up()
    yield chaos
    chaos.down()


def _control_runs(
    scenario: str, topology: ChaosTopology, tmp_path: Path, failed: Callable[[RunResult], bool]
) -> list[RunResult]:
    """Dedup-off runs until one shows the failure, at most CONTROL_TRIES: a fault that
    meets nothing acknowledged in flight makes nothing re-sent, so one run can miss."""
    control: list[RunResult] = []
    for attempt in range(CONTROL_TRIES):
        plan = RunPlan(SCENARIOS[scenario], 1, MESSAGES, FAIL_AT, (False,), fault=FAULT)
        control += run_plan(plan, topology, tmp_path / f"control-{attempt}", lambda *_: None)
        if any(failed(o) for o in control):
            break
    return control


@pytest.mark.parametrize("scenario", [n for n, s in SCENARIOS.items() if s.instances == 1])
def test_scenario_control_fails_and_dedup_is_clean(
    topology: ChaosTopology, tmp_path: Path, scenario: str
) -> None:
    control = _control_runs(
        scenario, topology, tmp_path, lambda o: o.msgs_with_dups > 0 or bool(o.jumps)
    )
    assert any(o.msgs_with_dups > 0 or o.jumps for o in control), (
        f"the control of {scenario} shows no failure: the scenario stresses nothing; "
        + describe_runs(control)
    )
    plan = RunPlan(SCENARIOS[scenario], 1, MESSAGES, FAIL_AT, (True,), fault=FAULT)
    dedup = run_plan(plan, topology, tmp_path / "dedup", lambda *_: None)
    summary = summarize(tmp_path / "dedup" / f"test-{scenario}_dedup_output.csv")
    assert summary.dedup_on_clean, describe_runs(dedup)
    assert all(o.not_received == 0 and o.received == MESSAGES for o in dedup), describe_runs(dedup)
    assert_no_report_names_a_wrong_offset(control + dedup)


def test_kill_proxy_multi_control_duplicates_and_dedup_is_clean(
    topology: ChaosTopology, tmp_path: Path
) -> None:
    """Three instances in a group, the partition's owner SIGKILLed and restarted, control
    runs until one duplicates (1 of 3 missed at 60,000 messages); then two dedup runs."""
    control = _control_runs("kill-proxy-multi", topology, tmp_path, lambda o: o.msgs_with_dups > 0)
    assert any(o.msgs_with_dups > 0 for o in control), (
        "the control of kill-proxy-multi shows no duplicate: the scenario stresses nothing; "
        + describe_runs(control)
    )
    scenario = SCENARIOS["kill-proxy-multi"]
    plan = RunPlan(scenario, 2, MESSAGES, FAIL_AT, (True,), fault=FAULT)
    dedup = run_plan(plan, topology, tmp_path / "dedup", lambda *_: None)
    summary = summarize(tmp_path / "dedup" / "test-kill-proxy-multi_dedup_output.csv")
    assert summary.dedup_on_clean, describe_runs(dedup)
    assert all(o.clean and o.received == MESSAGES for o in dedup), describe_runs(dedup)
    assert_no_report_names_a_wrong_offset(control + dedup)


@pytest.mark.parametrize("client", ["confluent-implicit", "java-implicit"])
def test_implicit_identity_clients_through_kill_tcp(
    topology: ChaosTopology, tmp_path: Path, client: Client
) -> None:
    """librdkafka's and Kafka's own Java idempotent producer, no identity headers: the
    proxy keys their records by producer id and sequence."""
    plan = RunPlan(
        SCENARIOS["kill-tcp"], 1, MESSAGES, FAIL_AT, (False, True), client=client, fault=FAULT
    )
    outcomes = run_plan(plan, topology, tmp_path, lambda *_: None)
    dedup = [o for o in outcomes if o.dedup_enabled]
    assert all(o.clean and o.received == MESSAGES for o in dedup), describe_runs(outcomes)
    assert any(not o.clean for o in outcomes if not o.dedup_enabled), describe_runs(outcomes)
    assert_no_report_names_a_wrong_offset(outcomes)


def test_chaos_command_writes_the_seed_csv_and_a_plot(
    topology: ChaosTopology, tmp_path: Path
) -> None:
    """The command line end to end (on the environment the module brought up); the run's
    topic is deleted once read back."""
    before = _chaos_topics(topology)
    done = subprocess.run(
        [
            *(sys.executable, "-m", "dedup", "chaos", "run", "--scenario", "kill-proxy"),
            *("--runs", "1", "--messages", "20000", "--fail-at", "12000", "--dedup", "on"),
            *("--results", str(tmp_path), "--keep-env"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    csv_text = (tmp_path / "kill-proxy" / "test-kill-proxy_dedup_output.csv").read_text()
    assert csv_text.splitlines()[0] == (
        "DedupEnabled,TestRun,SendCount,AckCount,PosAckCount,NegAckCount,Received,"
        "NotReceived,ReceivedNoAck,MsgsWithDups,DJF,DJB,JF,JB"
    )
    assert csv_text.splitlines()[1] == "true,1,20000,20000,20000,0,20000,0,0,0,0,0,0,0"
    assert (tmp_path / "kill-proxy" / "test-kill-proxy.png").stat().st_size > 0
    offsets = (tmp_path / "kill-proxy" / "test-kill-proxy_reported_offsets.csv").read_text()
    header, row = offsets.splitlines()
    assert header == "DedupEnabled,TestRun,PosAckCount,OffsetRight,OffsetUnknown,OffsetWrong"
    assert row.startswith("true,1,20000,") and row.endswith(",0"), row  # nothing wrong
    left = _chaos_topics(topology) - before
    assert not left, f"the run left its topic behind: {sorted(left)}"


def assert_no_report_names_a_wrong_offset(outcomes: list[RunResult]) -> None:
    """Each positive delivery report names its record's offset, or none (-1): never
    another record's, with dedup on or off."""
    assert all(o.reported_offsets is not None for o in outcomes)
    wrong = [o for o in outcomes if o.reported_offsets and o.reported_offsets.wrong]
    assert not wrong, describe_runs(outcomes)


def _chaos_topics(topology: ChaosTopology) -> set[str]:
    admin = AdminClient({"bootstrap.servers": topology.kafka_bootstrap})
    return {name for name in admin.list_topics(timeout=30).topics if name.startswith("chaos-")}
