"""The Spark job on a standalone Spark cluster (a master and two workers, each a process of
its own, `deploy.spark_cluster`) while a worker is lost: exactly once still holds.

Producers write through the dedup proxy, and restart and re-send a range of what they sent;
the same load goes around the proxy, straight into Kafka, into a control topic. One job
reads both topics on the cluster, continuously, into one sink. A worker is SIGKILLed with
its executor while a micro-batch runs and records still arrive; the job goes on with the
other worker's executor alone, then with a new executor on the restarted worker. At the end
`spark verify --topic <deduplicated topic> --expect-rows N` (itself run on the cluster)
finds every record exactly once, while the control topic holds every re-sent record
twice: that is how this test can fail, were the proxy or the sink to let a copy through.

Sink and checkpoint are plain local paths: every process of the cluster runs on this host.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy import paths
from deploy.demo.processes import SparkJob
from deploy.launcher import ProxyProcess
from deploy.local import EnvInfo
from deploy.spark_cluster import ClusterShape, SparkCluster, SparkClusterError
from tests.support.kafka_io import end_offset
from tests.support.load import SequencedProducer
from tests.support.ports import SPARK_CLUSTER
from tests.support.spark_checkpoint import (
    committed_batches,
    committed_offsets,
    wait_for_commits,
)
from tests.support.topics import new_topic
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration

PRODUCERS = ("orders-a", "orders-b")
PER_PRODUCER = 3000
FIRST_RUN = 2400  # 0..2399 before a producer's restart
FIRST_RATE = 60  # each producer's records a second in the first run
# The first run's last records trickle, one a second, until the kill: records still arrive
# then, however long the job's first batches took (53 s on a busy 2-core box, when a load
# timed to end after 40 s had ended; with no new records, no task ran to be lost).
HELD_TAIL = 600
RESENT_FROM = 1200  # the restarted producer sends 1200..2999: 1200 again, then 600 new
PARTITIONS = 2
KAFKA_SOURCE_JAR = f"spark-sql-kafka-0-10_2.13-{paths.SPARK_VERSION}.jar"


@pytest.fixture(scope="module")
def spark_cluster() -> Iterator[SparkCluster]:
    # A fixed home: a cluster a killed session left behind is found and stopped.
    cluster = SparkCluster(paths.state_home().parent / "test-spark-cluster", SPARK_CLUSTER)
    cluster.down(purge=True)
    try:
        cluster.up(ClusterShape(workers=2, cores=1, memory="1g"))
    except (SparkClusterError, paths.MissingRuntimeError) as exc:
        pytest.fail(f"the Spark cluster cannot start: {exc}", pytrace=False)
    yield cluster
    cluster.down()  # the logs stay, for a look after a failure


def executor_dirs(cluster: SparkCluster, worker: int) -> set[Path]:
    """Every executor a worker ran (``work/<app>/<executor id>``)."""
    return {
        e for app in cluster.work_dir(worker).glob("app-*") for e in app.iterdir() if e.is_dir()
    }


# An executor's own log lines (Spark's Executor, INFO) for a task's start and end.
_RUNNING = re.compile(r"Running task (\d+)\.\d+ in stage (\d+)\.\d+ \(TID (\d+)\)")
_FINISHED = re.compile(r"Finished task \S+ in stage \S+ \(TID (\d+)\)")


def running_tasks(executor: Path) -> dict[int, tuple[int, int]]:
    """The tasks an executor started and did not finish: TID -> (stage, partition)."""
    log = (executor / "stderr").read_text(errors="replace")
    finished = {int(tid) for tid in _FINISHED.findall(log)}
    return {
        int(tid): (int(stage), int(index))
        for index, stage, tid in _RUNNING.findall(log)
        if int(tid) not in finished
    }


def ran_again(executor: Path, task: tuple[int, int], lost_tid: int) -> bool:
    """Whether the executor ran another attempt (a new TID) of a stage's partition."""
    log = (executor / "stderr").read_text(errors="replace")
    return any(
        (int(stage), int(index)) == task and int(tid) != lost_tid
        for index, stage, tid in _RUNNING.findall(log)
    )


# Keyed by sequence: a re-send goes to the partition of its first send, where the proxy
# (dedup is per partition) knows it. Unkeyed, a re-send may land on another partition and
# pass as new. With `released`, the last HELD_TAIL records trickle until it is set.
def start_load(
    bootstrap: str,
    topic: str,
    start: int,
    total: int,
    rate: int,
    released: threading.Event | None = None,
) -> list[SequencedProducer]:
    return [
        SequencedProducer(
            bootstrap,
            topic,
            name,
            total,
            start=start,
            per_second=rate,
            keyed=True,
            held_tail=HELD_TAIL if released is not None else 0,
            released=released,
        ).start()
        for name in PRODUCERS
    ]


def caught_up(checkpoint: Path, bootstrap: str, topics: list[str]) -> bool:
    """Whether the committed micro-batches reached the end of every partition."""
    offsets = committed_offsets(checkpoint)
    return all(
        offsets.get(topic, {}).get(p) == end_offset(bootstrap, topic, p)
        for topic in topics
        for p in range(PARTITIONS)
    )


