"""The local Redis in one of three topologies (`deploy.config.REDIS_TOPOLOGIES`), run as
detached processes on loopback: one redis-server; a primary with two replicas watched by
three Sentinels; a six-node Redis Cluster (three primaries, three replicas). Debian's
`redis-server` runs them all (a Sentinel is `redis-server CONF --sentinel`); `redis-cli
--cluster create` forms the cluster.

Files, under the environment's state home:

    redis/                          single: redis.conf, data/, redis.log, process.log, redis.pid
    redis-sentinel/node-<i>/        the same per data node (node 0 is the first primary)
    redis-sentinel/sentinel-<i>/    sentinel.conf (Sentinel rewrites it), sentinel.log, ...
    redis-cluster/node-<i>/         the same per cluster node; data/nodes.conf is its view

Nodes are named by index: data node i listens on `config.redis_data_ports(...)[i]`.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from deploy import config, paths
from deploy.config import HOST
from deploy.processes import ManagedProcess, port_open, stop_all, tail, wait_port_closed
from deploy.tls import LocalTls

STOP_TIMEOUT = 30.0


class LocalRedisError(RuntimeError):
    """The local Redis could not be brought to the requested state."""


@dataclass(frozen=True)
class RedisNode:
    """One process of the topology: a data node or a Sentinel."""

    index: int
    port: int
    directory: Path
    process: ManagedProcess
    sentinel: bool = False

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def config_file(self) -> Path:
        return self.directory / ("sentinel.conf" if self.sentinel else "redis.conf")

    @property
    def log(self) -> Path:
        return self.directory / ("sentinel.log" if self.sentinel else "redis.log")


@dataclass(frozen=True)
class RedisTls:
    """Redis that speaks TLS only (replication, the cluster bus and the Sentinels too),
    asks clients for a certificate, and data nodes for a password."""

    ca_file: Path
    cert_file: Path  # the server's
    key_file: Path
    client_cert_file: Path  # what the environment's own checks present
    client_key_file: Path
    password: str = field(repr=False)

    @classmethod
    def of(cls, certs: LocalTls, password: str) -> RedisTls:
        """With the local certificates: the server's for the servers, the client's for
        every connection they and the environment make."""
        return cls(
            certs.ca_file,
            certs.server_cert_file,
            certs.server_key_file,
            certs.client_cert_file,
            certs.client_key_file,
            password,
        )

    def server_settings(self, port: int, sentinel: bool = False) -> tuple[tuple[str, str], ...]:
        """The settings after a node's own (the later setting wins)."""
        shared = (
            ("port", "0"),  # no plaintext port
            ("tls-port", str(port)),
            ("tls-cert-file", str(self.cert_file)),
            ("tls-key-file", str(self.key_file)),
            ("tls-ca-cert-file", str(self.ca_file)),
            ("tls-auth-clients", "yes"),
            # What it presents when it connects (to its primary; a Sentinel to the nodes).
            ("tls-client-cert-file", str(self.client_cert_file)),
            ("tls-client-key-file", str(self.client_key_file)),
            ("tls-replication", "yes"),
        )
        if sentinel:
            return (*shared, ("sentinel auth-pass", f"{config.SENTINEL_MASTER} {self.password}"))
        return (
            *shared,
            ("tls-cluster", "yes"),
            ("requirepass", self.password),
            ("masterauth", self.password),
        )

    def cli_arguments(self) -> list[str]:
        """redis-cli's, to reach the data nodes."""
        return [
            *("--tls", "--cacert", str(self.ca_file)),
            *("--cert", str(self.client_cert_file), "--key", str(self.client_key_file)),
            *("-a", self.password, "--no-auth-warning"),
        ]

    def client_settings(self) -> dict[str, Any]:
        """redis-py's connection arguments."""
        return {
            "ssl": True,
            "ssl_ca_certs": str(self.ca_file),
            "ssl_certfile": str(self.client_cert_file),
            "ssl_keyfile": str(self.client_key_file),
            "password": self.password,
        }


