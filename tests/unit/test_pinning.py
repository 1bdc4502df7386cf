"""`kafka_tools --pin` and `--only`: how the CPUs are split, and that pinning reaches
every thread of a running process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks import kafka_tools, passthrough, pinning, stall
from benchmarks.errors import BenchmarkError
from benchmarks.pinning import Pinning, all_cpus, pin, pinned


def test_the_cpus_are_split_in_halves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3, 5})
    pinning = Pinning.split()
    assert pinning.kafka == {0, 1}
    assert pinning.proxies == {2, 3, 5}


def test_one_cpu_cannot_be_split(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {3})
    with pytest.raises(BenchmarkError, match="two CPUs"):
        Pinning.split()


def _threaded_process() -> subprocess.Popen[str]:
    """A process with a second thread already running when it is pinned."""
    script = (
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "print('ready', flush=True)\n"
        "time.sleep(30)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    return child


def _cpus_of(pid: int) -> set[frozenset[int]]:
    return {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")}


two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two CPUs")


@two_cpus
def test_pin_moves_every_thread_of_a_running_process() -> None:
    child = _threaded_process()
    try:
        threads = [int(t) for t in os.listdir(f"/proc/{child.pid}/task")]
        assert len(threads) == 2
        one = frozenset({min(all_cpus())})
        pin([child.pid], one)
        assert all(os.sched_getaffinity(t) == one for t in threads)
        pin([child.pid], all_cpus())
        assert all(os.sched_getaffinity(t) == all_cpus() for t in threads)
    finally:
        child.kill()
        child.wait()


def test_pin_of_a_gone_process_is_an_error() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    time.sleep(0.05)
    with pytest.raises(BenchmarkError, match="gone"):
        pin([child.pid], all_cpus())


@two_cpus
def test_pinned_splits_kafka_and_clients_from_proxies_and_redis_then_undoes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kafka, redis, proxy = _threaded_process(), _threaded_process(), _threaded_process()
    monkeypatch.setattr(pinning, "local_environment_pids", lambda: ([kafka.pid], [redis.pid]))
    before = all_cpus()
    said: list[str] = []
    try:
        with pinned([proxy.pid], said.append) as split:
            assert _cpus_of(kafka.pid) == {split.kafka}
            assert _cpus_of(os.getpid()) == {split.kafka}  # clients started here inherit it
            assert _cpus_of(redis.pid) == _cpus_of(proxy.pid) == {split.proxies}
            assert not split.kafka & split.proxies
        assert _cpus_of(kafka.pid) == _cpus_of(redis.pid) == _cpus_of(os.getpid()) == {before}
        assert said and "pinned" in said[0]
    finally:
        os.sched_setaffinity(0, before)
        for child in (kafka, redis, proxy):
            child.kill()
            child.wait()


def test_only_and_pin_options() -> None:
    settings = kafka_tools.parse_args(["--only", "consumer", "--pin"])
    assert settings.tools == (kafka_tools.CONSUMER,)
    assert settings.pin
    assert kafka_tools.parse_args([]).tools == (kafka_tools.PRODUCER, kafka_tools.CONSUMER)
    assert passthrough.parse_args(["--pin"]).pin
    assert stall.parse_args(["--pin"]).pin
    for module in (kafka_tools, passthrough, stall):
        with pytest.raises(SystemExit):
            module.parse_args(["--pin", "--bootstrap", "h:9092", "--redis", "redis://h"])
