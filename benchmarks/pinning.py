"""`--pin`: Kafka and the client tool on one half of the CPUs, the proxies and Redis on
the other.

On a box of few cores every process shares every CPU: the CPU a proxy spends is taken from
the broker and the client, so its throughput ratio to direct mostly measures that share.
Pinned, Kafka and the tool have the same CPUs in every measurement, direct or through a
proxy, and the proxy (with Redis, its state) has CPUs of its own, as a sidecar on a host
with spare cores would. The ratio then shows what the proxy's path itself costs: its
latency, and its own CPU once that is saturated.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass

from benchmarks.passthrough import BenchmarkError


@dataclass(frozen=True)
class Pinning:
    kafka: frozenset[int]  # the broker(s) and the client tool
    proxies: frozenset[int]  # the proxies and Redis

    @classmethod
    def split(cls) -> Pinning:
        """The first half of this process's CPUs for Kafka and the tool, the rest for the
        proxies and Redis."""
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise BenchmarkError("--pin needs at least two CPUs")
        half = len(cpus) // 2
        return cls(frozenset(cpus[:half]), frozenset(cpus[half:]))

    def describe(self) -> dict[str, list[int]]:
        return {"kafka_and_tool": sorted(self.kafka), "proxies_and_redis": sorted(self.proxies)}


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
