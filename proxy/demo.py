"""``dedup-proxy demo``: the embedded default, shown working end to end.

Starts the local Kafka and Redis, starts the proxy in front of them as its own process,
then has two independent clients (librdkafka through confluent-kafka, and the pure-Python
kafka-python) produce and consume only through the proxy, and shows what they saw.
"""

from __future__ import annotations

import re
import time
import uuid

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from kafka import KafkaConsumer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from deploy.local import LocalEnvironment
from proxy.launcher import ProxyProcess

console = Console()


def run_demo(messages: int, keep_running: bool) -> int:
    environment = LocalEnvironment()
    with console.status("Starting the local Kafka (KRaft) and Redis..."):
        env = environment.up(brokers=1)
    console.print(f"[green]✓[/] Kafka at [bold]{env.bootstrap}[/], Redis at {env.redis}")

    log_path = environment.home / "proxy.log"
    proxy = ProxyProcess(upstream=env.bootstrap, log_path=log_path)
    with console.status("Starting the proxy..."):
        proxy.start()
    console.print(
        f"[green]✓[/] Proxy at [bold]{proxy.bootstrap}[/] (admin {proxy.admin_url}, log {log_path})"
    )
    try:
        ok = _show_traffic(proxy, env.brokers, messages)
        if keep_running:
            console.print(
                f"\nEverything is running. Point any Kafka client at [bold]{proxy.bootstrap}[/]; "
                "Ctrl-C stops the proxy (then `dedup-proxy local down` stops Kafka and Redis)."
            )
            _wait_for_interrupt()
    finally:
        with console.status("Stopping the proxy (draining in-flight requests)..."):
            proxy.stop()
    if not keep_running:
        console.print(
            "Kafka and Redis keep running for the next command: `dedup-proxy local down`."
        )
    return 0 if ok else 1


def _show_traffic(proxy: ProxyProcess, upstream: dict[int, str], messages: int) -> bool:
    admin = AdminClient({"bootstrap.servers": proxy.bootstrap})
    cluster = admin.describe_cluster().result(30)
    table = Table(title="What a client sees through the proxy (DescribeCluster)")
    table.add_column("node")
    table.add_column("address through the proxy")
    table.add_column("the broker behind it")
    for node in sorted(cluster.nodes, key=lambda n: n.id):
        table.add_row(str(node.id), f"{node.host}:{node.port}", upstream.get(node.id, "?"))
    console.print(table)

    topic = f"demo-{uuid.uuid4().hex[:8]}"
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=-1)])[topic].result(
        30
    )
    values = [f"message {i}".encode() for i in range(messages)]
    failures: list[str] = []
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    started = time.perf_counter()
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("produce (confluent-kafka) ", total=messages)
        producer = Producer(
            {"bootstrap.servers": proxy.bootstrap, "enable.idempotence": True, "linger.ms": 5}
        )

        def delivered(err: object, _msg: object) -> None:
            if err is not None:
                failures.append(str(err))
            progress.advance(task)

        for value in values:
            producer.produce(topic, value, on_delivery=delivered)
            producer.poll(0)
        producer.flush(60)
        produce_seconds = time.perf_counter() - started

        task = progress.add_task("consume (kafka-python)   ", total=messages)
        consumer = KafkaConsumer(
            topic,
            bootstrap_servers=proxy.bootstrap,
            auto_offset_reset="earliest",
            consumer_timeout_ms=10_000,
            group_id=f"demo-{uuid.uuid4().hex[:8]}",
        )
        received = []
        for record in consumer:
            received.append(record.value)
            progress.advance(task)
            if len(received) == messages:
                break
        consumer.close()

    same = received == values and not failures
    summary = Table(title=f"Topic {topic}, every byte through {proxy.bootstrap}")
    summary.add_column("")
    summary.add_column("result", justify="right")
    summary.add_row("produced and acknowledged", f"{messages - len(failures):,}")
    summary.add_row("produce rate", f"{messages / produce_seconds:,.0f} msg/s")
    summary.add_row("consumed back", f"{len(received):,}")
    summary.add_row("same content, same order", "[green]yes[/]" if same else "[red]NO[/]")
    for api, count in _requests_by_api(proxy.metrics_text()):
        summary.add_row(f"proxy handled {api} requests", f"{count:,.0f}")
    console.print(summary)
    if failures:
        console.print(f"[red]delivery failures:[/] {failures[:5]}")
    return same


def _requests_by_api(metrics_text: str) -> list[tuple[str, float]]:
    pattern = re.compile(r'^dedup_proxy_requests_total\{api="([^"]+)"\} (\S+)$')
    found = [m.groups() for line in metrics_text.splitlines() if (m := pattern.match(line))]
    return sorted(((api, float(count)) for api, count in found), key=lambda item: -item[1])


def _wait_for_interrupt() -> None:
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        console.print()
