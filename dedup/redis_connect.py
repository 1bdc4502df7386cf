"""A Redis client from a URL: one Redis, Redis Sentinel, or Redis Cluster.

- ``redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]``, ``rediss://...`` (TLS), ``unix://...``:
  one Redis, exactly as `redis.asyncio.from_url` reads them.
- ``redis+sentinel://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]/MASTER_NAME[/DB]``: the
  primary the Sentinels name ``MASTER_NAME``. The client asks the Sentinels for the primary's
  address whenever it opens a connection; after a failover its connections to the old
  primary fail (or get READONLY once it is demoted), are dropped, and the next ones go to
  the new primary. The credentials are the data nodes'; the Sentinels are asked without any.
- ``redis+cluster://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]``: a Redis Cluster, found
  from any of these nodes. The client routes each command to its slot's primary and
  re-reads the slot map after a failover.
- ``rediss+sentinel://...`` and ``rediss+cluster://...``: the same over TLS (to the
  Sentinels as to the data nodes), with the ``ssl_*`` arguments given (CA, certificate).

A port left out is Redis's default (6379; 26379 for a Sentinel).

Every client is built without automatic retries: a script sent on a connection that then
failed or timed out may have run, and running the check twice would read a batch's own
records as duplicates. The caller treats such a failure as a failed write instead. The
cluster client still re-reads the slot map after a connection error (redis-py does that
as part of its retries): its pipelines then drop their connections, so the next call
finds the new primary of a slot whose primary failed. A URL in
an error message or a log line has its password masked (`redacted`).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any
from urllib.parse import unquote

import hiredis
import redis.asyncio
import redis.exceptions
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff

# What `DedupState` and `PolicyStore` are given: one Redis (maybe a Sentinel-managed
# primary) or a cluster.
AnyRedis = redis.asyncio.Redis | RedisCluster

SENTINEL_SCHEME = "redis+sentinel"
CLUSTER_SCHEME = "redis+cluster"
SENTINEL_TLS_SCHEME = "rediss+sentinel"
CLUSTER_TLS_SCHEME = "rediss+cluster"
TLS_SCHEMES = ("rediss", SENTINEL_TLS_SCHEME, CLUSTER_TLS_SCHEME)
_SINGLE_SCHEMES = ("redis", "rediss", "unix")
DEFAULT_PORT = 6379
DEFAULT_SENTINEL_PORT = 26379
SENTINEL_TIMEOUT_S = 1.0


def redis_from_url(url: str, **kwargs: Any) -> AnyRedis:
    """The client for `url` (see the module); `kwargs` go to every data connection
    (e.g. ``socket_timeout``). A URL that is none of these raises ValueError."""
    scheme, sep, _ = url.partition("://")
    scheme = scheme.lower()
    if not sep:
        raise ValueError(f"not a Redis URL (no scheme://): {redacted(url)!r}")
    kwargs.setdefault("retry", no_retry())
    if scheme in _SINGLE_SCHEMES:
        return _cancel_safe(redis.asyncio.from_url(url, **kwargs))
    if scheme in TLS_SCHEMES:
        kwargs["ssl"] = True
    if scheme in (SENTINEL_SCHEME, SENTINEL_TLS_SCHEME):
        return _cancel_safe(_sentinel(url, **kwargs))
    if scheme in (CLUSTER_SCHEME, CLUSTER_TLS_SCHEME):
        return _cancel_safe(_cluster(url, **kwargs))
    schemes = (*_SINGLE_SCHEMES, SENTINEL_SCHEME, CLUSTER_SCHEME, *TLS_SCHEMES[1:])
    known = ", ".join(f"{s}://" for s in schemes)
    raise ValueError(
        f"unknown Redis URL scheme {scheme!r} in {redacted(url)!r}: use one of {known}"
    )


def no_retry() -> Retry:
    """A retry policy that never retries (see the module)."""
    return Retry(NoBackoff(), 0)


# The password of USER:PASSWORD@ (or :PASSWORD@) in a URL's authority.
_PASSWORD = re.compile(r"(?P<head>^[^:/]+://[^@/]*?:)(?P<password>[^@/]*)(?=@)")


def redacted(url: str) -> str:
    """`url` with its password, if any, replaced by ``***`` (for logs and messages)."""
    return _PASSWORD.sub(lambda m: m["head"] + ("***" if m["password"] else ""), url, count=1)


def _sentinel(url: str, **kwargs: Any) -> redis.asyncio.Redis:
    netloc, path_text = _split(url)
    path = [unquote(p) for p in path_text.split("/")[1:]]
    if path and path[-1] == "":
        path.pop()  # a trailing slash
    if not 1 <= len(path) <= 2 or not path[0]:
        raise ValueError(
            f"a Sentinel URL names the primary: "
            f"{SENTINEL_SCHEME}://HOST:PORT[,HOST:PORT...]/MASTER_NAME[/DB], not {redacted(url)!r}"
        )
    db = _db(path[1], url) if len(path) == 2 else 0
    hosts = _hosts(netloc, DEFAULT_SENTINEL_PORT, url)
    credentials = _credentials(netloc)
    # The Sentinels get the socket and TLS settings but not the data nodes' credentials; a
    # Sentinel that does not answer within a second (or the given timeout, if shorter) is
    # skipped for the next one.
    sentinel_kwargs = {k: v for k, v in kwargs.items() if k.startswith(("socket_", "ssl"))}
    for timeout in ("socket_timeout", "socket_connect_timeout"):
        sentinel_kwargs[timeout] = min(
            sentinel_kwargs.get(timeout) or SENTINEL_TIMEOUT_S, SENTINEL_TIMEOUT_S
        )
    sentinel = Sentinel(hosts, sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call]
    primary: _SentinelPrimary = sentinel.master_for(
        path[0], redis_class=_SentinelPrimary, db=db, **credentials, **kwargs
    )
    return primary


def _cluster(url: str, **kwargs: Any) -> RedisCluster:
    netloc, path = _split(url)
    if path not in ("", "/", "/0"):
        raise ValueError(
            f"a Redis Cluster has only database 0: "
            f"{CLUSTER_SCHEME}://HOST:PORT[,HOST:PORT...], not {redacted(url)!r}"
        )
    nodes = [ClusterNode(host, port) for host, port in _hosts(netloc, DEFAULT_PORT, url)]
    return _Cluster(startup_nodes=nodes, **_credentials(netloc), **kwargs)


class _Cluster(RedisCluster):
    """A cluster client whose pipelines, on a connection error, forget the connections and
    the slot map (re-read on the next call) and raise, instead of re-sending."""

    def pipeline(
        self, transaction: Any | None = None, shard_hint: Any | None = None
    ) -> ClusterPipeline:
        if shard_hint:
            return super().pipeline(transaction, shard_hint)  # which refuses it
        return _ClusterPipeline(self, transaction)  # type: ignore[abstract]


class _ClusterPipeline(ClusterPipeline):
    async def execute(
        self, raise_on_error: bool = True, allow_redirections: bool = True
    ) -> list[Any]:
        try:
            return await super().execute(raise_on_error, allow_redirections)
        except RedisCluster.ERRORS_ALLOW_RETRY:
            await self.cluster_client.aclose()  # the next call re-reads the slot map
            raise


class _SentinelPrimary(redis.asyncio.Redis):
    """The Sentinel-managed primary's client; closing it also closes its connections to
    the Sentinels."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        pool = self.connection_pool
        if isinstance(pool, SentinelConnectionPool):
            for sentinel in pool.sentinel_manager.sentinels:
                await sentinel.aclose()


