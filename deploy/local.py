"""The local environment: a real Apache Kafka cluster (KRaft, 1 or 3 combined
broker+controller nodes) and a private Redis (one process, Sentinel-watched replicas, or a
Redis Cluster: `deploy.local_redis`), run as detached processes on loopback.

Everything lives under the state home (`$DEDUP_LOCAL_HOME`, else
`${XDG_STATE_HOME:-~/.local/state}/kafka-dedup-proxy/local`):

    state.json                   broker count, cluster id, ports
    kafka/node-<id>/             server.properties, data/, logs/server.log, process.log, kafka.pid
    redis/                       redis.conf, data/ (AOF), redis.log, process.log, redis.pid
    proxies/proxy-<i>/           proxy.toml, process.log (its JSON log lines), proxy.pid
                                 (`up --proxies N`: dedup-proxy instances proxy-1..N)
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
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (
    AclBinding,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialUpsertion,
)

from deploy import config, paths
from deploy.config import DEFAULT_PROXY_PORT, HOST, REDIS_TOPOLOGIES, Ports, ProxyInstance
from deploy.local_redis import LocalRedis, LocalRedisError, RedisTls
from deploy.processes import (
    ManagedProcess,
    home_lock,
    port_open,
    stop_all,
    tail,
    wait_port_closed,
)
from deploy.tls import LocalTls

DEFAULT_REDIS_TOPOLOGY = "single"
SCRAM_ITERATIONS = 4096
SCRAM_USERS_TIMEOUT = 60.0
# Client-side failures of a request that a new attempt may not meet: the broker handle it
# waited on was dropped, the connection broke, or the answer was late.
_TRANSIENT_ADMIN_ERRORS = frozenset(
    {KafkaError._DESTROY_BROKER, KafkaError._TRANSPORT, KafkaError._TIMED_OUT}
)

STATE_VERSION = 1
DEFAULT_START_TIMEOUT = 180.0
STOP_TIMEOUT = 30.0
PROXY_START_TIMEOUT = 60.0


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
class ProxyInfo:
    """How to reach one proxy of the environment."""

    instance_id: str
    bootstrap: str
    admin: str  # admin URL (of its first worker)
    admins: tuple[str, ...]  # one admin URL per worker

    @classmethod
    def of(cls, proxy: ProxyInstance) -> ProxyInfo:
        return cls(proxy.instance_id, proxy.bootstrap, proxy.admin_url, tuple(proxy.admin_urls))

    def to_json(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "bootstrap": self.bootstrap,
            "admin": self.admin,
            "admins": list(self.admins),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProxyInfo:
        return cls(
            instance_id=str(data["instance_id"]),
            bootstrap=str(data["bootstrap"]),
            admin=str(data["admin"]),
            admins=tuple(str(url) for url in data.get("admins") or [data["admin"]]),
        )


@dataclass(frozen=True)
class EnvInfo:
    """How to reach the running environment."""

    bootstrap: str
    brokers: dict[int, str]
    redis: str
    proxies: tuple[ProxyInfo, ...] = ()  # `up --proxies N`: proxy-1..N in order
    tls_bootstrap: str = ""  # the brokers' TLS listeners (none with security sasl_ssl)
    sasl_ssl_bootstrap: str = ""  # their SASL_SSL listeners (users: `LocalTls.sasl_users`)
    tls_dir: str = ""  # the environment's certificates (`deploy.tls.LocalTls`)
    # "mixed": `bootstrap` is plaintext; "sasl_ssl": it is SASL_SSL, and nothing else is.
    security: str = "mixed"

    def kafka_config(
        self, user: str = "client", mechanism: str = "SCRAM-SHA-512"
    ) -> dict[str, str]:
        """librdkafka settings for `bootstrap`: none in the mixed mode; in the sasl_ssl mode
        TLS trusting the local CA and ``user``'s credentials for ``mechanism``."""
        if self.security != "sasl_ssl":
            return {}
        certs = LocalTls(Path(self.tls_dir))
        return _sasl_ssl_config(certs, mechanism, user, certs.sasl_users[user])

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: {"bootstrap", "brokers" (node id as a string), "redis"}, and
        "proxies" (a list of {"instance_id", "bootstrap", "admin", "admins"}) when any run."""
        data: dict[str, Any] = {
            "bootstrap": self.bootstrap,
            "brokers": {str(node): address for node, address in sorted(self.brokers.items())},
            "redis": self.redis,
        }
        if self.tls_dir:
            data |= {
                "tls_bootstrap": self.tls_bootstrap,
                "sasl_ssl_bootstrap": self.sasl_ssl_bootstrap,
                "tls_dir": self.tls_dir,
                "security": self.security,
            }
        if self.proxies:
            data["proxies"] = [proxy.to_json() for proxy in self.proxies]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EnvInfo:
        return cls(
            bootstrap=str(data["bootstrap"]),
            brokers={int(node): str(addr) for node, addr in dict(data["brokers"]).items()},
            redis=str(data["redis"]),
            proxies=tuple(ProxyInfo.from_json(p) for p in data.get("proxies") or []),
            tls_bootstrap=str(data.get("tls_bootstrap", "")),
            sasl_ssl_bootstrap=str(data.get("sasl_ssl_bootstrap", "")),
            tls_dir=str(data.get("tls_dir", "")),
            security=str(data.get("security", "mixed")),
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
    # `up --proxies N --placement P --workers W`; the bootstrap port of proxy-1.
    proxies: int = 0
    proxy_placement: str = "balanced"
    proxy_workers: int = 1
    proxy_port_base: int = DEFAULT_PROXY_PORT
    redis_topology: str = DEFAULT_REDIS_TOPOLOGY
    security: str = "mixed"  # `up --security`: `config.SECURITY_MODES`

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
            "proxies": self.proxies,
            "proxy_placement": self.proxy_placement,
            "proxy_workers": self.proxy_workers,
            "proxy_port_base": self.proxy_port_base,
            "security": self.security,
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
            # Absent from states written before the environment ran proxies.
            proxies=int(data.get("proxies", 0)),
            proxy_placement=str(data.get("proxy_placement", "balanced")),
            proxy_workers=int(data.get("proxy_workers", 1)),
            proxy_port_base=int(data.get("proxy_port_base", DEFAULT_PROXY_PORT)),
            # Absent from states written before Redis had topologies.
            redis_topology=str(data.get("redis_topology", DEFAULT_REDIS_TOPOLOGY)),
            # Absent from states written before the secured-only mode.
            security=str(data.get("security", "mixed")),
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

    @property
    def tls(self) -> LocalTls:
        """The environment's certificates (the brokers' TLS listeners use them)."""
        return LocalTls(self.home / "tls")

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
        tls = None
        if state.security == "sasl_ssl":
            certs = self.tls.ensure()
            tls = RedisTls.of(certs, certs.redis_password)
        return LocalRedis(self.home, state.redis_port, state.redis_topology, tls)

    def _kafka_config(self, state: _State) -> dict[str, str]:
        """librdkafka settings of the environment's own requests (metadata, SCRAM users,
        ACLs): in the sasl_ssl mode as the brokers' own user over PLAIN, a super user, whose
        users exist before the SCRAM ones are made; none in the mixed mode."""
        if state.security != "sasl_ssl":
            return {}
        certs = self.tls.ensure()
        return _sasl_ssl_config(certs, "PLAIN", config.BROKER_USER, certs.keystore_password)

    def _admin(self, state: _State) -> AdminClient:
        """An admin client of the environment's own requests, on the first broker."""
        return AdminClient(
            {"bootstrap.servers": f"{HOST}:{_ports(state).client(0)}", **self._kafka_config(state)},
            logger=_quiet_logger(),
        )

    def _every_redis_process(self) -> list[ManagedProcess]:
        """The Redis processes of every topology (whichever ran last)."""
        return [
            proc
            for topology in REDIS_TOPOLOGIES
            for proc in LocalRedis(self.home, self.ports.redis, topology).processes()
        ]

    def proxy_dir(self, index: int) -> Path:
        return self.home / "proxies" / f"proxy-{index}"

    def _proxy_process(self, index: int) -> ManagedProcess:
        proxy = self.proxy_dir(index)
        return ManagedProcess(
            name=f"proxy-{index}",
            pid_file=proxy / "proxy.pid",
            log_file=proxy / "process.log",
            marker=str(proxy / "proxy.toml"),
        )

    def _recorded_proxy_indexes(self) -> list[int]:
        indexes: list[int] = []
        for proxy in (self.home / "proxies").glob("proxy-*"):
            with contextlib.suppress(ValueError):
                indexes.append(int(proxy.name.removeprefix("proxy-")))
        return sorted(indexes)

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
        bootstrap = ",".join(brokers.values())
        secured_only = state.security == "sasl_ssl"
        return EnvInfo(
            bootstrap=bootstrap,
            tls_bootstrap=""
            if secured_only
            else ",".join(f"{HOST}:{ports.tls(n)}" for n in range(state.brokers)),
            sasl_ssl_bootstrap=bootstrap
            if secured_only
            else ",".join(f"{HOST}:{ports.sasl_ssl(n)}" for n in range(state.brokers)),
            tls_dir=str(self.tls.directory),
            security=state.security,
            brokers=brokers,
            redis=self._redis(state).url,
            proxies=tuple(ProxyInfo.of(proxy) for proxy in _proxy_plan(state)),
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
        proxies: dict[str, Any] = {}
        for proxy in _proxy_plan(state):
            pid = self._proxy_process(proxy.index).running_pid()
            proxies[str(proxy.index)] = {
                **ProxyInfo.of(proxy).to_json(),
                "workers": proxy.workers,
                "placement": proxy.placement,
                "local_broker_id": proxy.local_broker_id,
                "pid": pid,
                "running": pid is not None,
                "listening": pid is not None and port_open(HOST, proxy.listen),
                "log": str(self._proxy_process(proxy.index).log_file),
            }
        result["proxy_processes"] = proxies
        return result

    # --- up / down ----------------------------------------------------------------------

    def up(
        self,
        brokers: int = 1,
        timeout: float = DEFAULT_START_TIMEOUT,
        redis: str = DEFAULT_REDIS_TOPOLOGY,
        proxies: int | None = None,
        placement: str | None = None,
        workers: int | None = None,
        security: str = "mixed",
    ) -> EnvInfo:
        """Start whatever is not running and wait until Kafka reports all brokers in its
        metadata and Redis is ready (`LocalRedis.wait_ready`). A different broker count (or
        Kafka port base) than the recorded one tears the cluster down and creates a new one;
        different advertised Kafka ports or Redis port only restart the processes concerned.
        `redis` is the Redis topology (`config.REDIS_TOPOLOGIES`); another one than the
        recorded one (or another Redis port) stops the old one and starts the new one, a
        sentinel or cluster topology from empty data.

        ``proxies``: also run that many proxies (proxy-1..N, `config.plan_proxies`) in
        front of them, with ``placement`` and ``workers`` each, and wait until each is
        healthy; 0 stops them. None (and None for the other two) keeps what was recorded.

        ``security``: "mixed" (plaintext, TLS and SASL_SSL listeners side by side) or
        "sasl_ssl" (SASL_SSL listeners only, replication included; Redis over TLS with
        client certificates and a password; the proxies with TLS listeners and SCRAM
        credentials of their own). Like ``redis``, another one than the recorded one
        restarts what it changes."""
        config.check_broker_count(brokers)
        config.check_redis_topology(redis)
        with self._locked():
            state = self._load_state()
            recorded = state if state is not None else _State(brokers, "", 0, 0)
            if security not in config.SECURITY_MODES:
                raise LocalEnvError(
                    f"security must be one of {config.SECURITY_MODES}, not {security!r}"
                )
            if security == "sasl_ssl" and self.ports.advertises_elsewhere:
                raise LocalEnvError("security sasl_ssl needs brokers advertised at their own ports")
            count = recorded.proxies if proxies is None else proxies
            placement = placement or recorded.proxy_placement
            workers = recorded.proxy_workers if workers is None else workers
            try:  # refused before anything starts
                config.plan_proxies(count, self.ports, brokers, placement, workers)
            except ValueError as exc:
                raise LocalEnvError(str(exc)) from exc
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
            state = dataclasses.replace(state, redis_topology=redis, security=security)
            if previous is not None and (
                previous.redis_port,
                previous.redis_topology,
                previous.security,
            ) != (state.redis_port, redis, security):
                stop_all(self._every_redis_process(), STOP_TIMEOUT)
                if redis != "single":  # its files name the old ports, or another topology's
                    self._redis(state).remove()
            self._save_state(state)
            nodes = list(range(state.brokers))
            self._stop_outdated_nodes(state)
            self._start_nodes(state, [n for n in nodes if not self._node_process(n).is_running()])
            self._start_redis_processes(state)
            deadline = time.monotonic() + timeout
            self._wait_for_brokers(state, set(nodes), set(nodes), deadline)
            self._ensure_scram_users(state)
            if state.security == "sasl_ssl":
                self._ensure_acls(state)
            self._wait_for_redis(state, deadline)
            state = dataclasses.replace(
                state,
                proxies=count,
                proxy_placement=placement,
                proxy_workers=workers,
                proxy_port_base=self.ports.proxy_base,
            )
            self._save_state(state)
            self._ensure_proxies(state, time.monotonic() + PROXY_START_TIMEOUT)
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
            # The proxies first: they drain what clients sent while Kafka still answers.
            self._stop_proxies(self._recorded_proxy_indexes())
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

    def kill_proxy(self, index: int) -> bool:
        """SIGKILL one proxy, with its workers (its whole process group); whether it ran."""
        with self._locked():
            state = self._require_state()
            proxy = self._check_proxy(state, index)
            killed = self._kill_proxy_group(index)
            for port in (proxy.listen, proxy.admin):
                wait_port_closed(HOST, port, 10.0)
            return killed

    def start_proxy(self, index: int, timeout: float = PROXY_START_TIMEOUT) -> ProxyInfo:
        """Start one proxy (if it is not running) and wait until it is healthy."""
        with self._locked():
            state = self._require_state()
            proxy = self._check_proxy(state, index)
            self._start_proxies(state, [proxy], time.monotonic() + timeout)
            return ProxyInfo.of(proxy)

    # --- proxies ------------------------------------------------------------------------

    @staticmethod
    def _check_proxy(state: _State, index: int) -> ProxyInstance:
        plan = _proxy_plan(state)
        if not 1 <= index <= len(plan):
            which = f"proxies 1..{len(plan)}" if plan else "no proxies (up --proxies N)"
            raise LocalEnvError(f"no proxy {index}: the environment has {which}")
        return plan[index - 1]

    def _ensure_proxies(self, state: _State, deadline: float) -> None:
        """Bring the running proxies to the recorded plan: stop those beyond it or whose
        configuration changed, start what is not running, wait until all are healthy."""
        plan = _proxy_plan(state)
        self._stop_proxies([i for i in self._recorded_proxy_indexes() if i > len(plan)])
        stale = [
            proxy.index
            for proxy in plan
            if self._proxy_process(proxy.index).is_running()
            and self._proxy_config_text(state, proxy) != _read(self._proxy_config(proxy.index))
        ]
        self._stop_proxies(stale)
        self._start_proxies(state, plan, deadline)

    def _proxy_config(self, index: int) -> Path:
        return self.proxy_dir(index) / "proxy.toml"

    def _proxy_config_text(self, state: _State, proxy: ProxyInstance) -> str:
        info = self._info(dataclasses.replace(state, proxies=0))
        header = (
            f"Local proxy {proxy.instance_id} ({proxy.workers} worker(s)), written by "
            f"`dedup-proxy local up`; DEDUP_PROXY_* variables are not passed to it."
        )
        values = proxy.settings(info.bootstrap, info.redis)
        if state.security == "sasl_ssl":
            certs = self.tls
            values |= {
                "listener_tls_cert_file": str(certs.server_cert_file),
                "listener_tls_key_file": str(certs.server_key_file),
                "upstream_security_protocol": "SASL_SSL",
                "upstream_tls_ca_file": str(certs.ca_file),
                "upstream_sasl_mechanism": "SCRAM-SHA-512",
                "upstream_sasl_username": "proxy",
                "upstream_sasl_password": certs.sasl_users["proxy"],
                "redis_tls_ca_file": str(certs.ca_file),
                "redis_tls_cert_file": str(certs.client_cert_file),
                "redis_tls_key_file": str(certs.client_key_file),
            }
        return config.render_toml(values, header)

    def _start_proxies(self, state: _State, plan: list[ProxyInstance], deadline: float) -> None:
        starting = [p for p in plan if not self._proxy_process(p.index).is_running()]
        for proxy in starting:
            for port in (proxy.listen, *(proxy.admin + w for w in range(proxy.workers))):
                if not wait_port_closed(HOST, port, 5.0):
                    raise LocalEnvError(
                        f"port {port} of {proxy.instance_id} is taken by a process this "
                        f"environment does not know; free it or set DEDUP_LOCAL_PROXY_PORT"
                    )
        # The environment's own settings only: a DEDUP_PROXY_ variable of the caller's
        # shell would override the proxy's file.
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("DEDUP_PROXY_")}
        for proxy in starting:
            path = self._proxy_config(proxy.index)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(self._proxy_config_text(state, proxy))
            path.chmod(0o600)  # it may hold the proxy's SASL password
            argv = [sys.executable, "-m", "dedup", "serve", "--config", str(path)]
            self._proxy_process(proxy.index).start(argv, cwd=path.parent, env=env)
        for proxy in plan:
            self._wait_for_proxy(proxy, deadline)

    def _wait_for_proxy(self, proxy: ProxyInstance, deadline: float) -> None:
        proc = self._proxy_process(proxy.index)
        while True:
            if not proc.is_running():
                raise self._failure(proc, f"{proxy.instance_id} exited during start")
            if all(_proxy_healthy(url) for url in proxy.admin_urls):
                return
            if time.monotonic() >= deadline:
                raise self._failure(
                    proc, f"timed out waiting for {proxy.instance_id} to be healthy"
                )
            time.sleep(0.2)

    def _stop_proxies(self, indexes: list[int]) -> None:
        """SIGTERM (each drains; a supervisor stops its workers), then the whole process
        group is SIGKILLed if it is not gone in time."""
        procs = {index: self._proxy_process(index) for index in indexes}
        pids = {index: proc.send(signal.SIGTERM) for index, proc in procs.items()}
        deadline = time.monotonic() + STOP_TIMEOUT
        for index, pid in pids.items():
            if pid is not None and not procs[index].wait_gone(pid, deadline - time.monotonic()):
                self._kill_proxy_group(index)
        for proc in procs.values():
            proc.forget()

    def _kill_proxy_group(self, index: int) -> bool:
        proc = self._proxy_process(index)
        pid = proc.running_pid()
        if pid is None:
            return False
        # Started as a session leader: its process group (pgid == pid) holds its workers.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        if not proc.wait_gone(pid, 30.0):
            raise LocalEnvError(f"{proc.name} (pid {pid}) still exists 30 s after SIGKILL")
        return True

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

    def _node_config(self, state: _State, node_id: int) -> str:
        """The text of a node's server.properties as this version of the lab writes it."""
        tls = self.tls.ensure()
        security = config.KafkaSecurity(
            tls.keystore_file,
            tls.truststore_file,
            tls.keystore_password,
            tls.sasl_users,
            state.security,
        )
        props = config.server_properties(
            node_id, state.brokers, _ports(state), self.node_dir(node_id) / "data", security
        )
        header = f"Local Kafka node {node_id} of {state.brokers}, cluster {state.cluster_id}."
        return config.render_properties(props, header)

    def _write_node_config(self, state: _State, node_id: int) -> Path:
        node = self.node_dir(node_id)
        (node / "logs").mkdir(parents=True, exist_ok=True)
        path = node / "server.properties"
        path.write_text(self._node_config(state, node_id))
        return path

    def _stop_outdated_nodes(self, state: _State) -> None:
        """Stop running nodes started with another configuration than this version's (an
        older checkout's: without the TLS listeners, say); they start again with it."""
        outdated = []
        for node in range(state.brokers):
            path = self.node_dir(node) / "server.properties"
            if self._node_process(node).is_running() and (
                not path.is_file() or path.read_text() != self._node_config(state, node)
            ):
                outdated.append(self._node_process(node))
        if outdated:
            stop_all(outdated, STOP_TIMEOUT)

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
        secured = self._kafka_config(state)  # read once, not at every poll
        while True:
            for node in sorted(ask - ready):
                proc = self._node_process(node)
                if not proc.is_running():
                    raise self._failure(proc, f"kafka node {node} exited during start")
                address = f"{HOST}:{_ports(state).client(node)}"
                if must_list <= _metadata_brokers(address, secured):
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

    def _ensure_scram_users(self, state: _State) -> None:
        """The SASL users' SCRAM credentials (both mechanisms), in the cluster's metadata:
        asked on the client listener; setting them again is harmless."""
        admin = self._admin(state)
        # The brokers first: where they advertise other addresses than the bootstrap one (the
        # chaos topology's Toxiproxy ports), librdkafka drops the bootstrap broker once it
        # learns them, and a request still waiting on it fails with _DESTROY_BROKER.
        try:
            admin.list_topics(timeout=30)
        except KafkaException as exc:
            raise LocalEnvError(f"no metadata from the cluster for its SCRAM users: {exc}") from exc
        deadline = time.monotonic() + SCRAM_USERS_TIMEOUT
        # One mechanism per request: Kafka refuses a user altered twice in one.
        for mechanism in (ScramMechanism.SCRAM_SHA_256, ScramMechanism.SCRAM_SHA_512):
            upserts: list[Any] = [
                UserScramCredentialUpsertion(
                    user, ScramCredentialInfo(mechanism, SCRAM_ITERATIONS), password.encode()
                )
                for user, password in self.tls.sasl_users.items()
            ]
            _alter_scram_users(admin, upserts, deadline)

    def _ensure_acls(self, state: _State) -> None:
        """The sasl_ssl mode's ACLs (`config.acl_grants`); creating them again is harmless."""
        admin = self._admin(state)
        bindings = [_acl_binding(grant) for grant in config.acl_grants()]
        for binding, future in admin.create_acls(bindings, request_timeout=30).items():
            try:
                future.result(timeout=60)
            except KafkaException as exc:
                raise LocalEnvError(f"could not create the ACL {binding}: {exc}") from exc

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


