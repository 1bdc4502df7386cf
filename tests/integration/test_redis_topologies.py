"""Redis that is not one process: the dedup state through Sentinel and on a Redis Cluster.

Real processes (`deploy.local_redis`, on the fixed ports of `tests.support.ports`): a primary
with two replicas and three Sentinels, and a six-node Redis Cluster, beside the session's
single Redis and Kafka. First the state's scripts and the policies give the same answers on
all three; then a producer writes through a real proxy while the Redis node serving its
partition is SIGKILLed: the producer carries on, and Kafka holds every acknowledged record
exactly once, in order. The failovers run again on both topologies secured: TLS only
everywhere (clients, replication, the cluster bus, the Sentinels), client certificates and
a password.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from dedup.policies import Mode, PolicyStore
from dedup.redis_connect import AnyRedis, redis_from_url
from dedup.state import DedupState, PartitionCheck
from deploy.launcher import ProxyProcess
from deploy.local import EnvInfo
from deploy.local_redis import LocalRedis, LocalRedisError, RedisTls
from deploy.tls import LocalTls
from tests.support.kafka_io import assert_exactly_once_in_order, values
from tests.support.load import SequencedProducer
from tests.support.ports import (
    CLUSTER_REDIS,
    REDIS_TOPOLOGY_PROXY,
    SENTINEL_REDIS,
    TLS_CLUSTER_REDIS,
    TLS_SENTINEL_REDIS,
)
from tests.support.topics import new_topic
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration

TOPOLOGIES = ("single", "sentinel", "cluster")


@pytest.fixture(scope="module")
def topologies(
    tmp_path_factory: pytest.TempPathFactory, local_env: EnvInfo
) -> Iterator[dict[str, LocalRedis]]:
    """The sentinel and cluster topologies of this module, started together; the single
    Redis is the session's. Stopped (and their files left in tmp) at the end."""
    home = tmp_path_factory.mktemp("redis-topologies")
    yield from running(
        {
            "sentinel": LocalRedis(home, SENTINEL_REDIS, "sentinel"),
            "cluster": LocalRedis(home, CLUSTER_REDIS, "cluster"),
        }
    )


@pytest.fixture(scope="module")
def tls_topologies(
    tmp_path_factory: pytest.TempPathFactory, local_env: EnvInfo
) -> Iterator[dict[str, LocalRedis]]:
    """Both topologies again, on TLS only, with client certificates and a password."""
    home = tmp_path_factory.mktemp("redis-tls-topologies")
    certs = LocalTls(Path(local_env.tls_dir))
    tls = RedisTls.of(certs, "topologies-password-0123456789")
    yield from running(
        {
            "sentinel": LocalRedis(home, TLS_SENTINEL_REDIS, "sentinel", tls),
            "cluster": LocalRedis(home, TLS_CLUSTER_REDIS, "cluster", tls),
        }
    )


def running(topologies: dict[str, LocalRedis]) -> Iterator[dict[str, LocalRedis]]:
    try:
        for local in topologies.values():
            local.start()
        deadline = time.monotonic() + 90
        for local in topologies.values():
            local.wait_ready(deadline)
        yield topologies
    finally:
        for local in topologies.values():
            local.stop()


def url_of(topology: str, topologies: dict[str, LocalRedis], local_env: EnvInfo) -> str:
    return local_env.redis if topology == "single" else topologies[topology].url


@pytest_asyncio.fixture(loop_scope="function")
async def clients(
    topologies: dict[str, LocalRedis], local_env: EnvInfo
) -> AsyncIterator[dict[str, AnyRedis]]:
    made = {t: redis_from_url(url_of(t, topologies, local_env)) for t in TOPOLOGIES}
    yield made
    for client in made.values():
        await client.aclose()


def test_the_urls_name_the_topologies(topologies: dict[str, LocalRedis]) -> None:
    assert topologies["sentinel"].url == (
        "redis+sentinel://127.0.0.1:16889,127.0.0.1:16890,127.0.0.1:16891/dedup/0"
    )
    assert topologies["cluster"].url.startswith("redis+cluster://127.0.0.1:16979,")