class _CancelSafeWrites:
    """Writes bounded by `asyncio.timeout`, not `asyncio.wait_for`.

    redis-py bounds each write with `asyncio.wait_for` when a socket timeout is set. On
    Python 3.11 that loses a cancellation arriving just as the write completes (CPython
    gh-86296, fixed in 3.12): the cancelled task goes on as if nothing happened, so a
    connection being drained never ends and a stopped loop never stops. Reads are already
    bounded with `asyncio.timeout` by redis-py itself.
    """

    socket_timeout: float | None

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        timeout = self.socket_timeout
        if not timeout:
            await super().send_packed_command(command, check_health)  # type: ignore[misc]
            return
        self.socket_timeout = None  # the write below then goes without wait_for
        try:
            async with asyncio.timeout(timeout):
                await super().send_packed_command(command, check_health)  # type: ignore[misc]
        except TimeoutError:  # the connection was dropped on the way (redis-py does that)
            raise redis.exceptions.TimeoutError("Timeout writing to socket") from None
        finally:
            self.socket_timeout = timeout


# Argument types hiredis packs exactly as redis-py's encoder does (utf-8 for str, the
# decimal digits for int). bool is left out (redis-py refuses it), float too (formats differ).
_HIREDIS_PACKS = frozenset({bytes, str, int})


