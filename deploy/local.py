"""The local environment: a real Apache Kafka cluster (KRaft, 1 or 3 combined
broker+controller nodes) and a private Redis (one process, Sentinel-watched replicas, or a
Redis Cluster: `deploy.local_redis`), run as detached processes on loopback.

Everything lives under the state home (`$DEDUP_LOCAL_HOME`, else
`${XDG_STATE_HOME:-~/.local/state}/kafka-dedup-proxy/local`):

    state.json                   broker count, cluster id, ports
    kafka/node-<id>/             server.properties, data/, logs/server.log, process.log, kafka.pid
    redis/                       redis.conf, data/ (AOF), redis.log, process.log, redis.pid
    redis-sentinel/, redis-cluster/  the same per node of the other Redis topologies

The data is disposable: asking for a different cluster shape recreates the cluster.

Brokers may advertise other ports than they listen on (`Ports.advertised_kafka_base`), for
a fault-injecting proxy such as Toxiproxy in front of them: the addresses `info()` gives
are then the advertised ones, while the environment's own checks talk to the listen ports,
so `up` works whether or not anything serves the advertised ports yet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka.admin import AdminClient

from deploy import config, paths
from deploy.config import HOST, REDIS_TOPOLOGIES, Ports
from deploy.local_redis import LocalRedis, LocalRedisError
from deploy.processes import (
    ManagedProcess,
    home_lock,
    port_open,
    stop_all,
    tail,
    wait_port_closed,
)

DEFAULT_REDIS_TOPOLOGY = "single"

STATE_VERSION = 1
DEFAULT_START_TIMEOUT = 180.0
STOP_TIMEOUT = 30.0


class LocalEnvError(RuntimeError):
    """The local environment could not be brought to the requested state."""


def java_tool_command(main_class: str, *args: str) -> list[str]:
    """The command line running one of Kafka's Java tools on the cached classpath, e.g.
    `java_tool_command("org.apache.kafka.tools.VerifiableProducer", "--topic", "t", ...)`.
    Tool logs go to stderr (WARN and up), leaving stdout to the tool's own output."""
    return config.java_command(
        paths.java_executable(),
        paths.kafka_classpath(),
        paths.TOOLS_LOG4J2_CONFIG,
        main_class,
        args,
    )


