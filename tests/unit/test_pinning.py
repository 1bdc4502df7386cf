"""`kafka_tools --pin` and `--only`: how the CPUs are split, and that pinning reaches
every thread of a running process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks import kafka_tools
from benchmarks.passthrough import BenchmarkError
from benchmarks.pinning import Pinning, all_cpus, pin


def test_the_cpus_are_split_in_halves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3, 5})
    pinning = Pinning.split()
    assert pinning.kafka == {0, 1}
    assert pinning.proxies == {2, 3, 5}


def test_one_cpu_cannot_be_split(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {3})
    with pytest.raises(BenchmarkError, match="two CPUs"):
        Pinning.split()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two CPUs")
def test_pin_moves_every_thread_of_a_running_process() -> None:
    # A process with a second thread already running when it is pinned.
    script = (
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "print('ready', flush=True)\n"
        "time.sleep(30)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
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


def test_only_and_pin_options() -> None:
    settings = kafka_tools.parse_args(["--only", "consumer", "--pin"])
    assert settings.tools == (kafka_tools.CONSUMER,)
    assert settings.pin
    assert kafka_tools.parse_args([]).tools == (kafka_tools.PRODUCER, kafka_tools.CONSUMER)
    with pytest.raises(SystemExit):
        kafka_tools.parse_args(["--pin", "--bootstrap", "h:9092", "--redis", "redis://h"])
