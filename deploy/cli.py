"""`local` commands: bring the local Kafka + Redis environment up and down, inject failures;
`local spark-cluster`: the same for a standalone Spark cluster.

Human output goes through rich; with --json exactly one JSON object is printed on stdout
(progress and errors go to stderr), so scripts can parse it."""

from __future__ import annotations

import json
import re
import time
from enum import StrEnum
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from deploy.config import MAX_PROXIES
from deploy.local import EnvInfo, LocalEnvError, LocalEnvironment
from deploy.paths import MissingRuntimeError
from deploy.spark_cluster import MAX_WORKERS, ClusterShape, SparkCluster, SparkClusterError

local_app = typer.Typer(
    name="local",
    help="The local Kafka + Redis the project runs on.\n\n"
    "The local Apache Kafka (KRaft) cluster and Redis the proxy runs against.",
    no_args_is_help=True,
    add_completion=False,
)

out = Console()
err = Console(stderr=True)


class BrokerCount(StrEnum):
    one = "1"
    three = "3"


class Placement(StrEnum):
    balanced = "balanced"
    sidecar = "sidecar"


class Security(StrEnum):
    mixed = "mixed"
    sasl_ssl = "sasl_ssl"


class RedisTopology(StrEnum):
    single = "single"
    sentinel = "sentinel"
    cluster = "cluster"


JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]
NodeId = Annotated[int, typer.Argument(help="Kafka node id (0..brokers-1).", min=0)]


def _env() -> LocalEnvironment:
    return LocalEnvironment()


def _fail(exc: Exception) -> typer.Exit:
    err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
    return typer.Exit(code=1)


def _print_json(data: dict[str, Any]) -> None:
    # Plain print: rich would wrap or colour the text.
    print(json.dumps(data, sort_keys=True))


def _print_info(info: EnvInfo, seconds: float | None = None) -> None:
    took = f" in {seconds:.1f}s" if seconds is not None else ""
    out.print(f"[green]local environment up{took}[/]")
    out.print(f"  bootstrap  {info.bootstrap}", highlight=False)
    for node, address in sorted(info.brokers.items()):
        out.print(f"  node {node}     {address}", highlight=False)
    redis_url = re.sub(r"//:[^@]*@", "//:***@", info.redis)  # the password: in --json only
    out.print(f"  redis      {redis_url}", highlight=False)
    if info.security == "sasl_ssl":
        out.print(
            f"  security   SASL_SSL only, ACLs enforced (client: all; proxy: the README's "
            f"list); CA, certificates and users in {info.tls_dir}",
            highlight=False,
        )
    for proxy in info.proxies:
        out.print(
            f"  {proxy.instance_id:<10} bootstrap {proxy.bootstrap}  admin "
            f"{', '.join(proxy.admins)}",
            highlight=False,
        )


@local_app.command()
def up(
    brokers: Annotated[
        BrokerCount, typer.Option("--brokers", help="Kafka nodes (a new count recreates).")
    ] = BrokerCount.one,
    redis: Annotated[
        RedisTopology,
        typer.Option(
            "--redis",
            help="Redis: one process; a primary, two replicas and three Sentinels; or a "
            "six-node Redis Cluster (a new topology starts empty).",
        ),
    ] = RedisTopology.single,
    proxies: Annotated[
        int | None,
        typer.Option(
            help="Also run N proxies (proxy-1..N) in front of them; 0 stops them "
            "(default: as recorded).",
            min=0,
            max=MAX_PROXIES,
        ),
    ] = None,
    placement: Annotated[
        Placement | None,
        typer.Option(help="The proxies' placement; sidecar: one proxy per broker."),
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(help="Worker processes per proxy (serve --workers).", min=1),
    ] = None,
    security: Annotated[
        Security,
        typer.Option(
            help="mixed: plaintext, TLS and SASL_SSL listeners side by side; sasl_ssl: "
            "SASL_SSL only (replication too), Redis over TLS with a password, the proxies "
            "on TLS with SCRAM credentials (another one than the running one restarts them).",
        ),
    ] = Security.mixed,
    json_output: JsonFlag = False,
) -> None:
    """Start Kafka and Redis (only what is not running) and wait until they answer; with
    --proxies, also proxies in front of them, until each is healthy."""
    if not json_output:
        what = f" and {proxies} proxies" if proxies else ""
        err.print(f"starting {brokers.value} Kafka node(s), Redis ({redis.value}){what} ...")
    started = time.monotonic()
    try:
        info = _env().up(
            brokers=int(brokers.value),
            redis=redis.value,
            proxies=proxies,
            placement=None if placement is None else placement.value,
            workers=workers,
            security=security.value,
        )
    except (LocalEnvError, MissingRuntimeError) as exc:
        raise _fail(exc) from exc
    if json_output:
        _print_json(info.to_json())
    else:
        _print_info(info, time.monotonic() - started)


