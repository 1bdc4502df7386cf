"""`dedup.redis_connect`: which client a URL gives, and the URLs it refuses (no server)."""

from __future__ import annotations

from typing import Any

import hiredis
import pytest
import redis.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection, SSLConnection
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


# Arguments of the kinds the proxy's commands carry, and the kinds hiredis packs otherwise.
_ARGUMENTS = st.one_of(
    st.binary(max_size=64),
    st.text(max_size=32),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.booleans(),
    st.binary(max_size=16).map(memoryview),
)
_COMMAND_NAMES = st.sampled_from([b"EVALSHA", "EVALSHA", "CONFIG GET", b"SCRIPT LOAD", "GET"])


def _packed_by(connection: Any, args: tuple[Any, ...]) -> bytes | type[Exception]:
    try:
        return b"".join(bytes(chunk) for chunk in connection.pack_command(*args))
    except Exception as exc:  # both must refuse the same arguments
        return type(exc)


@pytest.mark.parametrize(
    "url",
    ["redis://127.0.0.1:6390", "rediss://h:6390", "unix:///tmp/r.sock", "redis+sentinel://h/p"],
)
@settings(max_examples=300, deadline=None)
@given(name=_COMMAND_NAMES, args=st.lists(_ARGUMENTS, max_size=24))
def test_commands_are_packed_to_the_bytes_redis_py_packs(
    url: str, name: bytes | str, args: list[Any]
) -> None:
    client: Any = redis_from_url(url)
    connection_class = client.connection_pool.connection_class
    proxy_connection = connection_class(**client.connection_pool.connection_kwargs)
    reference = Connection()
    command = (name, *args)
    assert _packed_by(proxy_connection, command) == _packed_by(reference, command)


def test_the_proxy_connections_pack_with_hiredis(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a silent fallback: the scripts' usual arguments take the C packer, and a
    cluster node's connections do too."""
    packed: list[tuple[Any, ...]] = []
    pack = hiredis.pack_command

    def spy(args: tuple[Any, ...]) -> bytes:
        packed.append(args)
        return bytes(pack(args))

    monkeypatch.setattr(hiredis, "pack_command", spy)
    client: Any = redis_from_url("redis://127.0.0.1:6390")
    connection = client.connection_pool.connection_class()
    command = (b"EVALSHA", "a" * 40, 2, "key:1", b"\x00\xff", -7)
    assert connection.pack_command(*command) == [pack(command)]
    cluster: Any = redis_from_url("redis+cluster://127.0.0.1:7000")
    node = next(iter(cluster.nodes_manager.startup_nodes.values()))
    node.connection_class(host="127.0.0.1", port=7000).pack_command(b"GET", "k")
    assert packed == [command, (b"GET", "k")]
