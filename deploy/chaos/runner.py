"""One chaos scenario, run N times with dedup off (the control) and N times with it on.

Per run: a fresh topic (one partition, replication factor 3), the producer sends
0..messages-1 through the proxy, the scenario's failure goes in when ``fail_at`` messages
have been sent, the producer waits for every acknowledgement (retrying for up to
``retry_for_s``), then the whole partition is read back from Kafka and classified
(`deploy.chaos.classify`); the row and the jump events are written at once
(`deploy.chaos.report`).
"""

from __future__ import annotations

import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import structlog
from confluent_kafka import Consumer, TopicPartition

from deploy.chaos.classify import RunResult, classify_run
from deploy.chaos.producers import Client, ProducerRun, produce
from deploy.chaos.report import ResultsWriter
from deploy.chaos.reported_offsets import NOT_IN_LOG, check_reported_offsets
from deploy.chaos.scenarios import FaultSettings, Scenario
from deploy.chaos.topology import BROKERS, Topology
from deploy.topics import create_topic, delete_topic

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class RunPlan:
    scenario: Scenario
    runs: int
    messages: int
    fail_at: int
    dedup: tuple[bool, ...]  # (False, True) for both
    client: Client = "confluent-explicit"
    fault: FaultSettings = field(default_factory=FaultSettings)
    retry_for_s: float = 300.0


Progress = Callable[[str, int, int], None]  # (what, done, total)


def run_plan(
    plan: RunPlan, topology: Topology, results: Path, progress: Progress
) -> list[RunResult]:
    """Every run of the plan, in order: all control runs, then all dedup runs."""
    writer = ResultsWriter(results, f"test-{plan.scenario.name}")
    outcomes = []
    for dedup in plan.dedup:
        topology.start_proxy(
            dedup,
            results / f"proxy-dedup-{'on' if dedup else 'off'}.log",
            instances=plan.scenario.instances,
        )
        try:
            for number in range(1, plan.runs + 1):
                outcome = _one_run(plan, topology, results, dedup, number, progress)
                writer.append(outcome)
                outcomes.append(outcome)
        finally:
            topology.stop_proxy()
    return outcomes


def _one_run(
    plan: RunPlan,
    topology: Topology,
    results: Path,
    dedup: bool,
    number: int,
    progress: Progress,
) -> RunResult:
    label = f"dedup {'on' if dedup else 'off'} run {number}/{plan.runs}"
    topic = _fresh_topic(topology.kafka_bootstrap)
    sending = ProducerRun(plan.messages)
    plan.scenario.before_run(topology, topic, plan.fault)
    healer = threading.Thread(
        target=plan.scenario.heal,
        args=(topology, plan.fault, results),
        name=f"heal-{plan.scenario.name}",
        daemon=True,
    )
    in_flight_at_fault: list[int] = []

    def on_sent(count: int) -> None:
        if count >= plan.fail_at and not in_flight_at_fault:
            in_flight_at_fault.append(count - sending.acked)
            plan.scenario.inject(topology, topic, plan.fault)
            healer.start()
        if count % 1000 == 0:
            progress(f"{label}: sending", count, plan.messages)

    try:
        produce(
            plan.client,
            topology.client_bootstrap,
            topic,
            sending,
            dedup=dedup,
            on_sent=on_sent,
            retry_for_s=plan.retry_for_s,
            work_dir=results,
        )
        if in_flight_at_fault:
            healer.join()
    finally:
        plan.scenario.after_run(topology)
    progress(f"{label}: reading back", 0, plan.messages)
    values, log_values = _read_back(topology.kafka_bootstrap, topic)
    outcome = classify_run(
        values, sending.acks, start=0, dedup_enabled=dedup, run=number, send_count=sending.sent
    )
    reported = check_reported_offsets(sending.offsets, sending.acks, log_values)
    outcome = replace(outcome, reported_offsets=reported)
    log.info(
        "chaos run done",
        scenario=plan.scenario.name,
        run=label,
        in_flight_at_fault=in_flight_at_fault[0] if in_flight_at_fault else None,
        producer_error=sending.error,
        **{k: v for k, v in outcome.row.items() if k not in ("DedupEnabled", "TestRun")},
        offsets_right=reported.right,
        offsets_unknown=reported.unknown,
        offsets_wrong=reported.wrong,
        wrong_examples=reported.examples or None,
    )
    _delete_run_topic(topology.kafka_bootstrap, topic)
    return outcome


def _delete_run_topic(bootstrap: str, topic: str) -> None:
    """The run's topic deleted once it was read back: a full-size invocation (100 runs of a
    million messages) would otherwise leave some 20 GB behind. A deletion that fails is
    said, not raised: the run's result stands."""
    try:
        delete_topic(bootstrap, topic)
    except Exception as exc:  # KafkaException, a timeout: the broker keeps the topic
        log.warning("could not delete the run's topic", topic=topic, error=str(exc))


def _fresh_topic(bootstrap: str) -> str:
    """One partition on every broker; a write needs two in sync (acks=all)."""
    return create_topic(
        bootstrap,
        f"chaos-{time.time_ns()}",
        replication_factor=BROKERS,
        config={"min.insync.replicas": "2"},
    )


def _read_back(bootstrap: str, topic: str) -> tuple[list[int], array[int]]:
    """Every record of partition 0 as the integer it carries: in log order, and by offset
    (`NOT_IN_LOG` where no record is)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "chaos-read-back",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": "read_uncommitted",
        }
    )
    try:
        partition = TopicPartition(topic, 0)
        _, end = consumer.get_watermark_offsets(partition, timeout=30)
        values: list[int] = []
        by_offset = array("q", [NOT_IN_LOG]) * end
        consumer.assign([TopicPartition(topic, 0, 0)])
        position = 0
        deadline = time.monotonic() + 300
        while position < end:
            if time.monotonic() > deadline:
                raise TimeoutError(f"read back of {topic} stopped at {position} of {end}")
            for message in consumer.consume(1000, 0.5):
                if message.error() is not None:
                    position = max(position, message.offset() or 0)
                    continue
                position = message.offset() or 0
                value = int(message.value() or b"-1")
                values.append(value)
                if position < end:
                    by_offset[position] = value
                position += 1
        return values, by_offset
    finally:
        consumer.close()
