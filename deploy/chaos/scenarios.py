"""The named failures, each injected once per run when the producer reaches ``fail_at``.

A failure alone does not duplicate anything: duplicates come from the producer re-sending
what was in flight when the failure hit. So every scenario makes the producer re-send:
the ones that break connections do it themselves; Redis losing its state is combined with
cutting the client connections in the same moment (the retries then meet the lost state,
which is what the scenario tests). As the seed slowed its Kafka brokers by 20 ms to raise
the number of messages in flight at the failure, every run adds ``latency_ms`` (20) to the
responses from the brokers; without it a leader's death almost never leaves a replicated
but unacknowledged batch behind, and the control of ``kill-leader`` shows nothing.

- ``kill-tcp``: every connection cut, repeatedly (once a second) for ``fault_s`` (the
  seed's tcpkill for 10 s): client to proxy and proxy to Kafka.
- ``kill-leader``: SIGKILL of the partition's leader, its connections dropped at once as
  when its host dies; it is restarted after ``fault_s``.
- ``kill-proxy``: SIGKILL of the proxy, restarted half a second later.
- ``kill-proxy-multi``: three proxy instances in one group (one Redis key prefix, short
  leases: `deploy.chaos.topology.MULTI_LEASE_SETTINGS`), the producer bootstrapping
  through all three; SIGKILL of the instance that owns the partition (its lease holder,
  from ``GET /v1/ownership``; with dedup off, the instance the producer writes through),
  restarted half a second later. Local processes only.
- ``redis-flush``: FLUSHDB, and the client connections cut for ``fault_s``.
- ``redis-restart``: Redis killed and restarted empty, and the client connections cut.
- ``slow-network``: ``slow_latency_ms`` (100, the seed's figure for Pulsar) on every hop
  for the whole run, and every connection cut for ``fault_s`` at the failure point.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog
from confluent_kafka.admin import AdminClient

from deploy.chaos.topology import MULTI_INSTANCES, Topology, broker_link
from deploy.toxiproxy import BackgroundCuts

log = structlog.get_logger(__name__)

CUT_EVERY_S: Final = 1.0


@dataclass(frozen=True)
class FaultSettings:
    fault_s: float = 10.0
    latency_ms: int = 20  # on the brokers' responses, every scenario
    slow_latency_ms: int = 100  # on every hop, slow-network


@dataclass(frozen=True)
class Scenario:
    """``inject`` breaks something at once (it runs on the producer's thread, so it must
    be quick); ``heal`` runs beside the producer and returns when the failure is over."""

    name: str
    description: str
    inject: Callable[[Topology, str, FaultSettings], None]
    heal: Callable[[Topology, FaultSettings, Path], None]
    before_run: Callable[[Topology, str, FaultSettings], None] = lambda topo, _topic, settings: (
        _slow_brokers(topo, settings)
    )
    after_run: Callable[[Topology], None] = lambda topology: _clear_latency(topology)
    instances: int = 1  # proxy instances in one group
    backends: tuple[str, ...] = ("local", "containers")  # where the scenario can run


class _Cuts:
    """Connections cut in the background from `inject` until `heal` has waited them out."""

    running: BackgroundCuts | None = None

    @classmethod
    def start(cls, topology: Topology, links: list[str], settings: FaultSettings) -> None:
        cls.running = topology.toxiproxy.cut_in_background(links, settings.fault_s, CUT_EVERY_S)

    @classmethod
    def wait(cls, _topology: Topology, settings: FaultSettings, _logs: Path) -> None:
        if cls.running is not None:
            cls.running.wait(settings.fault_s + 30)
            cls.running = None


def _cut_everything(topology: Topology, _topic: str, settings: FaultSettings) -> None:
    _Cuts.start(topology, [*topology.client_links, *topology.broker_links], settings)


def _cut_clients(topology: Topology, settings: FaultSettings) -> None:
    _Cuts.start(topology, topology.client_links, settings)


_leader: dict[str, int] = {}  # topic -> its leader, looked up before the run


def _find_leader(topology: Topology, topic: str, settings: FaultSettings) -> None:
    _slow_brokers(topology, settings)
    admin = AdminClient({"bootstrap.servers": topology.kafka_bootstrap})
    _leader[topic] = admin.list_topics(topic, timeout=30).topics[topic].partitions[0].leader


def _kill_leader(topology: Topology, topic: str, _settings: FaultSettings) -> None:
    leader = _leader["killed"] = _leader.pop(topic)
    # As when its host dies: the answers it had on the wire (held back by the latency)
    # never arrive, which is what leaves written but unacknowledged batches behind.
    topology.toxiproxy.cut(broker_link(leader))
    topology.kill_broker(leader)


def _restart_leader(topology: Topology, settings: FaultSettings, _logs: Path) -> None:
    time.sleep(settings.fault_s)
    topology.start_broker(_leader.pop("killed"))


def _kill_and_restart_proxy(topology: Topology, _topic: str, _settings: FaultSettings) -> None:
    # Restarted here, on the runner's own thread: the proxy process gets SIGTERM when the
    # thread that started it ends (PR_SET_PDEATHSIG follows the thread, not the process).
    topology.kill_proxy()
    time.sleep(0.5)
    topology.restart_proxy(topology.log_dir / f"proxy-restarted-{time.time_ns()}.log")


def _kill_and_restart_owner(topology: Topology, topic: str, _settings: FaultSettings) -> None:
    index = topology.kill_owner(topic, 0)
    time.sleep(0.5)
    topology.restart_instance(
        index, topology.log_dir / f"proxy-inst{index}-restarted-{time.time_ns()}.log"
    )


def _nothing_to_heal(_topology: Topology, _settings: FaultSettings, _logs: Path) -> None:
    return


def _redis_flush(topology: Topology, _topic: str, settings: FaultSettings) -> None:
    _cut_clients(topology, settings)  # first: the cuts must meet the writes in flight
    topology.flush_redis()


def _redis_restart(topology: Topology, _topic: str, settings: FaultSettings) -> None:
    _cut_clients(topology, settings)
    topology.restart_redis_empty()


def _slow_brokers(topology: Topology, settings: FaultSettings) -> None:
    for link in topology.broker_links:
        topology.toxiproxy.latency(link, settings.latency_ms)


def _slow_everything(topology: Topology, _topic: str, settings: FaultSettings) -> None:
    for link in [*topology.client_links, *topology.broker_links]:
        topology.toxiproxy.latency(link, settings.slow_latency_ms)


def _clear_latency(topology: Topology) -> None:
    for link in [*topology.client_links, *topology.broker_links]:
        topology.toxiproxy.clear(link)


SCENARIOS: Final = {
    s.name: s
    for s in (
        Scenario(
            "kill-tcp",
            "every connection cut repeatedly for the fault period",
            _cut_everything,
            _Cuts.wait,
        ),
        Scenario(
            "kill-leader",
            "the partition leader SIGKILLed, restarted after the fault period",
            _kill_leader,
            _restart_leader,
            before_run=_find_leader,
        ),
        Scenario(
            "kill-proxy",
            "the proxy SIGKILLed and restarted",
            _kill_and_restart_proxy,
            _nothing_to_heal,
        ),
        Scenario(
            "kill-proxy-multi",
            "three instances in a group; the partition's owner SIGKILLed and restarted",
            _kill_and_restart_owner,
            _nothing_to_heal,
            instances=MULTI_INSTANCES,
            backends=("local",),
        ),
        Scenario(
            "redis-flush",
            "Redis flushed while client connections are cut",
            _redis_flush,
            _Cuts.wait,
        ),
        Scenario(
            "redis-restart",
            "Redis restarted empty while client connections are cut",
            _redis_restart,
            _Cuts.wait,
        ),
        Scenario(
            "slow-network",
            "latency on every hop, every connection cut at the failure point",
            _cut_everything,
            _Cuts.wait,
            before_run=_slow_everything,
        ),
    )
}
