"""`serve --workers 2` in front of the local Kafka: both workers serve, clients reach them
through the one shared bootstrap port, a killed worker is restarted, SIGTERM stops them all
cleanly, and a port in use stops the start with a clear message."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Producer

from deploy.launcher import ProxyProcess
from deploy.local import EnvInfo
from deploy.processes import port_open
from tests.support.kafka_io import read_all
from tests.support.ports import WORKERS
from tests.support.topics import new_topic
from tests.support.wait import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

HOST = "127.0.0.1"
PRODUCERS = 12
PARTITIONS = 16


def _produce_requests(admin_url: str) -> float:
    with urllib.request.urlopen(f"{admin_url}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    for line in text.splitlines():
        if line.startswith('dedup_proxy_requests_total{api="produce"}'):
            return float(line.rpartition(" ")[2])
    return 0.0


def _proxy(local_env: EnvInfo, log: Path, redis_key_prefix: str) -> ProxyProcess:
    return ProxyProcess(
        upstream=local_env.bootstrap,
        listen_port=WORKERS.listen,
        admin_port=WORKERS.admin,
        workers=2,
        extra_args=[
            "--broker-port-base",
            str(WORKERS.broker_base),
            "--instance-id",
            f"workers-{uuid.uuid4().hex[:6]}",
        ],
        env={
            "DEDUP_PROXY_REDIS": local_env.redis,
            "DEDUP_PROXY_REDIS_KEY_PREFIX": redis_key_prefix,
            "DEDUP_PROXY_DRAIN_TIMEOUT_S": "10",
        },
        log_path=log,
    )


@pytest.fixture
def workers(local_env: EnvInfo, tmp_path: Path, redis_key_prefix: str) -> Iterator[ProxyProcess]:
    process = _proxy(local_env, tmp_path / "proxy.log", redis_key_prefix)
    process.start()
    yield process
    process.stop()


def _pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            alive.append(pid)
    return alive


def test_two_workers_serve_one_bootstrap_port_and_stop_cleanly(
    workers: ProxyProcess, local_env: EnvInfo
) -> None:
    pids = workers.worker_pids()
    assert None not in pids and len(set(pids)) == 2
    assert workers.pid not in pids
    # Each worker has its own broker listener, 100 ports apart.
    assert port_open(HOST, WORKERS.broker_base) and port_open(HOST, WORKERS.broker_base + 100)

    # Producers through the shared bootstrap port: the kernel spreads their connections
    # over the workers, the workers share the partitions (each has one owner, and clients
    # are sent to it), and every record lands once.
    spread = new_topic(local_env.bootstrap, partitions=PARTITIONS)
    sent: list[bytes] = []
    for producer_index in range(PRODUCERS):
        producer = Producer({"bootstrap.servers": workers.bootstrap, "acks": "all"})
        for sequence in range(20):
            value = f"{producer_index}-{sequence}".encode()
            headers = {"dedup.producer": f"w-{producer_index}", "dedup.sequence": str(sequence)}
            producer.produce(spread, value, headers=headers, partition=sequence % PARTITIONS)
            sent.append(value)
        assert producer.flush(30) == 0
    written = [v for p in range(PARTITIONS) for v, _ in read_all(local_env.bootstrap, spread, p)]
    assert sorted(written) == sorted(sent)
    # Both workers own partitions, so both wrote (all on one: 2 ** -(PARTITIONS - 1)).
    produce_requests = [_produce_requests(url) for url in workers.worker_admin_urls()]
    assert all(count > 0 for count in produce_requests), produce_requests

    # SIGTERM to the supervisor: every worker drains and exits, and so does it, with 0.
    assert workers.stop() == 0
    assert _pids_alive([p for p in pids if p is not None]) == []
    assert not port_open(HOST, WORKERS.listen)


def test_a_killed_worker_is_restarted(workers: ProxyProcess) -> None:
    before = workers.worker_pids()
    victim = before[1]
    assert victim is not None
    os.kill(victim, signal.SIGKILL)

    def restarted() -> bool:
        now = workers.worker_pids()
        return now[0] == before[0] and now[1] not in (None, victim)

    wait_until(restarted, 20, lambda: f"worker 1 back with a new pid ({workers.worker_pids()})")
    workers.wait_healthy(20)
    log = workers.log_path.read_text() if workers.log_path else ""
    assert '"event": "worker died; restarting"' in log


def test_workers_die_with_a_killed_supervisor(
    local_env: EnvInfo, tmp_path: Path, redis_key_prefix: str
) -> None:
    process = _proxy(local_env, tmp_path / "proxy.log", redis_key_prefix).start()
    pids = [p for p in process.worker_pids() if p is not None]
    assert len(pids) == 2
    process.kill()  # SIGKILL: the workers get SIGTERM from the kernel and drain
    wait_until(lambda: not _pids_alive(pids), 20, "the workers are gone")
    wait_until(lambda: not port_open(HOST, WORKERS.listen), 10, "the bootstrap port is closed")


def test_a_port_in_use_stops_the_start_with_a_clear_message(local_env: EnvInfo) -> None:
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind((HOST, WORKERS.listen))
        holder.listen()
        started = time.monotonic()
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "dedup",
                "serve",
                "--workers",
                "2",
                "--upstream",
                local_env.bootstrap,
                "--listen",
                f"{HOST}:{WORKERS.listen}",
                "--admin",
                f"{HOST}:{WORKERS.admin}",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert result.returncode == 1
    assert f"{HOST}:{WORKERS.listen} (the bootstrap listener) is in use" in result.stderr
    assert time.monotonic() - started < 15
