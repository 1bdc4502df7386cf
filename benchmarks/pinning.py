"""`--pin`: Kafka and the clients on one half of the CPUs, the proxies and Redis on the
other.

On a box of few cores every process shares every CPU: the CPU a proxy spends is taken from
the broker and the client, so its throughput ratio to direct mostly measures that share.
Pinned, Kafka and the clients have the same CPUs in every measurement, direct or through
a proxy, and the proxy (with Redis, its state) has CPUs of its own, as a sidecar on a host
with spare cores would. The ratio then shows what the proxy's path itself costs: its
latency, and its own CPU once that is saturated.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from benchmarks.errors import BenchmarkError


@dataclass(frozen=True)
class Pinning:
    kafka: frozenset[int]  # the broker(s), and the benchmark with the clients it starts
    proxies: frozenset[int]  # the proxies and Redis

    @classmethod
    def split(cls) -> Pinning:
        """The first half of this process's CPUs for Kafka and the clients, the rest for the
        proxies and Redis."""
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise BenchmarkError("--pin needs at least two CPUs")
        half = len(cpus) // 2
        return cls(frozenset(cpus[:half]), frozenset(cpus[half:]))

    def describe(self) -> dict[str, list[int]]:
        return {"kafka_and_clients": sorted(self.kafka), "proxies_and_redis": sorted(self.proxies)}


@contextlib.contextmanager
def pinned(proxy_pids: Iterable[int], say: Callable[[str], None]) -> Iterator[Pinning]:
    """For the block: the local environment's Kafka, and this process (so every client it
    starts from now on, tool or worker), on one half of the CPUs; its Redis and the proxies
    on the other. Afterwards all of them are back on every CPU this process had."""
    pinning = Pinning.split()
    everything = all_cpus()
    kafka, redis = local_environment_pids()
    here = [os.getpid()]
    try:
        pin([*kafka, *here], pinning.kafka)
        pin([*redis, *proxy_pids], pinning.proxies)
        say(
            f"pinned: Kafka and the clients on CPUs {sorted(pinning.kafka)}, "
            f"the proxies and Redis on CPUs {sorted(pinning.proxies)}"
        )
        yield pinning
    finally:
        with contextlib.suppress(BenchmarkError):  # one gone: never hide the run's own error
            pin([*kafka, *redis, *here], everything)


def pin(pids: Iterable[int], cpus: frozenset[int]) -> None:
    """Every thread of each process on `cpus` (threads started later inherit it)."""
    for pid in pids:
        try:
            threads = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
        except FileNotFoundError as exc:
            raise BenchmarkError(f"process {pid} to pin is gone") from exc
        for tid in threads:
            with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                os.sched_setaffinity(tid, cpus)


def local_environment_pids() -> tuple[list[int], list[int]]:
    """The running Kafka brokers' and Redis servers' pids of the local environment."""
    from deploy.local import LocalEnvironment

    status = LocalEnvironment().status()
    kafka = [n["pid"] for n in status.get("nodes", {}).values() if n.get("running")]
    redis = [n["pid"] for n in status.get("redis_nodes", {}).values() if n.get("running")]
    if not kafka or not redis:
        raise BenchmarkError("--pin found no running local Kafka or Redis to pin")
    return kafka, redis


def all_cpus() -> frozenset[int]:
    return frozenset(os.sched_getaffinity(0))


def add_pin_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pin",
        action="store_true",
        help="Kafka and the clients on one half of the CPUs, the proxies and Redis on the "
        "other (the local environment only; see benchmarks/pinning.py)",
    )


def check_pin_argument(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.pin and args.bootstrap:
        parser.error("--pin pins the local environment's processes: not with --bootstrap")