@local_app.command()
def down(
    purge: Annotated[bool, typer.Option("--purge", help="Also delete all local data.")] = False,
) -> None:
    """Stop the proxies, Kafka and Redis."""
    _env().down(purge=purge)
    out.print("local environment down" + (" and purged" if purge else ""))


@local_app.command()
def status(json_output: JsonFlag = False) -> None:
    """Show what runs, with pids and addresses."""
    data = _env().status()
    if json_output:
        _print_json(data)
        return
    if not data["created"]:
        out.print(f"no local environment in {data['home']}")
        return
    out.print(f"local environment in {data['home']}", highlight=False)
    table = Table()
    for column in ("process", "address", "pid", "state"):
        table.add_column(column)
    for node, proc in data["nodes"].items():
        table.add_row(f"kafka node {node}", proc["address"], _pid(proc), _state(proc))
    topology = data.get("redis_topology", "single")
    if topology == "single":
        redis_proc = data["redis_process"]
        table.add_row("redis", data["redis"], _pid(redis_proc), _state(redis_proc))
    else:
        for index, proc in data["redis_nodes"].items():
            table.add_row(f"redis node {index}", proc["address"], _pid(proc), _state(proc))
        for index, proc in data["redis_sentinels"].items():
            table.add_row(f"sentinel {index}", proc["address"], _pid(proc), _state(proc))
    for proc in data["proxy_processes"].values():
        address = f"{proc['bootstrap']} (admin {proc['admin']})"
        if proc["workers"] > 1:
            address += f", {proc['workers']} workers"
        table.add_row(proc["instance_id"], address, _pid(proc), _state(proc))
    out.print(table)
    if topology != "single":
        out.print(f"redis {data['redis']}", highlight=False, soft_wrap=True)
    out.print(
        f"bootstrap {data['bootstrap']}  cluster {data['cluster_id']}",
        highlight=False,
        soft_wrap=True,
    )


def _pid(proc: dict[str, Any]) -> str:
    return "-" if proc["pid"] is None else str(proc["pid"])


def _state(proc: dict[str, Any], ready_key: str = "listening") -> str:
    """Stopped, starting (running but not yet ``ready_key``) or up."""
    if not proc["running"]:
        return "[red]stopped[/]"
    return "[green]up[/]" if proc[ready_key] else "[yellow]starting[/]"


@local_app.command("kill-broker")
def kill_broker(node_id: NodeId) -> None:
    """SIGKILL one Kafka node."""
    try:
        killed = _env().kill_broker(node_id)
    except LocalEnvError as exc:
        raise _fail(exc) from exc
    out.print(f"kafka node {node_id} " + ("killed" if killed else "was not running"))


@local_app.command("start-broker")
def start_broker(node_id: NodeId) -> None:
    """Start one Kafka node and wait until it is back in the cluster metadata."""
    try:
        _env().start_broker(node_id)
    except (LocalEnvError, MissingRuntimeError) as exc:
        raise _fail(exc) from exc
    out.print(f"kafka node {node_id} up")


ProxyIndex = Annotated[int, typer.Argument(help="proxy number (1..proxies).", min=1)]


@local_app.command("kill-proxy")
def kill_proxy(index: ProxyIndex) -> None:
    """SIGKILL one proxy (with its workers)."""
    try:
        killed = _env().kill_proxy(index)
    except LocalEnvError as exc:
        raise _fail(exc) from exc
    out.print(f"proxy-{index} " + ("killed" if killed else "was not running"))


@local_app.command("start-proxy")
def start_proxy(index: ProxyIndex) -> None:
    """Start one proxy and wait until it is healthy."""
    try:
        proxy = _env().start_proxy(index)
    except (LocalEnvError, MissingRuntimeError) as exc:
        raise _fail(exc) from exc
    out.print(f"{proxy.instance_id} up: bootstrap {proxy.bootstrap}, admin {proxy.admin}")


RedisNodeOption = Annotated[
    int | None, typer.Option("--node", help="Redis data node index (status lists them).", min=0)
]