class _HiredisPacking:
    """Commands packed by hiredis's C packer instead of redis-py's Python one.

    redis-py's asyncio connections pack in Python, argument by argument: for the check's
    scripts, with a score of arguments each, that was some 8 % of the proxy's CPU. The
    bytes are the same (``tests/unit/test_redis_connect.py`` compares them); any command
    the C packer would pack differently goes the Python way.
    """

    encoder: Any

    def pack_command(self, *args: Any) -> list[bytes]:
        encoder = self.encoder
        first = args[0] if args else None
        if (
            encoder.encoding == "utf-8"
            and encoder.encoding_errors == "strict"
            and type(first) in (bytes, str)
            and first.isalpha()  # type: ignore[union-attr]  # redis-py splits "CONFIG GET"
            and all(type(arg) in _HIREDIS_PACKS for arg in args)
        ):
            return [hiredis.pack_command(args)]
        return super().pack_command(*args)  # type: ignore[misc, no-any-return]


_PROXY_CLASSES: dict[type, type] = {}


def _proxy_class(connection_class: type) -> type:
    if issubclass(connection_class, _CancelSafeWrites):
        return connection_class
    made = _PROXY_CLASSES.get(connection_class)
    if made is None:
        name = f"Proxy{connection_class.__name__}"
        made = _PROXY_CLASSES[connection_class] = type(
            name, (_CancelSafeWrites, _HiredisPacking, connection_class), {}
        )
    return made


def _cancel_safe(client: AnyRedis) -> AnyRedis:
    """The client, its connections made of `_CancelSafeWrites` and `_HiredisPacking`
    classes (whatever class the URL chose: TCP, TLS, Unix socket, Sentinel-managed, a
    cluster node's)."""
    if isinstance(client, RedisCluster):
        kwargs = client.nodes_manager.connection_kwargs
        kwargs["connection_class"] = _proxy_class(kwargs.get("connection_class", Connection))
        for node in client.nodes_manager.startup_nodes.values():
            node.connection_class = _proxy_class(node.connection_class)
    else:
        pool = client.connection_pool
        pool.connection_class = _proxy_class(pool.connection_class)
    return client


def _split(url: str) -> tuple[str, str]:
    """(netloc, path) of a URL with several hosts, which urllib does not parse."""
    rest = url.partition("://")[2]
    if "?" in rest or "#" in rest:
        raise ValueError(f"query parameters are not supported in {redacted(url)!r}")
    netloc, slash, path = rest.partition("/")
    return netloc, slash + path


def _hosts(netloc: str, default_port: int, url: str) -> list[tuple[str, int]]:
    """HOST[:PORT],HOST[:PORT]... (an IPv6 host in brackets)."""
    hosts = []
    for item in netloc.rpartition("@")[2].split(","):
        item = item.strip()
        if item.startswith("["):
            host, bracket, rest = item[1:].partition("]")
            if not bracket or (rest and not rest.startswith(":")):
                raise ValueError(f"malformed host {item!r} in {redacted(url)!r}")
            port_text = rest[1:]
        else:
            host, _, port_text = item.partition(":")
        if not host:
            raise ValueError(f"a host is missing in {redacted(url)!r}")
        try:
            port = int(port_text) if port_text else default_port
        except ValueError:
            raise ValueError(f"bad port {port_text!r} in {redacted(url)!r}") from None
        if not 0 < port < 65536:
            raise ValueError(f"port {port} out of range in {redacted(url)!r}")
        hosts.append((host, port))
    return hosts


def _credentials(netloc: str) -> dict[str, Any]:
    """USER:PASSWORD@ as redis-py's own URLs read it."""
    userinfo, at, _ = netloc.rpartition("@")
    if not at:
        return {}
    user, colon, password = userinfo.partition(":")
    found: dict[str, Any] = {}
    if user:
        found["username"] = unquote(user)
    if colon and password:
        found["password"] = unquote(password)
    return found


def _db(text: str, url: str) -> int:
    try:
        db = int(text)
    except ValueError:
        raise ValueError(f"bad database number {text!r} in {redacted(url)!r}") from None
    if db < 0:
        raise ValueError(f"bad database number {text!r} in {redacted(url)!r}")
    return db