async def state_transcript(client: AnyRedis) -> list[Any]:
    """Every DedupState call the product makes, on a fresh prefix; what each answered."""
    state = DedupState(client, key_prefix=f"topo-{uuid.uuid4().hex[:8]}", max_producers=3)
    out: list[Any] = []
    await state.load_recovered("orders", 0, {"a": (5, 900)}, token="t1", now_ms=1_000)
    out.append(
        await state.check_and_push(
            [
                PartitionCheck("orders", 0, [("a", 5), ("a", 6), ("b", 1), ("b", 1)], "t1"),
                PartitionCheck("orders", 1, [("a", 1), ("c", 7)]),
                PartitionCheck("logs", 3, [("c", 1)]),
                PartitionCheck("orders", 2, [("a", 1)], token="missing"),
            ],
            2_000,
        )
    )
    out.append(
        await state.mark_persisted(
            [("orders", 0, {"a": 6, "b": 1}), ("logs", 3, {"c": 1}), ("orders", 2, {"a": 1})],
            3_000,
            tokens=["t1", None, "missing"],
        )
    )
    # Unknown while in flight, then a reset: the retry is new.
    out.append(await state.check_and_push([PartitionCheck("orders", 1, [("c", 7)])], 3_500))
    out.append(await state.reset_pushed("orders", 1))
    out.append(await state.check_and_push([PartitionCheck("orders", 1, [("c", 7)])], 3_600))
    # Eviction at max_producers (3).
    out.append(
        await state.check_and_push([PartitionCheck("orders", 0, [("d", 1), ("e", 1)], "t1")], 4_000)
    )
    out.append(await state.producers("orders", 0))
    out.append(await state.producers("orders", 1))
    out.append(await state.recovered_state("orders", 0, "t1"))
    out.append(await state.recovered_view("orders", 0, "t1"))
    out.append(await state.recovered_state("orders", 0, "another"))
    out.append(await state.last_sequence("orders", 0, "a"))
    out.append(await state.last_sequence("orders", 0, "nobody"))
    out.append(await state.partitions("orders"))
    out.append(await state.partitions("logs"))
    out.append(await state.topics())
    out.append(await state.purge_idle("orders", 1, 3_550))
    await state.load_persisted("logs", 4, {"x": 10}, 5_000)
    out.append(await state.producers("logs", 4))
    # A flushed script cache (a restarted or promoted node): the scripts are loaded again.
    await client.script_flush()
    out.append(await state.check_and_push([PartitionCheck("logs", 4, [("x", 11)])], 6_000))
    await state.clear("orders", 1)
    out.append(await state.partitions("orders"))
    out.append(await state.topics())
    await state.clear("logs")
    out.append(await state.partitions("logs"))
    out.append(await state.topics())
    await state.clear("orders")
    out.append(await state.topics())
    return out


async def policy_transcript(client: AnyRedis) -> list[Any]:
    store = PolicyStore(client, Mode.ENABLED, key_prefix=f"topo-{uuid.uuid4().hex[:8]}")
    out: list[Any] = [(await store.snapshot(fresh=True)).to_json()]
    await store.set_global(Mode.DISABLED)
    await store.set_prefix("pay.", Mode.REQUIRE)
    await store.set_topic("pay.refunds", Mode.ENABLED)
    await store.set_topic("logs", Mode.DISABLED)
    out.append((await store.snapshot(fresh=True)).to_json())
    out.append([await store.mode_for(t) for t in ("pay.x", "pay.refunds", "logs", "other")])
    await store.set_topic("logs", None)
    await store.set_global(None)
    out.append((await store.snapshot(fresh=True)).to_json())
    return out


async def test_state_and_policies_answer_the_same_on_every_topology(
    clients: dict[str, AnyRedis],
) -> None:
    answers = {t: await state_transcript(client) for t, client in clients.items()}
    single = answers["single"]
    assert single[-1] == [] and single[15] == ["logs", "orders"]  # the transcript did run
    assert answers["sentinel"] == single
    assert answers["cluster"] == single
    policies = {t: await policy_transcript(client) for t, client in clients.items()}
    assert policies["sentinel"] == policies["single"]
    assert policies["cluster"] == policies["single"]


# --- failover under load, through the proxy -------------------------------------------------