def _sasl_ssl_config(certs: LocalTls, mechanism: str, user: str, password: str) -> dict[str, str]:
    """librdkafka settings for the brokers' SASL_SSL listeners, trusting the local CA."""
    return {
        "security.protocol": "sasl_ssl",
        "ssl.ca.location": str(certs.ca_file),
        "sasl.mechanism": mechanism,
        "sasl.username": user,
        "sasl.password": password,
    }


def _acl_binding(grant: config.AclGrant) -> AclBinding:
    literal = grant.pattern == "literal"
    # librdkafka names Kafka's CLUSTER resource type (4) BROKER.
    kind = "BROKER" if grant.resource_type == "cluster" else grant.resource_type.upper()
    return AclBinding(
        ResourceType[kind],
        grant.name,
        ResourcePatternType.LITERAL if literal else ResourcePatternType.PREFIXED,
        grant.principal,
        "*",
        AclOperation[grant.operation.upper()],
        AclPermissionType.ALLOW,
    )


def _alter_scram_users(admin: AdminClient, upserts: list[Any], deadline: float) -> None:
    """Sets the users' credentials, again while the failure is transient (setting them twice
    is harmless) and the deadline allows."""
    while True:
        try:
            for done in admin.alter_user_scram_credentials(upserts).values():
                done.result(timeout=max(1.0, deadline - time.monotonic()))
            return
        except KafkaException as exc:
            error = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
            transient = error is not None and (
                error.retriable() or error.code() in _TRANSIENT_ADMIN_ERRORS
            )
            if not transient or time.monotonic() >= deadline:
                users = ", ".join(upsert.user for upsert in upserts)
                raise LocalEnvError(
                    f"could not create SCRAM users {users}: {exc} "
                    f"(brokers known to the client: {_known_brokers(admin)})"
                ) from exc
            time.sleep(0.5)
        except TimeoutError as exc:
            raise LocalEnvError(
                f"no answer to the SCRAM users' request within {SCRAM_USERS_TIMEOUT:.0f} s "
                f"(brokers known to the client: {_known_brokers(admin)})"
            ) from exc


