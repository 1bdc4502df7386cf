"""`dedup.redis_connect`: which client a URL gives, and the URLs it refuses (no server)."""

from __future__ import annotations

import pytest
import redis.asyncio
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import SSLConnection
from redis.asyncio.sentinel import SentinelConnectionPool, SentinelManagedSSLConnection

from dedup.redis_connect import redacted, redis_from_url


async def test_a_plain_url_is_one_redis_as_from_url_reads_it() -> None:
    client = redis_from_url("redis://:secret@127.0.0.1:6390/4")
    assert type(client) is redis.asyncio.Redis
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["host"], kwargs["port"], kwargs["db"], kwargs["password"]) == (
        "127.0.0.1",
        6390,
        4,
        "secret",
    )
    await client.aclose()


async def test_a_sentinel_url_names_the_sentinels_the_primary_and_the_db() -> None:
    client = redis_from_url("redis+sentinel://user:pw@h1:26380,h2,[::1]:26390/primary/2")
    assert isinstance(client, redis.asyncio.Redis)
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    assert pool.service_name == "primary"
    assert pool.connection_kwargs["db"] == 2
    assert (pool.connection_kwargs["username"], pool.connection_kwargs["password"]) == (
        "user",
        "pw",
    )
    sentinels = [
        (s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
        for s in pool.sentinel_manager.sentinels
    ]
    assert sentinels == [("h1", 26380), ("h2", 26379), ("::1", 26390)]
    # The Sentinels are asked without the data nodes' credentials.
    sentinel_kwargs = pool.sentinel_manager.sentinels[0].connection_pool.connection_kwargs
    assert sentinel_kwargs.get("password") is None
    await client.aclose()


async def test_a_sentinel_url_defaults_to_db_0() -> None:
    client = redis_from_url("redis+sentinel://127.0.0.1:26379/mymaster/")
    assert client.connection_pool.connection_kwargs["db"] == 0
    await client.aclose()


async def test_a_cluster_url_gives_a_cluster_client_with_every_startup_node() -> None:
    client = redis_from_url("redis+cluster://127.0.0.1:7000,127.0.0.1:7001,other")
    assert isinstance(client, RedisCluster)
    assert sorted(client.nodes_manager.startup_nodes) == [
        "127.0.0.1:7000",
        "127.0.0.1:7001",
        "other:6379",
    ]
    await client.aclose()


async def test_tls_urls_give_tls_connections_to_the_sentinels_and_the_data_nodes() -> None:
    tls = {"ssl_ca_certs": "/ca.pem", "ssl_certfile": "/c.pem", "ssl_keyfile": "/k.pem"}
    client = redis_from_url("rediss+sentinel://:pw@h1:26380/primary", **tls)
    pool = client.connection_pool
    assert issubclass(pool.connection_class, SentinelManagedSSLConnection)
    assert pool.connection_kwargs["ssl_ca_certs"] == "/ca.pem"
    sentinel = pool.sentinel_manager.sentinels[0].connection_pool
    assert issubclass(sentinel.connection_class, SSLConnection)
    assert sentinel.connection_kwargs["ssl_certfile"] == "/c.pem"
    assert sentinel.connection_kwargs.get("password") is None
    await client.aclose()
    cluster = redis_from_url("rediss+cluster://:pw@127.0.0.1:7000", **tls)
    assert isinstance(cluster, RedisCluster)
    kwargs = cluster.nodes_manager.connection_kwargs
    assert issubclass(kwargs["connection_class"], SSLConnection)
    assert (kwargs["ssl_keyfile"], kwargs["password"]) == ("/k.pem", "pw")
    await cluster.aclose()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("127.0.0.1:6379", "no scheme"),
        ("http://127.0.0.1", "unknown Redis URL scheme 'http'"),
        ("redis+sentinel://127.0.0.1:26379", "names the primary"),
        ("redis+sentinel://127.0.0.1:26379/", "names the primary"),
        ("redis+sentinel://127.0.0.1:26379/m/1/2", "names the primary"),
        ("redis+sentinel://127.0.0.1:26379/m/x", "bad database number 'x'"),
        ("redis+sentinel://127.0.0.1:x/m", "bad port 'x'"),
        ("redis+sentinel://h:70000/m", "out of range"),
        ("redis+cluster://127.0.0.1:7000/1", "only database 0"),
        ("redis+cluster://127.0.0.1:7000,:7001", "host is missing"),
        ("redis+cluster://[::1:7000", "malformed host"),
        ("redis+cluster://127.0.0.1:7000?timeout=1", "query parameters"),
    ],
)
def test_a_bad_url_is_a_clear_value_error(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        redis_from_url(url)


@pytest.mark.parametrize(
    "url",
    [
        "redis://:hunter2@127.0.0.1:6390/4",
        "redis+sentinel://user:hunter2@h1:26380,h2/primary",
        "redis+cluster://user:hunter2@127.0.0.1:7000,127.0.0.1:7001",
    ],
)
async def test_no_client_retries_a_command_by_itself(url: str) -> None:
    """A script re-sent after a timeout may run twice: every kind of client is built with
    no retry, and with the socket timeouts it is given."""
    client = redis_from_url(url, socket_timeout=1.5, socket_connect_timeout=0.5)
    if isinstance(client, RedisCluster):
        assert client.retry.get_retries() == 0  # the cluster client's own retry (3 by default)
        node = ClusterNode("127.0.0.1", 7000, **client.nodes_manager.connection_kwargs)
        connection = node.acquire_connection()
        assert connection.retry.get_retries() == 0
        assert (connection.socket_timeout, connection.socket_connect_timeout) == (1.5, 0.5)
    else:
        connection = client.connection_pool.make_connection()
        assert connection.retry.get_retries() == 0
        assert (connection.socket_timeout, connection.socket_connect_timeout) == (1.5, 0.5)
        pool = client.connection_pool
        if isinstance(pool, SentinelConnectionPool):  # a Sentinel waits at most 1 s
            sentinel = pool.sentinel_manager.sentinels[0].connection_pool.connection_kwargs
            assert (sentinel["socket_timeout"], sentinel["socket_connect_timeout"]) == (1.0, 0.5)
    await client.aclose()


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:hunter2@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://user:hunter2@h/0", "redis://user:***@h/0"),
        ("rediss://user:hun:ter2@h", "rediss://user:***@h"),
        ("redis+sentinel://u:hunter2@h1:26380,h2/m", "redis+sentinel://u:***@h1:26380,h2/m"),
        ("redis://h:6379/0", "redis://h:6379/0"),
        ("redis://user@h:6379", "redis://user@h:6379"),
        ("unix:///run/redis.sock", "unix:///run/redis.sock"),
    ],
)
def test_a_url_is_shown_without_its_password(url: str, shown: str) -> None:
    assert redacted(url) == shown


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://user:hunter2@127.0.0.1:26379",
        "redis+cluster://user:hunter2@127.0.0.1:7000/1",
        "redis+cluster://user:hunter2@127.0.0.1:x",
        "http://user:hunter2@127.0.0.1",
    ],
)
def test_a_bad_url_error_does_not_show_the_password(url: str) -> None:
    with pytest.raises(ValueError) as raised:
        redis_from_url(url)
    assert "hunter2" not in str(raised.value)
    assert "***" in str(raised.value)