def topology_proxy(local: LocalRedis, prefix: str, log: Path, local_env: EnvInfo) -> ProxyProcess:
    env = {"DEDUP_PROXY_REDIS": local.url, "DEDUP_PROXY_REDIS_KEY_PREFIX": prefix}
    if local.tls is not None:
        env |= {
            "DEDUP_PROXY_REDIS_TLS_CA_FILE": str(local.tls.ca_file),
            "DEDUP_PROXY_REDIS_TLS_CERT_FILE": str(local.tls.client_cert_file),
            "DEDUP_PROXY_REDIS_TLS_KEY_FILE": str(local.tls.client_key_file),
        }
    return ProxyProcess(
        upstream=local_env.bootstrap,
        listen_port=REDIS_TOPOLOGY_PROXY.listen,
        admin_port=REDIS_TOPOLOGY_PROXY.admin,
        extra_args=["--broker-port-base", str(REDIS_TOPOLOGY_PROXY.broker_base)],
        env=env,
        log_path=log,
    ).start()


def write_through_a_failover(
    local: LocalRedis, local_env: EnvInfo, tmp_path: Path, total: int = 20_000
) -> None:
    """A DedupProducer writes 0..total-1 through the proxy; once a quarter is acknowledged,
    the Redis node serving the partition's keys is SIGKILLed, and the producer goes on
    until another node serves them. Every record must end up acknowledged, and Kafka must
    hold each exactly once, in order. With the maps in the owner's memory the producer
    does not wait for Redis (the acknowledged copy and the lease renewals do, and a new
    primary that lost the copy's latest writes has the partition recovered), so the load
    is long enough to outlast the failover."""
    prefix = f"fo-{uuid.uuid4().hex[:8]}"
    topic = new_topic(local_env.bootstrap)
    proxy = topology_proxy(local, prefix, tmp_path / "proxy.log", local_env)
    try:
        producer = SequencedProducer(
            proxy.bootstrap, topic, f"p-{local.topology}", total, per_second=2000
        ).start()
        producer.wait_delivered(total // 4)
        key = f"{prefix}:{{{topic}/0}}:pushed"
        victim = local.owner(key)
        assert local.kill(victim)
        killed_at = time.monotonic()
        wait_until(lambda: _owner_other_than(local, key, victim), 60, "a failover")
        assert producer.running, "the load ended before the failover: make it longer"
        producer.join(timeout_s=120)
        took = time.monotonic() - killed_at
    finally:
        assert proxy.stop() == 0, f"proxy did not shut down cleanly; see {tmp_path}"
        log = (tmp_path / "proxy.log").read_text()
    if local.tls is not None:
        assert local.tls.password not in log, "the Redis password reached the log"
    assert_exactly_once_in_order(values(local_env.bootstrap, topic), total)
    print(f"{local.topology}: node {victim} killed; the producer finished {took:.1f}s later")


def _owner_other_than(local: LocalRedis, key: str, victim: int) -> bool:
    """Whether a node other than `victim` serves `key` (none may answer mid-failover)."""
    try:
        return local.owner(key) != victim
    except LocalRedisError:
        return False


def test_sentinel_primary_killed_under_load(
    topologies: dict[str, LocalRedis], local_env: EnvInfo, tmp_path: Path
) -> None:
    write_through_a_failover(topologies["sentinel"], local_env, tmp_path)


def test_cluster_slot_owner_killed_under_load(
    topologies: dict[str, LocalRedis], local_env: EnvInfo, tmp_path: Path
) -> None:
    write_through_a_failover(topologies["cluster"], local_env, tmp_path)


def test_the_tls_urls_name_the_topologies(tls_topologies: dict[str, LocalRedis]) -> None:
    assert tls_topologies["sentinel"].url == (
        "rediss+sentinel://:topologies-password-0123456789@"
        "127.0.0.1:17189,127.0.0.1:17190,127.0.0.1:17191/dedup/0"
    )
    assert tls_topologies["cluster"].url.startswith(
        "rediss+cluster://:topologies-password-0123456789@127.0.0.1:17479,"
    )


def test_tls_sentinel_primary_killed_under_load(
    tls_topologies: dict[str, LocalRedis], local_env: EnvInfo, tmp_path: Path
) -> None:
    write_through_a_failover(tls_topologies["sentinel"], local_env, tmp_path)


def test_tls_cluster_slot_owner_killed_under_load(
    tls_topologies: dict[str, LocalRedis], local_env: EnvInfo, tmp_path: Path
) -> None:
    write_through_a_failover(tls_topologies["cluster"], local_env, tmp_path)