def test_a_worker_killed_mid_stream_loses_and_repeats_nothing(
    spark_cluster: SparkCluster, dedup_proxy: ProxyProcess, local_env: EnvInfo, tmp_path: Path
) -> None:
    topic = new_topic(local_env.bootstrap, partitions=PARTITIONS)
    control = new_topic(local_env.bootstrap, partitions=PARTITIONS)
    sink, checkpoint = tmp_path / "sink", tmp_path / "checkpoint"
    job = SparkJob(
        [
            *("--master", spark_cluster.master_url),
            *("--executor-memory", "768m", "--executor-cores", "1"),
            *("--bootstrap", local_env.bootstrap, "--topic", f"{topic},{control}"),
            *("--output", str(sink), "--checkpoint", str(checkpoint)),
            *("--trigger", "continuous", "--interval-s", "1"),
        ],
        tmp_path / "spark.log",
        tmp_path / "ready",
    )
    job.start()
    try:
        job.wait_ready(180)
        killed = threading.Event()
        first = [
            *start_load(dedup_proxy.bootstrap, topic, 0, FIRST_RUN, FIRST_RATE, killed),
            *start_load(local_env.bootstrap, control, 0, FIRST_RUN, FIRST_RATE, killed),
        ]
        # Both workers run an executor of the job, and the driver shipped it the Kafka
        # source (spark.jars): no worker has it otherwise.
        wait_until(
            lambda: all(
                any((e / KAFKA_SOURCE_JAR).is_file() for e in executor_dirs(spark_cluster, w))
                for w in (0, 1)
            ),
            90,
            "an executor on each worker has fetched the Kafka source",
        )

        # Mid-stream: some batches committed, the producers still sending, and a task of
        # the running batch on the executor about to be lost.
        wait_for_commits(checkpoint, 3)
        (doomed,) = executor_dirs(spark_cluster, 0)
        wait_until(lambda: running_tasks(doomed), 60, "worker 0 runs a task", interval_s=0.01)
        assert spark_cluster.kill_worker(0)
        lost = running_tasks(doomed)
        commits_at_kill = committed_batches(checkpoint)
        rows_at_kill = sum(committed_offsets(checkpoint).get(topic, {}).values())
        assert not all(load.delivered == load.expected for load in first), "the load had ended"
        assert rows_at_kill < len(PRODUCERS) * FIRST_RUN
        killed.set()  # the held records follow at the pace

        # The other worker's executor alone carries the job on.
        wait_for_commits(checkpoint, commits_at_kill + 2, timeout_s=120)
        assert set(spark_cluster.alive_workers()) == {1}

        # A restarted worker gets a new executor of the job.
        before_restart = executor_dirs(spark_cluster, 0)
        spark_cluster.start_worker(0)
        wait_until(
            lambda: executor_dirs(spark_cluster, 0) - before_restart,
            60,
            "the restarted worker runs an executor of the job",
        )
        (new_executor,) = executor_dirs(spark_cluster, 0) - before_restart

        for load in first:
            load.join()
        # The producers restart and send again from an older position: re-sends, then new.
        restarted = [
            *start_load(dedup_proxy.bootstrap, topic, RESENT_FROM, PER_PRODUCER, rate=120),
            *start_load(local_env.bootstrap, control, RESENT_FROM, PER_PRODUCER, rate=120),
        ]
        for load in restarted:
            load.join()
        wait_until(
            lambda: caught_up(checkpoint, local_env.bootstrap, [topic, control]),
            120,
            "the job has committed everything in both topics",
            interval_s=0.5,
        )
        assert "Running task" in (new_executor / "stderr").read_text(), (
            "the restarted worker's executor ran no task"
        )
        # The tasks the kill interrupted ran again, on the other worker.
        (survivor,) = executor_dirs(spark_cluster, 1)
        assert lost and all(ran_again(survivor, task, tid) for tid, task in lost.items()), lost
        job.stop()
        assert job.wait(10) == 0
    finally:
        job.kill()

    # The job's own summary (the same computation as `spark verify`), per topic.
    summary = json.loads((tmp_path / "sink.json").read_text())
    per_producer = {(p["topic"], p["producer"]): p for p in summary["producers"]}
    resent = FIRST_RUN - RESENT_FROM
    for name in PRODUCERS:
        kept = per_producer[(topic, name)]
        assert (kept["rows"], kept["duplicates"], kept["gaps"]) == (PER_PRODUCER, 0, 0)
        around = per_producer[(control, name)]
        assert (around["rows"], around["duplicates"]) == (PER_PRODUCER + resent, resent)

    total = len(PRODUCERS) * PER_PRODUCER
    report = tmp_path / "verify.json"
    verify = subprocess.run(
        [
            *(sys.executable, "-m", "dedup", "spark", "verify", "--output", str(sink)),
            *("--topic", topic, "--expect-rows", str(total), "--json", str(report)),
            *("--master", spark_cluster.master_url, "--executor-memory", "768m"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr[-3000:]
    checked = json.loads(report.read_text())
    assert (checked["rows"], checked["distinct"], checked["duplicates"], checked["gaps"]) == (
        total,
        total,
        0,
        0,
    )