@dataclass(frozen=True)
class EnvInfo:
    """How to reach the running environment."""

    bootstrap: str
    brokers: dict[int, str]
    redis: str

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: {"bootstrap", "brokers" (node id as a string), "redis"}."""
        return {
            "bootstrap": self.bootstrap,
            "brokers": {str(node): address for node, address in sorted(self.brokers.items())},
            "redis": self.redis,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EnvInfo:
        return cls(
            bootstrap=str(data["bootstrap"]),
            brokers={int(node): str(addr) for node, addr in dict(data["brokers"]).items()},
            redis=str(data["redis"]),
        )


@dataclass(frozen=True)
class _State:
    brokers: int
    cluster_id: str
    kafka_port_base: int
    redis_port: int
    kafka_version: str = paths.KAFKA_VERSION
    # None: the brokers advertise the ports they listen on.
    kafka_advertised_port_base: int | None = None
    redis_topology: str = DEFAULT_REDIS_TOPOLOGY

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "brokers": self.brokers,
            "cluster_id": self.cluster_id,
            "kafka_port_base": self.kafka_port_base,
            "kafka_advertised_port_base": self.kafka_advertised_port_base,
            "redis_port": self.redis_port,
            "redis_topology": self.redis_topology,
            "kafka_version": self.kafka_version,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> _State:
        # Absent from states written before brokers could advertise other ports.
        advertised = data.get("kafka_advertised_port_base")
        return cls(
            brokers=int(data["brokers"]),
            cluster_id=str(data["cluster_id"]),
            kafka_port_base=int(data["kafka_port_base"]),
            redis_port=int(data["redis_port"]),
            kafka_version=str(data["kafka_version"]),
            kafka_advertised_port_base=None if advertised is None else int(advertised),
            # Absent from states written before Redis had topologies.
            redis_topology=str(data.get("redis_topology", DEFAULT_REDIS_TOPOLOGY)),
        )


def _quiet_logger() -> logging.Logger:
    # librdkafka logs every refused connection while a broker starts; those are expected.
    logger = logging.getLogger("deploy.local.librdkafka")
    logger.propagate = False
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())
    return logger


class LocalEnvironment:
    """Manages the local Kafka cluster and Redis. Every public method takes a file lock
    on the state home, so concurrent callers (two terminals, test workers) serialize."""

    def __init__(self, home: Path | None = None, ports: Ports | None = None) -> None:
        self.home = home if home is not None else paths.state_home()
        self.ports = ports if ports is not None else Ports.from_env()

    # --- layout -------------------------------------------------------------------------

    @property
    def state_file(self) -> Path:
        return self.home / "state.json"

    def node_dir(self, node_id: int) -> Path:
        return self.home / "kafka" / f"node-{node_id}"

    @property
    def redis_dir(self) -> Path:
        return self.home / "redis"

    def _node_process(self, node_id: int) -> ManagedProcess:
        node = self.node_dir(node_id)
        return ManagedProcess(
            name=f"kafka node {node_id}",
            pid_file=node / "kafka.pid",
            log_file=node / "process.log",
            marker=str(node / "server.properties"),
        )

    def _redis(self, state: _State) -> LocalRedis:
        return LocalRedis(self.home, state.redis_port, state.redis_topology)

    def _every_redis_process(self) -> list[ManagedProcess]:
        """The Redis processes of every topology (whichever ran last)."""
        return [
            proc
            for topology in REDIS_TOPOLOGIES
            for proc in LocalRedis(self.home, self.ports.redis, topology).processes()
        ]

    # --- state --------------------------------------------------------------------------

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        return home_lock(self.home)

    def _load_state(self) -> _State | None:
        try:
            data = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
            return None
        try:
            return _State.from_dict(data)
        except (KeyError, TypeError, ValueError):
            return None

    def _save_state(self, state: _State) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state.to_dict(), indent=2) + "\n")
        tmp.replace(self.state_file)

    def _require_state(self) -> _State:
        state = self._load_state()
        if state is None:
            raise LocalEnvError(f"no local environment in {self.home}: run `up` first")
        return state

    def _recorded_node_ids(self) -> list[int]:
        """Node ids with a directory, whatever state.json says (it may be lost or stale)."""
        ids: list[int] = []
        for node in (self.home / "kafka").glob("node-*"):
            with contextlib.suppress(ValueError):
                ids.append(int(node.name.removeprefix("node-")))
        return sorted(ids)

    # --- info ---------------------------------------------------------------------------

    def _info(self, state: _State) -> EnvInfo:
        ports = _ports(state)
        brokers = {node: f"{HOST}:{ports.advertised(node)}" for node in range(state.brokers)}
        return EnvInfo(
            bootstrap=",".join(brokers.values()),
            brokers=brokers,
            redis=config.redis_url(state.redis_topology, state.redis_port),
        )

    def info(self) -> EnvInfo:
        """Addresses of the environment as last brought up (whether or not it runs now)."""
        return self._info(self._require_state())

    def status(self) -> dict[str, Any]:
        """Pids and listening state of every process; no Kafka or Redis requests. Takes no
        lock (state.json is replaced atomically), so it answers while an `up` is running."""
        state = self._load_state()
        result: dict[str, Any] = {"home": str(self.home), "created": state is not None}
        if state is None:
            return result
        info = self._info(state)
        ports = _ports(state)
        result.update(info.to_json())
        result["cluster_id"] = state.cluster_id
        result["kafka_version"] = state.kafka_version
        nodes: dict[str, Any] = {}
        for node, address in info.brokers.items():
            pid = self._node_process(node).running_pid()
            nodes[str(node)] = {
                "address": address,
                "listen": f"{HOST}:{ports.client(node)}",
                "pid": pid,
                "running": pid is not None,
                "listening": pid is not None and port_open(HOST, ports.client(node)),
                "log": str(self.node_dir(node) / "logs" / "server.log"),
            }
        result["nodes"] = nodes
        # redis_nodes (and redis_sentinels) by index; redis_process is node 0's.
        redis_status = self._redis(state).status()
        result.update(redis_status)
        first = dict(redis_status["redis_nodes"]["0"])
        del first["address"]
        result["redis_process"] = first
        return result

    # --- up / down ----------------------------------------------------------------------

    def up(
        self,
        brokers: int = 1,
        timeout: float = DEFAULT_START_TIMEOUT,
        redis: str = DEFAULT_REDIS_TOPOLOGY,
    ) -> EnvInfo:
        """Start whatever is not running and wait until Kafka reports all brokers in its
        metadata and Redis is ready (`LocalRedis.wait_ready`). A different broker count (or
        Kafka port base) than the recorded one tears the cluster down and creates a new one;
        different advertised Kafka ports or Redis port only restart the processes concerned.
        `redis` is the Redis topology (`config.REDIS_TOPOLOGIES`); another one than the
        recorded one (or another Redis port) stops the old one and starts the new one, a
        sentinel or cluster topology from empty data."""
        config.check_broker_count(brokers)
        config.check_redis_topology(redis)
        with self._locked():
            state = self._load_state()
            previous = state
            if (
                state is None
                or state.brokers != brokers
                or state.kafka_port_base != self.ports.kafka_base
                or state.kafka_version != paths.KAFKA_VERSION
                or not all(self._formatted(n) for n in range(brokers))
            ):
                state = self._create_cluster(brokers)
            else:
                state = self._adopt_ports(state)
            state = dataclasses.replace(state, redis_topology=redis)
            if previous is not None and (previous.redis_port, previous.redis_topology) != (
                state.redis_port,
                redis,
            ):
                stop_all(self._every_redis_process(), STOP_TIMEOUT)
                if redis != "single":  # its files name the old ports, or another topology's
                    self._redis(state).remove()
            self._save_state(state)
            nodes = list(range(state.brokers))
            self._start_nodes(state, [n for n in nodes if not self._node_process(n).is_running()])
            self._start_redis_processes(state)
            deadline = time.monotonic() + timeout
            self._wait_for_brokers(state, set(nodes), set(nodes), deadline)
            self._wait_for_redis(state, deadline)
            return self._info(state)

    def _adopt_ports(self, state: _State) -> _State:
        """Stop what must restart on new ports. Brokers keep their data: a restarted
        broker registers its new advertised listeners with the controller."""
        if state.redis_port != self.ports.redis:
            stop_all(self._redis(state).processes(), STOP_TIMEOUT)
        if _advertised_base(state) != self.ports.advertised_base:
            stop_all([self._node_process(n) for n in range(state.brokers)], STOP_TIMEOUT)
        return dataclasses.replace(
            state,
            redis_port=self.ports.redis,
            kafka_advertised_port_base=_recorded_advertised_base(self.ports),
        )

    def down(self, purge: bool = False) -> None:
        """Stop every process (SIGTERM, then SIGKILL after a grace period). With purge, also
        delete the state home: the next `up` starts from empty data."""
        with self._locked():
            procs = [self._node_process(n) for n in self._recorded_node_ids()]
            stop_all([*procs, *self._every_redis_process()], STOP_TIMEOUT)
            if purge:
                for child in self.home.iterdir():
                    if child.name != "lock":
                        _remove(child)

    # --- failure injection --------------------------------------------------------------

    def kill_broker(self, node_id: int) -> bool:
        """SIGKILL one Kafka node; whether it was running."""
        with self._locked():
            state = self._require_state()
            self._check_node(state, node_id)
            killed = self._node_process(node_id).kill()
            for port in _ports(state).node_ports(node_id):
                wait_port_closed(HOST, port, 10.0)
            return killed

    def start_broker(self, node_id: int, timeout: float = DEFAULT_START_TIMEOUT) -> None:
        """Start one Kafka node (if it is not running) and wait until it is in the metadata."""
        with self._locked():
            state = self._require_state()
            self._check_node(state, node_id)
            if not self._node_process(node_id).is_running():
                self._start_nodes(state, [node_id])
            # Every running node must see it, not just the node itself.
            running = {n for n in range(state.brokers) if self._node_process(n).is_running()}
            self._wait_for_brokers(
                state, running | {node_id}, {node_id}, time.monotonic() + timeout
            )

    @property
    def redis_topology(self) -> str:
        """The Redis topology as last brought up."""
        return self._require_state().redis_topology

    def redis_node(self, key: str | None = None) -> int:
        """The Redis data node serving writes now: the one node, the Sentinels' primary,
        or in a cluster the primary of `key`'s slot (`key` is required there)."""
        with self._locked():
            state = self._require_state()
            local = self._redis(state)
            try:
                return local.primary() if key is None else local.owner(key)
            except LocalRedisError as exc:
                raise LocalEnvError(str(exc)) from exc

    def kill_redis(self, node: int | None = None) -> bool:
        """SIGKILL Redis data node `node` (None: the primary; a cluster needs a node);
        whether it was running."""
        if node is None:
            node = self.redis_node()
        with self._locked():
            state = self._require_state()
            try:
                return self._redis(state).kill(node)
            except LocalRedisError as exc:
                raise LocalEnvError(str(exc)) from exc

    def start_redis(
        self, timeout: float = 60.0, empty: bool = False, node: int | None = None
    ) -> None:
        """Start Redis data node `node` (None: every Redis process that is not running)
        and wait until it is ready. ``empty``: a stopped node loses its data first (a
        replaced or wiped Redis, for fault tests; not in a cluster)."""
        with self._locked():
            state = self._require_state()
            local = self._redis(state)
            deadline = time.monotonic() + timeout
            try:
                if node is not None:
                    local.start_node(node, deadline, empty=empty)
                    return
                if empty:
                    if state.redis_topology == "cluster":
                        raise LocalRedisError("a cluster node cannot start empty")
                    for data_node in local.nodes():
                        if not data_node.process.is_running():
                            _remove(data_node.directory / "data")
                local.start()
                local.wait_ready(deadline)
            except LocalRedisError as exc:
                raise LocalEnvError(str(exc)) from exc

    # --- Kafka --------------------------------------------------------------------------

    @staticmethod
    def _check_node(state: _State, node_id: int) -> None:
        if not 0 <= node_id < state.brokers:
            raise LocalEnvError(f"no node {node_id}: the cluster has nodes 0..{state.brokers - 1}")

    def _create_cluster(self, brokers: int) -> _State:
        old = [self._node_process(n) for n in self._recorded_node_ids()]
        stop_all(old, STOP_TIMEOUT)
        _remove(self.home / "kafka")
        state = _State(
            brokers=brokers,
            cluster_id=config.random_cluster_id(),
            kafka_port_base=self.ports.kafka_base,
            redis_port=self.ports.redis,
            kafka_advertised_port_base=_recorded_advertised_base(self.ports),
        )
        for node in range(brokers):
            self._write_node_config(state, node)
        self._format_storage(state)
        return state

    def _formatted(self, node_id: int) -> bool:
        return (self.node_dir(node_id) / "data" / "meta.properties").is_file()

    def _write_node_config(self, state: _State, node_id: int) -> Path:
        node = self.node_dir(node_id)
        (node / "logs").mkdir(parents=True, exist_ok=True)
        props = config.server_properties(node_id, state.brokers, _ports(state), node / "data")
        path = node / "server.properties"
        header = f"Local Kafka node {node_id} of {state.brokers}, cluster {state.cluster_id}."
        path.write_text(config.render_properties(props, header))
        return path

    def _format_storage(self, state: _State) -> None:
        """kafka-storage format for every node, in parallel (each is a JVM start)."""
        java, classpath = paths.java_executable(), paths.kafka_classpath()
        running: list[tuple[int, subprocess.Popen[bytes]]] = []
        for node in range(state.brokers):
            props = self.node_dir(node) / "server.properties"
            argv = config.java_command(
                java,
                classpath,
                paths.TOOLS_LOG4J2_CONFIG,
                "kafka.tools.StorageTool",
                ("format", "-t", state.cluster_id, "-c", str(props)),
            )
            running.append(
                (node, subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
            )
        for node, proc in running:
            output, _ = proc.communicate(timeout=120)
            if proc.returncode != 0:
                text = output.decode(errors="replace")
                raise LocalEnvError(f"formatting the storage of node {node} failed:\n{text}")

    def _start_nodes(self, state: _State, node_ids: list[int]) -> None:
        java, classpath = paths.java_executable(), paths.kafka_classpath()
        ports = _ports(state)
        for node in node_ids:
            for port in ports.node_ports(node):
                # A short grace period: a node killed a moment ago may still be exiting.
                if not wait_port_closed(HOST, port, 5.0):
                    raise LocalEnvError(
                        f"port {port} of kafka node {node} is taken by a process this "
                        f"environment does not know (another Kafka? a stale one from a "
                        f"different DEDUP_LOCAL_HOME?); free it or set DEDUP_LOCAL_KAFKA_PORT"
                    )
        for node in node_ids:
            props = self._write_node_config(state, node)
            if not self._formatted(node):
                raise LocalEnvError(f"node {node} storage is not formatted: run `down --purge`")
            argv = config.kafka_jvm_command(
                java, classpath, paths.KAFKA_LOG4J2_CONFIG, self.node_dir(node) / "logs", props
            )
            self._node_process(node).start(argv, cwd=self.node_dir(node))

    def _failure(self, proc: ManagedProcess, what: str) -> LocalEnvError:
        log = tail(proc.log_file)
        hint = ""
        if "Address already in use" in log:
            # Ports inside the kernel's ephemeral range get taken by outgoing connections.
            hint = (
                "\nhint: a port of this node was taken; ports inside the ephemeral range "
                "(/proc/sys/net/ipv4/ip_local_port_range) can be, by any outgoing connection"
            )
        return LocalEnvError(f"{what}; last lines of {proc.log_file}:\n{log}{hint}")

    def _wait_for_brokers(
        self, state: _State, ask: set[int], must_list: set[int], deadline: float
    ) -> None:
        """Wait until every node in `ask` answers Metadata itself, listing all of
        `must_list`. Asking each node directly matters: right after a SIGKILL the others
        still list the dead node until its session times out, and a restarted node is
        listed by the others a moment after it lists itself. Nodes are asked on their
        listen ports, not the advertised ones, which may be served by a proxy that is
        not there yet (or is cutting connections on purpose)."""
        ready: set[int] = set()
        while True:
            for node in sorted(ask - ready):
                proc = self._node_process(node)
                if not proc.is_running():
                    raise self._failure(proc, f"kafka node {node} exited during start")
                if must_list <= _metadata_brokers(f"{HOST}:{_ports(state).client(node)}"):
                    ready.add(node)
            if ready == ask:
                return
            if time.monotonic() >= deadline:
                late = sorted(ask - ready)
                raise self._failure(
                    self._node_process(late[0]),
                    f"timed out waiting for kafka nodes {late} to list nodes "
                    f"{sorted(must_list)} in their metadata",
                )
            time.sleep(0.25)

    # --- Redis --------------------------------------------------------------------------

    def _start_redis_processes(self, state: _State) -> None:
        try:
            self._redis(state).start()
        except LocalRedisError as exc:
            raise LocalEnvError(str(exc)) from exc

    def _wait_for_redis(self, state: _State, deadline: float) -> None:
        try:
            self._redis(state).wait_ready(deadline)
        except LocalRedisError as exc:
            raise LocalEnvError(str(exc)) from exc


def _metadata_brokers(address: str) -> set[int]:
    """The broker ids in a Metadata answer from the node at address (empty if none)."""
    host, _, port = address.rpartition(":")
    if not port_open(host, int(port)):
        return set()
    # A fresh client each time: a reused one may send the request to another node.
    admin = AdminClient(
        {"bootstrap.servers": address, "socket.connection.setup.timeout.ms": 2000},
        logger=_quiet_logger(),
    )
    try:
        return set(admin.list_topics(timeout=2).brokers)
    except Exception:  # KafkaException while the node is still starting
        return set()


def _ports(state: _State) -> Ports:
    # The recorded ports, which are the ones the running processes use.
    return Ports(
        kafka_base=state.kafka_port_base,
        redis=state.redis_port,
        advertised_kafka_base=state.kafka_advertised_port_base,
    )


def _advertised_base(state: _State) -> int:
    return _ports(state).advertised_base


def _recorded_advertised_base(ports: Ports) -> int | None:
    """What state.json records: None while the brokers advertise their own ports, so
    the files of both kinds of environment compare equal when nothing differs."""
    return ports.advertised_base if ports.advertises_elsewhere else None


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