class LocalRedis:
    """Starts, watches and breaks the Redis processes of one topology. Callers hold the
    state home's lock (`deploy.local.LocalEnvironment` does). With ``tls``, Redis speaks
    TLS only and asks for a password (`RedisTls`)."""

    def __init__(
        self, home: Path, port: int, topology: str = "single", tls: RedisTls | None = None
    ) -> None:
        config.check_redis_topology(topology)
        self.home = home
        self.port = port
        self.topology = topology
        self.tls = tls

    # --- layout -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        plain = config.redis_url(self.topology, self.port)
        if self.tls is None:
            return plain
        scheme, _, rest = plain.partition("://")
        return f"{scheme.replace('redis', 'rediss', 1)}://:{self.tls.password}@{rest}"

    @property
    def directory(self) -> Path:
        return self.home / ("redis" if self.topology == "single" else f"redis-{self.topology}")

    def nodes(self) -> list[RedisNode]:
        """The data nodes, by index."""
        ports = config.redis_data_ports(self.topology, self.port)
        if self.topology == "single":
            return [self._node(0, ports[0], self.directory, "redis")]
        return [
            self._node(i, port, self.directory / f"node-{i}", "redis")
            for i, port in enumerate(ports)
        ]

    def sentinels(self) -> list[RedisNode]:
        return [
            self._node(i, port, self.directory / f"sentinel-{i}", "sentinel", sentinel=True)
            for i, port in enumerate(config.redis_sentinel_ports(self.topology, self.port))
        ]

    def _node(
        self, index: int, port: int, directory: Path, stem: str, sentinel: bool = False
    ) -> RedisNode:
        kind = "sentinel" if sentinel else "node"
        name = "redis" if self.topology == "single" else f"redis {self.topology} {kind} {index}"
        process = ManagedProcess(
            name=name,
            pid_file=directory / f"{stem}.pid",
            log_file=directory / "process.log",
            marker=str(directory / f"{stem}.conf"),
        )
        return RedisNode(index, port, directory, process, sentinel)

    def processes(self) -> list[ManagedProcess]:
        return [n.process for n in (*self.nodes(), *self.sentinels())]

    def node(self, index: int) -> RedisNode:
        nodes = self.nodes()
        if not 0 <= index < len(nodes):
            raise LocalRedisError(
                f"no redis node {index}: the {self.topology} topology has nodes 0..{len(nodes) - 1}"
            )
        return nodes[index]

    # --- start / stop -------------------------------------------------------------------

    def start(self) -> None:
        """Start every data node that is not running; `wait_ready` starts the Sentinels."""
        for node in self.nodes():
            self._start_node(node)

    def stop(self) -> None:
        stop_all(self.processes(), STOP_TIMEOUT)

    def remove(self) -> None:
        """Delete the topology's files (stop it first)."""
        if self.directory.exists():
            shutil.rmtree(self.directory)

    def wait_ready(self, deadline: float) -> None:
        """Every data node answers PING; then, in the sentinel topology, the replicas are in
        sync, the Sentinels that are not running are started (after the replicas, so that
        their first look at the primary finds both) and know the primary, both replicas
        and each other; in the cluster topology, the cluster is formed (created here the
        first time) and every node says it is ok."""
        for node in self.nodes():
            self._wait_ping(node, deadline)
        if self.topology == "sentinel":
            self._wait_replicas(deadline)
            for sentinel in self.sentinels():
                self._start_sentinel(sentinel)
            for sentinel in self.sentinels():
                self._wait_sentinel(sentinel, deadline)
        elif self.topology == "cluster":
            if self._needs_create():
                self._create_cluster()
            self._wait_cluster(deadline)

    def start_node(self, index: int, deadline: float, empty: bool = False) -> None:
        """Start one data node (if it is not running), `empty`: without its data, and wait
        until it answers and the replicas are in sync (Sentinel turns an old primary into a
        replica), or, in a cluster, until the cluster is ok again."""
        node = self.node(index)
        if empty and not node.process.is_running():
            if self.topology == "cluster":
                raise LocalRedisError("a cluster node cannot start empty: it would be a stranger")
            _remove(node.directory / "data")
        self._start_node(node)
        self._wait_ping(node, deadline)
        if self.topology == "sentinel":  # an old primary comes back as a replica
            self._wait_replicas(deadline)
        elif self.topology == "cluster":
            self._wait_cluster(deadline)

    def kill(self, index: int) -> bool:
        """SIGKILL data node `index`; whether it was running."""
        node = self.node(index)
        killed = node.process.kill()
        wait_port_closed(HOST, node.port, 10.0)
        return killed

    # --- who is who ---------------------------------------------------------------------

    def primary(self) -> int:
        """The data node that is the primary now: in the sentinel topology, as a majority of
        the Sentinels that answer name it."""
        if self.topology == "single":
            return 0
        if self.topology == "cluster":
            raise LocalRedisError("a cluster has a primary per slot: name a node or a key")
        votes: dict[int, int] = {}
        for sentinel in self.sentinels():
            with contextlib.suppress(redis.RedisError):
                with self._client(sentinel.port) as client:
                    found = client.execute_command(
                        "SENTINEL", "GET-MASTER-ADDR-BY-NAME", config.SENTINEL_MASTER
                    )
                if found:
                    port = int(found[1])
                    votes[port] = votes.get(port, 0) + 1
        if not votes:
            raise LocalRedisError("no Sentinel answers")
        port = max(votes, key=lambda p: votes[p])
        return self._index_of(port)

    def owner(self, key: str) -> int:
        """The data node serving `key` now: the primary of its slot in a cluster, the
        primary elsewhere."""
        if self.topology != "cluster":
            return self.primary()
        for node in self._running_nodes():
            with contextlib.suppress(redis.RedisError):
                with self._client(node.port) as client:
                    slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
                    table = _text(client.execute_command("CLUSTER", "NODES"))
                for line in table.splitlines():
                    fields = line.split()
                    flags = fields[2].split(",")
                    if "master" not in flags or "fail" in flags or "fail?" in flags:
                        continue
                    if any(_slot_in(slot, text) for text in fields[8:]):
                        port = int(fields[1].split("@")[0].rpartition(":")[2])
                        return self._index_of(port)
        raise LocalRedisError(f"no running cluster node names an owner of {key!r}'s slot")

    def status(self) -> dict[str, Any]:
        """Pids and listening state of every process (no Redis requests)."""

        def one(node: RedisNode) -> dict[str, Any]:
            pid = node.process.running_pid()
            return {
                "address": node.address,
                "pid": pid,
                "running": pid is not None,
                "listening": pid is not None and port_open(HOST, node.port),
                "log": str(node.log),
            }

        return {
            "redis_topology": self.topology,
            "redis_nodes": {str(n.index): one(n) for n in self.nodes()},
            "redis_sentinels": {str(s.index): one(s) for s in self.sentinels()},
        }

    # --- processes ----------------------------------------------------------------------

    def _start_node(self, node: RedisNode) -> None:
        if node.process.is_running():
            return
        self._check_port_free(node.port)
        data = node.directory / "data"
        data.mkdir(parents=True, exist_ok=True)
        conf = node.config_file
        # A replica's file is Sentinel's to rewrite once it has a say (after a failover):
        # written once. The single node's and cluster nodes' are rewritten at every start
        # (a cluster node keeps its view of the cluster in data/nodes.conf).
        if self.topology != "sentinel" or not conf.exists():
            conf.write_text(
                config.redis_config(
                    node.port,
                    data,
                    node.log,
                    extra=(
                        *config.redis_node_settings(self.topology, self.port, node.index),
                        *(self.tls.server_settings(node.port) if self.tls else ()),
                    ),
                )
            )
        node.process.start([paths.redis_server_executable(), str(conf)], cwd=node.directory)

    def _start_sentinel(self, sentinel: RedisNode) -> None:
        if sentinel.process.is_running():
            return
        self._check_port_free(sentinel.port)
        sentinel.directory.mkdir(parents=True, exist_ok=True)
        conf = sentinel.config_file
        if not conf.exists():
            conf.write_text(
                config.sentinel_config(
                    sentinel.port,
                    self.port,
                    sentinel.directory,
                    sentinel.log,
                    extra=self.tls.server_settings(sentinel.port, sentinel=True)
                    if self.tls
                    else (),
                )
            )
        argv = [paths.redis_server_executable(), str(conf), "--sentinel"]
        sentinel.process.start(argv, cwd=sentinel.directory)

    def _check_port_free(self, port: int) -> None:
        # A short grace period: a node killed a moment ago may still be exiting.
        if not wait_port_closed(HOST, port, 5.0):
            raise LocalRedisError(
                f"port {port} is taken by a process this environment does not know; free it "
                f"or set DEDUP_LOCAL_REDIS_PORT"
            )

    def _failure(self, node: RedisNode, what: str) -> LocalRedisError:
        return LocalRedisError(
            f"{what}; last lines of {node.log}:\n{tail(node.log)}\n"
            f"{tail(node.process.log_file, 10)}"
        )

    def _wait_ping(self, node: RedisNode, deadline: float) -> None:
        with self._client(node.port) as client:
            while True:
                if not node.process.is_running():
                    raise self._failure(node, f"{node.process.name} exited during start")
                with contextlib.suppress(redis.RedisError):
                    # LOADING (a long AOF replay) is a RedisError too: keep waiting.
                    if client.ping():
                        return
                if time.monotonic() >= deadline:
                    raise self._failure(node, f"timed out waiting for {node.process.name}")
                time.sleep(0.1)

    def _wait_replicas(self, deadline: float) -> None:
        """Until one running node is a primary with every other running node its replica,
        in sync."""
        running = self._running_nodes()
        while True:
            states = []
            with contextlib.suppress(redis.RedisError):
                for node in running:
                    with self._client(node.port) as client:
                        states.append(client.info("replication"))
            primaries = [s for s in states if s.get("role") == "master"]
            synced = [s for s in states if s.get("master_link_status") == "up"]
            if (
                len(states) == len(running)
                and len(primaries) == 1
                and len(synced) == len(running) - 1
            ):
                return
            if time.monotonic() >= deadline:
                roles = [(s.get("role"), s.get("master_link_status")) for s in states]
                raise LocalRedisError(f"the redis replicas are not in sync: {roles}")
            time.sleep(0.1)

    def _wait_sentinel(self, sentinel: RedisNode, deadline: float) -> None:
        """Until the Sentinel knows a primary, its two replicas and the other Sentinels:
        only then can it take part in a failover."""
        replicas, others = config.SENTINEL_DATA_NODES - 1, config.SENTINELS - 1
        seen: dict[str, str] = {}
        with self._client(sentinel.port) as client:
            while True:
                if not sentinel.process.is_running():
                    raise self._failure(sentinel, f"{sentinel.process.name} exited")
                with contextlib.suppress(redis.RedisError):
                    raw = client.execute_command("SENTINEL", "MASTER", config.SENTINEL_MASTER)
                    seen = _pairs(raw)
                    if (
                        int(seen.get("num-slaves", 0)) >= replicas
                        and int(seen.get("num-other-sentinels", 0)) >= others
                        and "s_down" not in seen.get("flags", "")
                    ):
                        return
                if time.monotonic() >= deadline:
                    raise self._failure(
                        sentinel, f"{sentinel.process.name} does not know the topology: {seen}"
                    )
                time.sleep(0.2)

    def _needs_create(self) -> bool:
        with self._client(self.nodes()[0].port) as client:
            info = _cluster_info(client)
        return int(info.get("cluster_slots_assigned", 0)) == 0

    def _create_cluster(self) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise LocalRedisError(f"redis-cli not found: {paths.SETUP_HINT}")
        addresses = [n.address for n in self.nodes()]
        secured = self.tls.cli_arguments() if self.tls else []
        argv = [cli, *secured, "--cluster", "create", *addresses, "--cluster-replicas", "1"]
        done = subprocess.run([*argv, "--cluster-yes"], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise LocalRedisError(f"redis-cli --cluster create failed:\n{done.stdout}{done.stderr}")

    def _wait_cluster(self, deadline: float) -> None:
        """Until every running node says the cluster is ok and knows all six nodes, and
        every primary has a replica in sync."""
        while True:
            problems = []
            for node in self._running_nodes():
                try:
                    with self._client(node.port) as client:
                        info = _cluster_info(client)
                        replication = client.info("replication")
                except redis.RedisError as exc:
                    problems.append(f"node {node.index}: {exc}")
                    continue
                if info.get("cluster_state") != "ok":
                    problems.append(f"node {node.index}: cluster_state {info.get('cluster_state')}")
                elif int(info.get("cluster_known_nodes", 0)) < config.CLUSTER_NODES:
                    problems.append(f"node {node.index} knows {info.get('cluster_known_nodes')}")
                elif replication.get("role") == "slave" and (
                    replication.get("master_link_status") != "up"
                ):
                    problems.append(f"node {node.index}: replica not in sync")
            if not problems:
                return
            if time.monotonic() >= deadline:
                raise LocalRedisError(f"the redis cluster is not ok: {'; '.join(problems)}")
            time.sleep(0.2)

    def _running_nodes(self) -> list[RedisNode]:
        return [n for n in self.nodes() if n.process.is_running()]

    @contextlib.contextmanager
    def _client(self, port: int) -> Iterator[Any]:
        secured = self.tls.client_settings() if self.tls is not None else {}
        if port in config.redis_sentinel_ports(self.topology, self.port):
            secured.pop("password", None)  # the Sentinels ask none
        client = redis.Redis(
            host=HOST, port=port, socket_timeout=1.0, socket_connect_timeout=1.0, **secured
        )
        try:
            yield client
        finally:
            client.close()

    def _index_of(self, port: int) -> int:
        for node in self.nodes():
            if node.port == port:
                return node.index
        raise LocalRedisError(f"port {port} is none of this topology's nodes")


def _cluster_info(client: Any) -> dict[str, str]:
    text = _text(client.execute_command("CLUSTER", "INFO"))
    return dict(line.strip().split(":", 1) for line in text.splitlines() if ":" in line.strip())


def _pairs(raw: Any) -> dict[str, str]:
    """SENTINEL MASTER's flat [name, value, ...] reply (redis-py may already make it a dict)."""
    if isinstance(raw, dict):
        return {_text(k): _text(v) for k, v in raw.items()}
    items = [_text(x) for x in raw]
    return dict(zip(items[::2], items[1::2], strict=True))


def _slot_in(slot: int, text: str) -> bool:
    """Whether a CLUSTER NODES slot field (``5``, ``0-5460``; ``[...]`` for migrations)
    covers the slot."""
    if text.startswith("["):
        return False
    low, _, high = text.partition("-")
    return int(low) <= slot <= int(high or low)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