def _known_brokers(admin: AdminClient) -> str:
    """The brokers a client's metadata names, for an error message."""
    try:
        brokers = admin.list_topics(timeout=5).brokers.values()
    except KafkaException as exc:
        return f"none ({exc})"
    return ", ".join(f"{broker.id}@{broker.host}:{broker.port}" for broker in brokers)


def _metadata_brokers(address: str, kafka_config: dict[str, str] | None = None) -> set[int]:
    """The broker ids in a Metadata answer from the node at address (empty if none)."""
    host, _, port = address.rpartition(":")
    if not port_open(host, int(port)):
        return set()
    # A fresh client each time: a reused one may send the request to another node.
    admin = AdminClient(
        {
            "bootstrap.servers": address,
            "socket.connection.setup.timeout.ms": 2000,
            **(kafka_config or {}),
        },
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
        proxy_base=state.proxy_port_base,
    )


def _proxy_plan(state: _State) -> list[ProxyInstance]:
    return config.plan_proxies(
        state.proxies,
        _ports(state),
        state.brokers,
        placement=state.proxy_placement,
        workers=state.proxy_workers,
    )


def _proxy_healthy(admin_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{admin_url}/healthz", timeout=1) as answer:
            return bool(json.load(answer).get("status") == "ok")
    except (OSError, ValueError):  # refused, 503 (HTTPError is an OSError), not JSON
        return False


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


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