@local_app.command("kill-redis")
def kill_redis(
    node: RedisNodeOption = None,
    key: Annotated[
        str | None,
        typer.Option("--key", help="the node serving this key (a cluster: its slot's primary)"),
    ] = None,
) -> None:
    """SIGKILL a Redis data node: by default the primary (single, sentinel); in a cluster
    name --node or --key."""
    env = _env()
    try:
        if node is None:
            node = env.redis_node(key)
        killed = env.kill_redis(node)
    except LocalEnvError as exc:
        raise _fail(exc) from exc
    out.print(f"redis node {node} " + ("killed" if killed else "was not running"))


@local_app.command("start-redis")
def start_redis(
    node: RedisNodeOption = None,
    empty: Annotated[
        bool, typer.Option(help="start with no data (a stopped Redis loses its data)")
    ] = False,
) -> None:
    """Start Redis (one node, or everything that is not running) and wait until it is
    ready."""
    try:
        _env().start_redis(empty=empty, node=node)
    except (LocalEnvError, MissingRuntimeError) as exc:
        raise _fail(exc) from exc
    out.print("redis up" if node is None else f"redis node {node} up")


# --- the standalone Spark cluster ----------------------------------------------------------

spark_cluster_app = typer.Typer(
    name="spark-cluster",
    help="A standalone Spark master and workers on loopback, for `spark run --master`.",
    no_args_is_help=True,
    add_completion=False,
)
local_app.add_typer(spark_cluster_app)

WorkerIndex = Annotated[int, typer.Argument(help="worker index (0..workers-1).", min=0)]


@spark_cluster_app.command("up")
def spark_cluster_up(
    workers: Annotated[int, typer.Option(help="workers", min=1, max=MAX_WORKERS)] = 2,
    cores: Annotated[int, typer.Option(help="cores each worker offers", min=1)] = 1,
    memory: Annotated[str, typer.Option(help="memory each worker offers executors")] = "1g",
    json_output: JsonFlag = False,
) -> None:
    """Start the master and the workers (only what is not running); wait until the master
    lists every worker."""
    started = time.monotonic()
    try:
        info = SparkCluster().up(ClusterShape(workers=workers, cores=cores, memory=memory))
    except (SparkClusterError, MissingRuntimeError) as exc:
        raise _fail(exc) from exc
    if json_output:
        _print_json(info.to_json())
        return
    out.print(f"[green]spark cluster up in {time.monotonic() - started:.1f}s[/]")
    out.print(f"  master     {info.master_url}  (status {info.master_ui})", highlight=False)
    for index, address in sorted(info.workers.items()):
        out.print(f"  worker {index}   {address}", highlight=False)


@spark_cluster_app.command("down")
def spark_cluster_down(
    purge: Annotated[
        bool, typer.Option("--purge", help="Also delete logs and executor directories.")
    ] = False,
) -> None:
    """Stop the workers (and their executors) and the master."""
    SparkCluster().down(purge=purge)
    out.print("spark cluster down" + (" and purged" if purge else ""))


@spark_cluster_app.command("status")
def spark_cluster_status(json_output: JsonFlag = False) -> None:
    """Show the processes, whether the master lists each worker, and the applications."""
    data = SparkCluster().status()
    if json_output:
        _print_json(data)
        return
    if not data["created"]:
        out.print(f"no spark cluster in {data['home']}")
        return
    out.print(f"spark cluster in {data['home']}", highlight=False)
    table = Table()
    for column in ("process", "address", "pid", "state"):
        table.add_column(column)
    master = data["master_process"]
    table.add_row("master", data["master"], _pid(master), _state(master, "answering"))
    for index, proc in data["worker_processes"].items():
        state = _state(proc, "registered")
        if proc["running"] and proc["registered"]:
            state += f", {proc['cores_used']} core(s) in use"
        table.add_row(f"worker {index}", proc["address"], _pid(proc), state)
    out.print(table)
    for app in data["applications"]:
        out.print(f"application {app['id']} {app['name']} ({app['cores']} cores)", highlight=False)


@spark_cluster_app.command("kill-worker")
def spark_cluster_kill_worker(index: WorkerIndex) -> None:
    """SIGKILL one worker with its executors (its whole process group)."""
    try:
        killed = SparkCluster().kill_worker(index)
    except SparkClusterError as exc:
        raise _fail(exc) from exc
    out.print(f"spark worker {index} " + ("killed" if killed else "was not running"))


@spark_cluster_app.command("start-worker")
def spark_cluster_start_worker(index: WorkerIndex) -> None:
    """Start one worker and wait until the master lists it."""
    try:
        SparkCluster().start_worker(index)
    except (SparkClusterError, MissingRuntimeError) as exc:
        raise _fail(exc) from exc
    out.print(f"spark worker {index} up")
