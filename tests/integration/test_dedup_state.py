"""The dedup state (`dedup.state`) against a real Redis: Pulsar's scenarios at the state level,
the per-record rules, eviction, purge, recovery, 64-bit boundaries, one round trip per call,
races between two proxies, and a property test of the Lua scripts against a Python model.

This module runs its own throwaway redis-server (`tests.support.ports.DEDUP_STATE_REDIS`), not
the shared local environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import redis
import redis.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError
from redis.retry import Retry

from dedup.chunks import ChunkProgress
from dedup.held_connection import HeldConnection
from dedup.ownership.leases import Granted, Held, PartitionLeases
from dedup.policies import Mode, PolicyStore
from dedup.state import (
    SEQUENCE_MAX,
    SEQUENCE_MIN,
    CheckEncoding,
    DedupState,
    PartitionCheck,
    PartitionVerdict,
    ProducerState,
    RunIdentities,
    Script,
    Status,
    check_runs,
)
from tests.support.ports import DEDUP_STATE_REDIS as REDIS_PORT
from tests.support.ports import POLICY_OUTAGE_REDIS

pytestmark = pytest.mark.integration

NOT_DUP, DUP, UNKNOWN = Status.NOT_DUP, Status.DUP, Status.UNKNOWN


@pytest.fixture(scope="module")
def redis_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A private redis-server for this module, killed at the end."""
    with redis_server(REDIS_PORT, tmp_path_factory.mktemp("dedup-redis")):
        yield REDIS_PORT


@contextlib.contextmanager
def redis_server(port: int, data: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A bare redis-server on ``port``, answering PING; terminated on the way out."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (deploy/setup.sh installs it)", pytrace=False)
    log = (data / "redis.log").open("wb")
    server = subprocess.Popen(
        [
            *(binary, "--port", str(port), "--bind", "127.0.0.1"),
            *("--save", "", "--appendonly", "no", "--dir", str(data)),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_for_ping(server, port, data / "redis.log")
        yield server
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
        log.close()


def _wait_for_ping(server: subprocess.Popen[bytes], port: int, log: Path) -> None:
    client = redis.Redis(port=port, socket_connect_timeout=1)
    deadline = time.monotonic() + 20
    try:
        while True:
            if server.poll() is not None:
                pytest.fail(f"redis-server exited: {log.read_text()}", pytrace=False)
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"redis-server did not answer PING: {log.read_text()}")
            time.sleep(0.05)
    finally:
        client.close()


@pytest_asyncio.fixture(loop_scope="function")
async def client(redis_port: int) -> AsyncIterator[redis.asyncio.Redis]:
    connection = redis.asyncio.Redis(port=redis_port)
    yield connection
    await connection.aclose()


@pytest.fixture
def state(client: redis.asyncio.Redis) -> DedupState:
    return DedupState(client, key_prefix=fresh_prefix())


def fresh_prefix() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


async def check(
    state: DedupState,
    identities: Sequence[tuple[str, int]],
    now_ms: int = 1_000,
    topic: str = "orders",
    partition: int = 0,
) -> PartitionVerdict:
    (verdict,) = await state.check_and_push([PartitionCheck(topic, partition, identities)], now_ms)
    return verdict


async def persist(
    state: DedupState,
    persisted: Mapping[str, int],
    now_ms: int = 1_000,
    topic: str = "orders",
    partition: int = 0,
) -> None:
    await state.mark_persisted([(topic, partition, persisted)], now_ms)


async def maps(
    state: DedupState, topic: str = "orders", partition: int = 0
) -> tuple[dict[str, int], dict[str, int]]:
    """(pushed, persisted) of a partition."""
    producers = await state.producers(topic, partition)
    pushed = {p: s.pushed for p, s in producers.items() if s.pushed is not None}
    persisted = {p: s.persisted for p, s in producers.items() if s.persisted is not None}
    return pushed, persisted


def seq(producer: str, sequences: Iterable[int]) -> list[tuple[str, int]]:
    return [(producer, s) for s in sequences]


# -- Pulsar's scenarios, at the state level ---------------------------------------------------


async def test_resend_after_persisted_is_dup(state: DedupState) -> None:
    first = await check(state, seq("p", [0, 1, 2]))
    assert first.statuses == (NOT_DUP, NOT_DUP, NOT_DUP)
    assert not first.refused and first.evicted == ()
    await persist(state, {"p": 2})
    again = await check(state, seq("p", [1, 2]))
    assert again.statuses == (DUP, DUP) and not again.refused
    assert await state.last_sequence("orders", 0, "p") == 2


async def test_pushed_but_not_persisted_is_unknown_and_refused_batch_changes_nothing(
    state: DedupState,
) -> None:
    await check(state, seq("p", [0, 1, 2]), now_ms=1_000)
    await persist(state, {"p": 0}, now_ms=1_000)
    before = await state.producers("orders", 0)
    # 1 and 2 were pushed, not acknowledged: Unknown. The new record (3) and the new producer
    # (q) of the same batch are refused with it.
    verdict = await check(state, [("p", 3), ("p", 1), ("q", 0)], now_ms=5_000)
    assert verdict.statuses == (NOT_DUP, UNKNOWN, NOT_DUP)
    assert verdict.refused
    assert await state.producers("orders", 0) == before  # pushed, persisted, last seen
    # Once acknowledged, the retry is a duplicate and the rest goes through.
    await persist(state, {"p": 2})
    retry = await check(state, [("p", 3), ("p", 1), ("q", 0)])
    assert retry.statuses == (NOT_DUP, DUP, NOT_DUP)
    assert await maps(state) == ({"p": 3, "q": 0}, {"p": 2})


async def test_discontinuous_sequence_ids(state: DedupState) -> None:
    first = await check(state, seq("p", [2, 3, 5]))
    await persist(state, {"p": 5})
    second = await check(state, seq("p", [2, 4, 6]))
    assert first.statuses == (NOT_DUP, NOT_DUP, NOT_DUP)
    assert second.statuses == (DUP, DUP, NOT_DUP)  # a hole below the high mark is never filled
    assert (first.statuses + second.statuses).count(NOT_DUP) == 4


# -- the per-record rules ---------------------------------------------------------------------


async def test_lower_sequence_inside_one_batch_is_dup_not_unknown(state: DedupState) -> None:
    assert (await check(state, [("p", 3), ("p", 1), ("p", 3)])).statuses == (NOT_DUP, DUP, DUP)
    await persist(state, {"p": 3})
    verdict = await check(state, [("p", 7), ("p", 6), ("p", 8), ("p", 8), ("p", 2)])
    assert verdict.statuses == (NOT_DUP, DUP, NOT_DUP, DUP, DUP)
    assert await maps(state) == ({"p": 8}, {"p": 3})


async def test_in_batch_rule_does_not_hide_an_earlier_unacknowledged_push(
    state: DedupState,
) -> None:
    await check(state, seq("p", [0, 5]))
    await persist(state, {"p": 3})
    # 6 raises pushed inside the batch, but 5 was pushed by an EARLIER batch: Unknown.
    verdict = await check(state, seq("p", [6, 5]))
    assert verdict.statuses == (NOT_DUP, UNKNOWN) and verdict.refused
    assert await maps(state) == ({"p": 5}, {"p": 3})


async def test_mixed_batch_keeps_only_the_new_records(state: DedupState) -> None:
    await check(state, seq("p", [1, 2, 3]))
    await persist(state, {"p": 3})
    verdict = await check(state, [("p", 2), ("p", 3), ("p", 4), ("q", 0), ("p", 4), ("q", 1)])
    assert verdict.statuses == (DUP, DUP, NOT_DUP, NOT_DUP, DUP, NOT_DUP)
    assert await maps(state) == ({"p": 4, "q": 1}, {"p": 3})


async def test_reset_pushed_makes_failed_writes_new_again(state: DedupState) -> None:
    await check(state, [*seq("p", range(5)), ("r", 7)])
    await persist(state, {"p": 2})
    assert (await check(state, seq("p", [3]))).refused
    await state.reset_pushed("orders", 0)
    assert await maps(state) == ({"p": 2}, {"p": 2})  # r: never persisted, no pushed either
    assert (await check(state, [("p", 2), ("p", 3), ("r", 7)])).statuses == (DUP, NOT_DUP, NOT_DUP)


async def test_mark_persisted_takes_the_max_and_keeps_pushed_at_least_persisted(
    state: DedupState,
) -> None:
    await check(state, seq("p", [10]), partition=0)
    await check(state, seq("p", [20]), partition=1)
    await state.mark_persisted([("orders", 0, {"p": 10}), ("orders", 1, {"p": 20})], 1_000)
    await state.mark_persisted([("orders", 0, {"p": 4}), ("orders", 1, {"p": 19})], 1_000)
    assert await state.last_sequence("orders", 0, "p") == 10
    assert await state.last_sequence("orders", 1, "p") == 20
    # An acknowledgement above pushed (after a reset, or for an evicted producer) raises pushed.
    await state.reset_pushed("orders", 0)
    await persist(state, {"p": 12, "new": -5})
    assert await maps(state) == ({"p": 12, "new": -5}, {"p": 12, "new": -5})
    assert (await check(state, [("p", 12), ("new", -5), ("new", -4)])).statuses == (
        DUP,
        DUP,
        NOT_DUP,
    )
    assert await state.last_sequence("orders", 0, "nobody") == -1


# -- eviction, purge, clear, recovery ---------------------------------------------------------


async def test_eviction_at_max_producers_drops_the_least_recently_seen(
    client: redis.asyncio.Redis,
) -> None:
    state = DedupState(client, key_prefix=fresh_prefix(), max_producers=3)
    for now, producer in enumerate(["a", "b", "c"], start=1):
        assert (await check(state, [(producer, 0)], now_ms=now)).evicted == ()
    await persist(state, {"a": 0}, now_ms=1)
    assert (await check(state, [("d", 0)], now_ms=4)).evicted == ("a",)
    assert sorted(await state.producers("orders", 0)) == ["b", "c", "d"]
    assert await state.last_sequence("orders", 0, "a") == -1  # gone from persisted too
    await persist(state, {"b": 0}, now_ms=2)
    # Touching b makes c the least recently seen, even by a DUP-only batch.
    assert (await check(state, [("b", 0)], now_ms=5)).statuses == (DUP,)
    await persist(state, {"c": 0, "d": 0}, now_ms=3)  # acknowledged: nothing in flight
    verdict = await check(state, [("e", 0), ("f", 0)], now_ms=6)
    assert verdict.evicted == ("c", "d")
    producers = await state.producers("orders", 0)
    assert producers == {
        "b": ProducerState(0, 0, 5),
        "e": ProducerState(0, None, 6),
        "f": ProducerState(0, None, 6),
    }
    # A refused batch evicts nobody.
    assert (await check(state, [("g", 0), ("e", 0)], now_ms=7)).statuses == (NOT_DUP, UNKNOWN)
    assert await state.producers("orders", 0) == producers


async def test_eviction_steps_over_a_producer_with_a_write_in_flight(
    client: redis.asyncio.Redis,
) -> None:
    """Evicted with a write in flight, a producer's retry would read as new and be written
    twice: an idle producer whose writes are all acknowledged goes instead, or, if none is
    left, nobody (the table stays over its bound until the acknowledgements come)."""
    state = DedupState(client, key_prefix=fresh_prefix(), max_producers=2)
    await check(state, [("busy", 0)], now_ms=1)  # pushed, not yet acknowledged
    await check(state, [("idle", 0)], now_ms=2)
    await persist(state, {"idle": 0}, now_ms=2)
    assert (await check(state, [("new", 0)], now_ms=3)).evicted == ("idle",)
    assert (await check(state, [("busy", 0)], now_ms=4)).statuses == (UNKNOWN,), "not new"
    assert (await check(state, [("newer", 0)], now_ms=5)).evicted == ()
    assert sorted(await state.producers("orders", 0)) == ["busy", "new", "newer"]
    await persist(state, {"busy": 0, "new": 0}, now_ms=5)
    assert (await check(state, [("newest", 0)], now_ms=6)).evicted == ("busy", "new")


async def test_eviction_never_takes_a_producer_of_the_batch(client: redis.asyncio.Redis) -> None:
    state = DedupState(client, key_prefix=fresh_prefix(), max_producers=2)
    await check(state, [("a", 0)], now_ms=100)
    await check(state, [("b", 0)], now_ms=200)
    await persist(state, {"a": 0, "b": 0}, now_ms=1)  # acknowledged: nothing in flight
    # This proxy's clock is behind: a and c end up the oldest, yet they are in the batch.
    verdict = await check(state, [("a", 1), ("c", 0)], now_ms=50)
    assert verdict.evicted == ("b",)
    producers = await state.producers("orders", 0)
    assert producers == {"a": ProducerState(1, 0, 100), "c": ProducerState(0, None, 50)}


async def test_purge_idle(state: DedupState) -> None:
    for now, producer in [(100, "a"), (200, "b"), (300, "c")]:
        await check(state, [(producer, 1)], now_ms=now)
        await persist(state, {producer: 1}, now_ms=now)
    assert await state.purge_idle("orders", 0, older_than_ms=200) == ["a"]
    assert await state.purge_idle("orders", 0, older_than_ms=200) == []
    assert sorted(await state.producers("orders", 0)) == ["b", "c"]
    assert await state.last_sequence("orders", 0, "a") == -1
    assert (await check(state, [("a", 0)])).statuses == (NOT_DUP,)  # a fresh producer again


async def test_partitions_and_clear(state: DedupState) -> None:
    await state.check_and_push(
        [PartitionCheck("orders", p, [("p", p)]) for p in (0, 2, 5)]
        + [PartitionCheck("other", 0, [("p", 1)])],
        1_000,
    )
    assert await state.partitions("orders") == [0, 2, 5]
    assert await state.partitions("missing") == []
    await state.clear("orders", 2)
    assert await state.partitions("orders") == [0, 5]
    assert await state.producers("orders", 2) == {}
    assert (await check(state, [("p", 2)], partition=2)).statuses == (NOT_DUP,)
    await state.clear("orders")
    assert await state.partitions("orders") == []
    for partition in (0, 2, 5):
        assert await state.producers("orders", partition) == {}
    assert await state.partitions("other") == [0]  # another topic is untouched
    assert await state.last_sequence("other", 0, "p") == -1  # pushed, never persisted
    assert (await check(state, [("p", 1)], topic="other")).statuses == (UNKNOWN,)


async def test_topics_lists_the_topics_with_state(client: redis.asyncio.Redis) -> None:
    base = fresh_prefix()
    state = DedupState(client, key_prefix=f"{base}-*")  # a glob character, taken literally
    neighbour = DedupState(client, key_prefix=f"{base}-other")
    assert await state.topics() == []
    await state.check_and_push([PartitionCheck(t, 1, [("p", 1)]) for t in ("b.v2_x-1", "a")], 1)
    await state.load_persisted("c", 0, {"p": 1}, 1)
    await neighbour.check_and_push([PartitionCheck("n", 0, [("p", 1)])], 1)
    assert await state.topics() == ["a", "b.v2_x-1", "c"]
    await state.clear("a")
    assert await state.topics() == ["b.v2_x-1", "c"]
    assert await neighbour.topics() == ["n"]


async def test_partitions_skips_partitions_whose_state_is_gone(state: DedupState) -> None:
    await check(state, [("p", 1)], partition=3)
    await check(state, [("p", 1)], partition=4, now_ms=1)
    assert await state.purge_idle("orders", 4, older_than_ms=2) == ["p"]
    assert await state.partitions("orders") == [3]


async def test_load_persisted_replaces_both_maps(state: DedupState) -> None:
    await check(state, [("x", 5), ("y", 5)], now_ms=100)
    await check(state, [("y", 9)], now_ms=200)
    await state.load_persisted("orders", 0, {"y": 7, "z": 3}, now_ms=900)
    assert await state.producers("orders", 0) == {
        "y": ProducerState(7, 7, 200),  # keeps its last-seen time
        "z": ProducerState(3, 3, 900),
    }
    assert await state.partitions("orders") == [0]
    verdict = await check(state, [("y", 7), ("y", 8), ("z", 3), ("x", 1)])
    assert verdict.statuses == (DUP, NOT_DUP, DUP, NOT_DUP)
    await state.load_persisted("orders", 0, {}, now_ms=1_000)
    assert await state.producers("orders", 0) == {}


async def test_a_recovered_partition_is_listed_and_its_checks_add_no_registry_command(
    state: DedupState, client: redis.asyncio.Redis
) -> None:
    """The registry of partitions with state (`partitions`, `topics`) is written where a
    partition's state is made: by its recovery, or by an unguarded check. A check or a
    persist under the recovery token sends no SADD (two commands a Produce request)."""

    async def sadds() -> int:
        stats = await client.info("commandstats")
        return int(stats.get("cmdstat_sadd", {}).get("calls", 0))

    await state.load_recovered("orders", 3, {"p": (4, 500)}, "token-1", now_ms=900)
    assert await state.partitions("orders") == [3]
    assert "orders" in await state.topics()
    before = await sadds()
    checked = await state.check_and_push(
        [PartitionCheck("orders", 3, [("p", 5), ("p", 6)], "token-1")], 1_000
    )
    assert checked[0].statuses == (NOT_DUP, NOT_DUP)
    assert await state.mark_persisted([("orders", 3, {"p": 6})], 1_000, ["token-1"]) == []
    assert await sadds() == before
    await check(state, [("q", 1)], partition=4)  # unguarded: it notes its partition
    assert await sadds() > before
    assert await state.partitions("orders") == [3, 4]


@pytest.mark.parametrize("base", [0, 10**15], ids=["runs", "beyond-exact-lua-numbers"])
async def test_checks_of_one_partition_in_one_call_each_see_the_one_before(
    state: DedupState, base: int
) -> None:
    """Requests checked together (`dedup.group_check`) name a partition several times in
    one call: each check sees what the ones before it pushed, as if sent one by one. With
    sequences a Lua number cannot hold exactly, a run overlapping pushed would be answered
    "expand" and re-sent after the later check: such checks go record by record instead."""
    (first,) = await state.check_and_push(
        [PartitionCheck("orders", 7, RunIdentities([("p", base + 1, base + 3, 3)]))], 1_000
    )
    assert first.statuses == (NOT_DUP,) * 3
    overlapping = RunIdentities([("p", base + 2, base + 5, 4)])  # 2, 3 pushed, not persisted
    above = RunIdentities([("p", base + 4, base + 6, 3)])
    a, b = await state.check_and_push(
        [PartitionCheck("orders", 7, overlapping), PartitionCheck("orders", 7, above)], 1_001
    )
    assert a.statuses == (UNKNOWN, UNKNOWN, NOT_DUP, NOT_DUP) and a.refused, "pushes nothing"
    assert b.statuses == (NOT_DUP,) * 3
    assert (await state.producers("orders", 7))["p"].pushed == base + 6


async def test_the_recovery_token_detects_a_flushed_or_replaced_state(
    state: DedupState, redis_port: int
) -> None:
    await state.load_recovered("orders", 0, {"p": (4, 500)}, "token-1", now_ms=900)
    assert await state.producers("orders", 0) == {"p": ProducerState(4, 4, 500)}
    assert await state.recovered_view("orders", 0, "token-1") == {"p": (4, 500)}
    checked = await state.check_and_push(
        [PartitionCheck("orders", 0, [("p", 4), ("p", 5)], "token-1")], 1_000
    )
    assert checked[0].statuses == (DUP, NOT_DUP) and not checked[0].lost
    assert await state.mark_persisted([("orders", 0, {"p": 5})], 1_000, ["token-1"]) == []
    # Another recovery (or another Redis) holds the partition now: nothing is trusted.
    await state.load_recovered("orders", 0, {"p": (5, 600)}, "token-2", now_ms=900)
    stale = await state.check_and_push([PartitionCheck("orders", 0, [("p", 9)], "token-1")], 1_000)
    assert stale[0].lost and stale[0].refused and stale[0].statuses == ()
    assert await state.mark_persisted([("orders", 0, {"p": 9})], 1_000, ["token-1"]) == [0]
    assert not await state.reset_pushed("orders", 0, "token-1")
    assert await state.recovered_view("orders", 0, "token-1") is None
    assert await state.producers("orders", 0) == {"p": ProducerState(5, 5, 1_000)}, "unchanged"
    # A flushed Redis holds no token at all.
    redis.Redis(port=redis_port).flushdb()
    (lost,) = await state.check_and_push([PartitionCheck("orders", 0, [("p", 1)], "token-2")], 1)
    assert lost.lost
    assert await state.producers("orders", 0) == {}, "a lost check writes nothing"


async def test_a_redis_that_comes_back_without_its_latest_writes_is_found_out(
    state: DedupState, client: redis.asyncio.Redis
) -> None:
    """A failover to a replica that lagged: the partition's keys go back to an earlier copy,
    token included. The calls its owner saw succeed since are missing there: lost."""
    await state.load_recovered("orders", 0, {"p": (4, 500)}, "token-1", now_ms=900)
    keys = state.partition_keys("orders", 0)[:6]
    earlier = {key: await client.dump(key) for key in keys}
    checked = await state.check_and_push(
        [PartitionCheck("orders", 0, [("p", 5)], "token-1")], 1_000
    )
    assert checked[0].statuses == (NOT_DUP,)
    assert await state.mark_persisted([("orders", 0, {"p": 5})], 1_000, ["token-1"]) == []
    for key, dumped in earlier.items():  # the lagging replica's copy
        await client.delete(key)
        if dumped is not None:
            await client.restore(key, 0, dumped)
    resent = await state.check_and_push([PartitionCheck("orders", 0, [("p", 5)], "token-1")], 1_000)
    assert resent[0].lost, "without the check, the acknowledged 5 would be written again"
    assert await state.mark_persisted([("orders", 0, {"p": 6})], 1_000, ["token-1"]) == [0]


async def test_load_recovered_keeps_the_later_last_seen_time(state: DedupState) -> None:
    await check(state, [("p", 1), ("q", 1)], now_ms=700)
    await state.load_recovered("orders", 0, {"p": (3, 500), "q": (2, 800)}, "t", now_ms=900)
    assert await state.producers("orders", 0) == {
        "p": ProducerState(3, 3, 700),
        "q": ProducerState(2, 2, 800),
    }


# -- 64-bit sequences -------------------------------------------------------------------------


async def test_sequences_near_the_64_bit_limits_compare_exactly(state: DedupState) -> None:
    # Each pair is one apart but the same double: Lua numbers would call them equal.
    for low, high in [
        (SEQUENCE_MAX - 1, SEQUENCE_MAX),
        (SEQUENCE_MIN, SEQUENCE_MIN + 1),
        (2**53, 2**53 + 1),
        (-(2**53) - 2, -(2**53) - 1),
    ]:
        producer = f"p{low}"
        assert (await check(state, [(producer, low)])).statuses == (NOT_DUP,)
        await persist(state, {producer: low})
        assert (await check(state, [(producer, high), (producer, low)])).statuses == (NOT_DUP, DUP)
        assert (await check(state, [(producer, high)])).statuses == (UNKNOWN,)
        await persist(state, {producer: high})
        await persist(state, {producer: low})  # max: stays high
        assert await state.last_sequence("orders", 0, producer) == high
    # Sign, length and digit order: MIN < -10 < -9 < -1 < 0 < 9 < 10 < MAX.
    ladder = [SEQUENCE_MIN, -10, -9, -1, 0, 9, 10, SEQUENCE_MAX]
    assert (await check(state, seq("ladder", ladder))).statuses == (NOT_DUP,) * len(ladder)
    assert (await check(state, seq("down", reversed(ladder)))).statuses == (
        NOT_DUP,
        *(DUP,) * (len(ladder) - 1),
    )
    with pytest.raises(ValueError, match="64-bit"):
        await check(state, [("p", SEQUENCE_MAX + 1)])
    with pytest.raises(ValueError, match="64-bit"):
        await persist(state, {"p": SEQUENCE_MIN - 1})


@pytest.mark.parametrize("decode_responses", [False, True])
async def test_any_client_decoding_and_unicode_names(
    redis_port: int, decode_responses: bool
) -> None:
    connection = redis.asyncio.Redis(port=redis_port, decode_responses=decode_responses)
    try:
        state = DedupState(connection, key_prefix=fresh_prefix(), max_producers=1)
        assert await state.check_and_push([], 1) == []
        await state.mark_persisted([], 1)
        assert (await check(state, [("prodücer ✓", 1)], now_ms=1)).statuses == (NOT_DUP,)
        await persist(state, {"prodücer ✓": 1}, now_ms=1)
        assert (await check(state, [("другой", 5)], now_ms=2)).evicted == ("prodücer ✓",)
        assert await state.producers("orders", 0) == {"другой": ProducerState(5, None, 2)}
        assert await state.purge_idle("orders", 0, older_than_ms=3) == ["другой"]
        assert await state.partitions("orders") == []
    finally:
        await connection.aclose()


def test_bad_configuration_is_refused() -> None:
    client = redis.asyncio.Redis(port=REDIS_PORT)  # never connects
    with pytest.raises(ValueError, match="brace"):
        DedupState(client, key_prefix="a{b}")
    with pytest.raises(ValueError, match="max_producers"):
        DedupState(client, max_producers=0)


# -- the network: one round trip, NOSCRIPT, two proxies racing --------------------------------


class CountingConnection(redis.asyncio.Connection):
    """Counts writes to the socket: a pipeline writes once, then reads every reply."""

    sends = 0

    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        CountingConnection.sends += 1
        await super().send_packed_command(command, check_health)


async def test_many_partitions_in_one_call_is_one_round_trip(redis_port: int) -> None:
    pool = redis.asyncio.ConnectionPool(port=redis_port, connection_class=CountingConnection)
    counted = redis.asyncio.Redis(connection_pool=pool)
    try:
        state = DedupState(counted, key_prefix=fresh_prefix())
        await check(state, [("warm-up", 0)])  # connects and loads the scripts
        partitions = 64
        checks = [
            PartitionCheck(topic, p, [("a", 1), ("b", 2), ("a", 3)])
            for topic in ("orders", "payments")
            for p in range(partitions // 2)
        ]
        evalsha_before = await evalsha_calls(counted)
        CountingConnection.sends = 0
        verdicts = await state.check_and_push(checks, 2_000)
        assert CountingConnection.sends == 1
        assert await evalsha_calls(counted) - evalsha_before == partitions
        assert all(v.statuses == (NOT_DUP, NOT_DUP, NOT_DUP) for v in verdicts)

        CountingConnection.sends = 0
        await state.mark_persisted([(c.topic, c.partition, {"a": 3, "b": 2}) for c in checks], 1)
        assert CountingConnection.sends == 1
        assert await state.partitions("orders") == list(range(partitions // 2))
    finally:
        await counted.aclose()


async def evalsha_calls(client: redis.asyncio.Redis) -> int:
    stats: dict[str, Any] = await client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


async def test_scripts_are_reloaded_after_script_flush(
    state: DedupState, client: redis.asyncio.Redis
) -> None:
    await check(state, [("p", 1)])
    await client.script_flush()
    verdicts = await state.check_and_push(
        [PartitionCheck("orders", 0, [("p", 1), ("p", 2)]), PartitionCheck("orders", 1, [])], 1
    )
    assert [v.statuses for v in verdicts] == [(UNKNOWN, NOT_DUP), ()]
    await client.script_flush()
    await persist(state, {"p": 1})
    await client.script_flush()
    await state.reset_pushed("orders", 0)
    assert await maps(state) == ({"p": 1}, {"p": 1})


async def test_two_proxies_racing_for_the_same_record_one_wins(redis_port: int) -> None:
    prefix = fresh_prefix()
    clients = [redis.asyncio.Redis(port=redis_port) for _ in range(2)]
    try:
        first, second = (DedupState(c, key_prefix=prefix) for c in clients)
        for proxy in (first, second):  # both connected before the race
            assert await proxy.last_sequence("orders", 0, "p") == -1
        for sequence in range(200):
            records = [("p", sequence), ("q", sequence)]
            a, b = await asyncio.gather(check(first, records), check(second, records))
            assert sorted([a.statuses, b.statuses]) == [(NOT_DUP,) * 2, (UNKNOWN,) * 2]
            winner = first if a.statuses[0] is NOT_DUP else second
            await persist(winner, {"p": sequence, "q": sequence})
        assert await maps(first) == ({"p": 199, "q": 199}, {"p": 199, "q": 199})
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))


# -- the scripts against a pure-Python model of the rules --------------------------------------


class Model:
    """The rules of `dedup.state`, in plain Python (unbounded producers)."""

    def __init__(self) -> None:
        self.pushed: dict[str, int] = {}
        self.persisted: dict[str, int] = {}

    def check(self, identities: Sequence[tuple[str, int]]) -> tuple[Status, ...]:
        pushed = dict(self.pushed)
        statuses = []
        for producer, s in identities:
            if producer not in pushed or s > pushed[producer]:
                statuses.append(NOT_DUP)
                pushed[producer] = s
            elif s <= self.persisted.get(producer, SEQUENCE_MIN - 1):
                statuses.append(DUP)
            elif producer not in self.pushed or s > self.pushed[producer]:
                statuses.append(DUP)  # raised by an earlier record of this batch
            else:
                statuses.append(UNKNOWN)
        if UNKNOWN not in statuses:
            self.pushed = pushed
        return tuple(statuses)

    def persist(self, persisted: Mapping[str, int]) -> None:
        for producer, s in persisted.items():
            self.persisted[producer] = max(self.persisted.get(producer, s), s)
            self.pushed[producer] = max(self.pushed.get(producer, s), self.persisted[producer])

    def reset(self) -> None:
        self.pushed = dict(self.persisted)


SEQUENCES = st.one_of(
    st.integers(-3, 12),
    st.sampled_from(
        [
            *(SEQUENCE_MIN, SEQUENCE_MIN + 1, SEQUENCE_MAX - 1, SEQUENCE_MAX),
            *(-(2**53) - 1, -(2**53), 2**53, 2**53 + 1),
        ]
    ),
    st.integers(SEQUENCE_MIN, SEQUENCE_MAX),
)
PRODUCERS = st.sampled_from(["a", "b", "c"])
OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("check"), st.lists(st.tuples(PRODUCERS, SEQUENCES), max_size=8)),
        st.tuples(st.just("persist"), st.dictionaries(PRODUCERS, SEQUENCES, max_size=3)),
        st.tuples(st.just("reset"), st.none()),
    ),
    max_size=25,
)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],  # a fresh prefix per example
)
@given(operations=OPERATIONS)
async def test_scripts_agree_with_the_model(
    client: redis.asyncio.Redis, operations: list[tuple[str, Any]]
) -> None:
    state = DedupState(client, key_prefix=fresh_prefix())
    model = Model()
    for operation, argument in operations:
        if operation == "check":
            assert (await check(state, argument)).statuses == model.check(argument)
        elif operation == "persist":
            await persist(state, argument)
            model.persist(argument)
        else:
            await state.reset_pushed("orders", 0)
            model.reset()
        assert await maps(state) == (model.pushed, model.persisted)


# -- runs: a batch sent as runs of consecutive sequences (`check_runs`) ----------------------


class Pair:
    """Two states on one Redis, each under its own prefix: one sends every batch as runs,
    the other record by record. Every call goes to both; the answers and the states must
    be the same."""

    def __init__(
        self, client: redis.asyncio.Redis, max_producers: int = 10_000, max_jump: int = 0
    ) -> None:
        self.client = client
        self.runs, self.records = (
            DedupState(
                client,
                key_prefix=fresh_prefix(),
                max_producers=max_producers,
                check_encoding=encoding,
                max_sequence_jump=max_jump,
            )
            for encoding in (CheckEncoding.RUNS, CheckEncoding.RECORDS)
        )
        self.token: str | None = None
        self.strides = spy_strides(self.runs)

    async def recover(self, token: str) -> None:
        for state in (self.runs, self.records):
            assert await state.load_recovered("orders", 0, {}, token, now_ms=1)
        self.token = token

    async def check(
        self, identities: Sequence[tuple[str, int]], now_ms: int = 1_000
    ) -> PartitionVerdict:
        checks = [PartitionCheck("orders", 0, identities, self.token)]
        (by_runs,) = await self.runs.check_and_push(checks, now_ms)
        (by_records,) = await self.records.check_and_push(checks, now_ms)
        assert by_runs == by_records
        await self.assert_same()
        return by_runs

    async def persist(
        self, persisted: Mapping[str, int | ChunkProgress], now_ms: int = 1_000
    ) -> None:
        for state in (self.runs, self.records):
            marked = await state.mark_persisted([("orders", 0, persisted)], now_ms, [self.token])
            assert marked == []
        await self.assert_same()

    async def reset(self) -> None:
        for state in (self.runs, self.records):
            assert await state.reset_pushed("orders", 0, self.token)
        await self.assert_same()

    async def assert_same(self) -> None:
        assert await self.runs.producers("orders", 0) == await self.records.producers("orders", 0)
        # The same calls counted: an {"expand"} answer is not one.
        tokens = [await self.client.get(s.partition_keys("orders", 0)[3]) for s in self.pair]
        assert tokens[0] == tokens[1]

    @property
    def pair(self) -> tuple[DedupState, DedupState]:
        return self.runs, self.records


def spy_strides(state: DedupState) -> list[str]:
    """The stride of every check script call the state makes from now on: "2" per record,
    "4" per run, "7" with chunks."""
    strides: list[str] = []
    real = state._run  # every script call goes through it

    async def spy(calls: Sequence[Any], before: Sequence[tuple[str, ...]] = ()) -> list[Any]:
        strides.extend(args[4] for script, _, args in calls if script.name == "check")
        return await real(calls, before)

    state._run = spy  # type: ignore[method-assign]
    return strides


async def test_a_run_above_pushed_is_not_dup_all_through(client: redis.asyncio.Redis) -> None:
    pair = Pair(client)
    assert (await pair.check(seq("p", range(5)))).statuses == (NOT_DUP,) * 5
    verdict = await pair.check(seq("p", range(5, 1005)))
    assert verdict.statuses == (NOT_DUP,) * 1000 and not verdict.refused
    assert await maps(pair.runs) == ({"p": 1004}, {})
    assert pair.strides == ["4", "4"]


async def test_auto_sends_runs_where_they_are_shorter(state: DedupState) -> None:
    strides = spy_strides(state)
    await check(state, seq("p", range(10)))  # one run for ten records
    await check(state, [("a", 1), ("b", 1), ("a", 2), ("b", 2)])  # four runs of one
    await check(state, [("a", 3), ("a", 4), ("b", 3)])  # two runs: 8 arguments against 6
    await check(state, [("a", 5), ("a", 6), ("b", 4), ("b", 5)])  # two runs: 8 against 8
    # A partition named twice in one call (requests checked together) goes by runs while
    # no run can be answered "expand"; record by record beyond exact Lua numbers, since an
    # expansion re-sent later would be checked after the second batch.
    twice = [PartitionCheck("orders", 0, seq("p", range(s, s + 10))) for s in (10, 20)]
    assert [v.statuses for v in await state.check_and_push(twice, 1)] == [(NOT_DUP,) * 10] * 2
    huge = [PartitionCheck("orders", 0, seq("q", range(s, s + 10))) for s in (10**15, 2 * 10**15)]
    assert [v.statuses for v in await state.check_and_push(huge, 1)] == [(NOT_DUP,) * 10] * 2
    assert strides == ["4", "2", "2", "4", "4", "4", "2", "2"]


async def test_a_run_overlapping_persisted_and_pushed_gets_the_per_record_statuses(
    client: redis.asyncio.Redis,
) -> None:
    pair = Pair(client)
    await pair.check(seq("p", range(10)))
    await pair.persist({"p": 4})
    verdict = await pair.check(seq("p", range(2, 16)))
    assert verdict.statuses == (DUP,) * 3 + (UNKNOWN,) * 5 + (NOT_DUP,) * 6
    assert verdict.refused
    await pair.persist({"p": 9})
    verdict = await pair.check(seq("p", range(7, 13)))
    assert verdict.statuses == (DUP,) * 3 + (NOT_DUP,) * 3
    # Repeated inside the batch: the second run overlaps what the first one raised.
    verdict = await pair.check([*seq("p", range(13, 18)), *seq("p", range(15, 20))])
    assert verdict.statuses == (NOT_DUP,) * 5 + (DUP,) * 3 + (NOT_DUP,) * 2
    assert await maps(pair.runs) == ({"p": 19}, {"p": 9})
    # Runs that end at or below pushed, one status all through: no record's own sequence
    # is needed.
    verdict = await pair.check(seq("p", range(3, 7)))  # acknowledged
    assert verdict.statuses == (DUP,) * 4
    verdict = await pair.check(seq("p", range(10, 15)))  # pushed before, not acknowledged
    assert verdict.statuses == (UNKNOWN,) * 5 and verdict.refused
    verdict = await pair.check([*seq("p", range(20, 23)), *seq("p", range(20, 22))])
    assert verdict.statuses == (NOT_DUP,) * 3 + (DUP,) * 2  # raised by this batch
    # Across pushed as the batch started (22), below pushed as the batch raised it (25).
    verdict = await pair.check([*seq("p", range(23, 26)), *seq("p", range(21, 25))])
    assert verdict.statuses == (NOT_DUP,) * 3 + (UNKNOWN,) * 2 + (DUP,) * 2
    assert await maps(pair.runs) == ({"p": 22}, {"p": 9})
    assert pair.strides == ["4"] * 8


async def test_runs_of_several_producers_interleaved(client: redis.asyncio.Redis) -> None:
    pair = Pair(client)
    await pair.check([*seq("a", range(3)), *seq("b", range(10, 13))])
    await pair.persist({"a": 2, "b": 11})
    batch = [
        *seq("a", range(1, 5)),
        *seq("b", range(13, 16)),
        *seq("a", range(5, 7)),
        *seq("c", range(-1, 2)),
        ("b", 16),
    ]
    assert check_runs(batch) == [
        ("a", 1, 4, 4),
        ("b", 13, 15, 3),
        ("a", 5, 6, 2),
        ("c", -1, 1, 3),
        ("b", 16, 16, 1),
    ]
    verdict = await pair.check(batch)
    assert verdict.statuses == (DUP, DUP, *(NOT_DUP,) * 11)
    assert await maps(pair.runs) == ({"a": 6, "b": 16, "c": 1}, {"a": 2, "b": 11})
    # b's 12 was pushed by an earlier batch and never acknowledged: the whole batch waits.
    verdict = await pair.check([*seq("a", range(7, 9)), *seq("b", range(12, 14))])
    assert verdict.statuses == (NOT_DUP, NOT_DUP, UNKNOWN, UNKNOWN)
    assert await maps(pair.runs) == ({"a": 6, "b": 16, "c": 1}, {"a": 2, "b": 11})


async def test_runs_at_the_64_bit_limits_and_below_zero(client: redis.asyncio.Redis) -> None:
    pair = Pair(client)
    top = range(SEQUENCE_MAX - 999, SEQUENCE_MAX + 1)
    assert (await pair.check(seq("max", top))).statuses == (NOT_DUP,) * 1000
    await pair.persist({"max": SEQUENCE_MAX - 500})
    verdict = await pair.check(seq("max", range(SEQUENCE_MAX - 502, SEQUENCE_MAX + 1)))
    assert verdict.statuses == (DUP,) * 3 + (UNKNOWN,) * 500
    bottom = range(SEQUENCE_MIN, SEQUENCE_MIN + 10)
    assert (await pair.check(seq("min", bottom))).statuses == (NOT_DUP,) * 10
    await pair.persist({"min": SEQUENCE_MIN + 4})
    verdict = await pair.check(seq("min", range(SEQUENCE_MIN, SEQUENCE_MIN + 12)))
    assert verdict.statuses == (DUP,) * 5 + (UNKNOWN,) * 5 + (NOT_DUP,) * 2
    # Across zero, small enough for Lua numbers: expanded by the script itself.
    await pair.check(seq("z", range(-5, 3)))
    await pair.persist({"z": 0})
    verdict = await pair.check(seq("z", range(-2, 6)))
    assert verdict.statuses == (DUP,) * 3 + (UNKNOWN,) * 2 + (NOT_DUP,) * 3
    assert await maps(pair.runs) == (
        {"max": SEQUENCE_MAX, "min": SEQUENCE_MIN + 9, "z": 2},
        {"max": SEQUENCE_MAX - 500, "min": SEQUENCE_MIN + 4, "z": 0},
    )
    for state in pair.pair:  # a run never reaches past the 64-bit range: its last is checked
        with pytest.raises(ValueError, match="64-bit"):
            await check(state, [("p", SEQUENCE_MAX - 1), ("p", SEQUENCE_MAX), ("p", 2**63)])
        with pytest.raises(ValueError, match="64-bit"):
            await check(state, [("p", SEQUENCE_MIN - 1), ("p", SEQUENCE_MIN)])


async def test_an_implicit_sequence_wrapping_ends_a_run(client: redis.asyncio.Redis) -> None:
    pair = Pair(client)
    pid = "kafka-pid-7-0"
    wrap = [*seq(pid, range(2**31 - 3, 2**31)), *seq(pid, range(3))]
    assert check_runs(wrap) == [(pid, 2**31 - 3, 2**31 - 1, 3), (pid, 0, 2, 3)]
    # After the wrap the sequences are below pushed: as record by record, duplicates of
    # this batch.
    assert (await pair.check(wrap)).statuses == (NOT_DUP,) * 3 + (DUP,) * 3
    assert await maps(pair.runs) == ({pid: 2**31 - 1}, {})


async def test_a_run_overlapping_pushed_with_huge_sequences_is_re_sent_per_record(
    client: redis.asyncio.Redis,
) -> None:
    pair = Pair(client)
    await pair.recover("token-x")
    big = 2**60
    await pair.check(seq("p", range(big, big + 10)))
    await pair.persist({"p": big + 4})
    pair.strides.clear()
    verdict = await pair.check(seq("p", range(big + 2, big + 16)))
    assert verdict.statuses == (DUP,) * 3 + (UNKNOWN,) * 5 + (NOT_DUP,) * 6
    assert pair.strides == ["4", "2"]  # answered "expand", then sent record by record
    # Counted once: recovery 0, then check, persist, check (Pair compares both tokens).
    token_key = pair.runs.partition_keys("orders", 0)[3]
    assert await client.get(token_key) == b"token-x 3"
    # Acknowledged all through: one status for the run, whatever its sequences.
    verdict = await pair.check([*seq("p", range(big + 3, big + 5)), ("q", -(2**62))])
    assert verdict.statuses == (DUP, DUP, NOT_DUP) and not verdict.lost
    assert pair.strides == ["4", "2", "4"]
    assert await client.get(token_key) == b"token-x 4"


async def test_an_expand_answer_changes_nothing(client: redis.asyncio.Redis) -> None:
    state = DedupState(client, key_prefix=fresh_prefix())
    await state.load_recovered("orders", 0, {"p": (-(2**60), 1), "r": (5, 1)}, "token-y", now_ms=1)
    keys = state.partition_keys("orders", 0)[:6]
    before = {key: await client.dump(key) for key in keys}
    first, last = str(-(2**60) - 2), str(-(2**60) + 2)  # across pushed
    call = ["1", "10", "0", "token-y 0", "4", "q", "0", "4", "5", "p", first, last, "5"]
    (reply,) = await state.run_scripts([(Script.load("check"), keys, call)])
    assert reply == [b"expand"]
    assert {key: await client.dump(key) for key in keys} == before  # the token's count too
    # A small overlapping run instead: the script expands it itself and counts the call.
    call[-4:] = ["r", "3", "7", "5"]
    (reply,) = await state.run_scripts([(Script.load("check"), keys, call)])
    assert reply == [b"0000011100", []]
    assert await client.get(keys[3]) == b"token-y 1"


async def test_eviction_with_runs(client: redis.asyncio.Redis) -> None:
    pair = Pair(client, max_producers=3)
    for now, producer in enumerate("abc", start=1):
        assert (await pair.check(seq(producer, range(5)), now_ms=now)).evicted == ()
    # Acknowledged: nothing in flight (at time 0: last seen stays as the checks left it).
    await pair.persist({"a": 4, "b": 4, "c": 4}, now_ms=0)
    # a is the least recently seen, but in the batch: b goes.
    verdict = await pair.check([*seq("d", range(3)), *seq("a", range(5, 8))], now_ms=4)
    assert verdict.evicted == ("b",)
    await pair.persist({"a": 7}, now_ms=0)
    verdict = await pair.check([*seq("e", range(10)), *seq("f", range(10))], now_ms=5)
    assert verdict.evicted == ("c", "a")
    assert sorted(await pair.runs.producers("orders", 0)) == ["d", "e", "f"]
    # A refused batch evicts nobody.
    verdict = await pair.check([*seq("g", range(3)), *seq("e", range(8, 12))], now_ms=6)
    assert verdict.statuses == (NOT_DUP,) * 3 + (UNKNOWN,) * 2 + (NOT_DUP,) * 2
    assert verdict.evicted == () and sorted(await pair.runs.producers("orders", 0)) == [
        "d",
        "e",
        "f",
    ]


# Runs near every boundary the check has: 0, Lua's exact 2^53 (the script expands runs
# below 10^15 itself, above it they are re-sent per record), 2^31 (implicit wrap), int64.
RUN_STARTS = st.one_of(
    st.integers(-3, 12),
    st.sampled_from(
        [
            *(SEQUENCE_MIN, SEQUENCE_MAX - 4, 2**31 - 3, 2**53 - 2),
            *(10**15 - 3, -(10**15) - 2, 10**15 + 1),
        ]
    ),
)


def batch_of(segments: list[tuple[str, int, int]]) -> list[tuple[str, int]]:
    """(producer, first sequence, length) segments as records, none past int64."""
    return [(p, s) for p, first, n in segments for s in range(first, min(first + n, 2**63))]


RUN_OPERATIONS = st.lists(
    st.one_of(
        st.tuples(
            st.just("check"),
            st.lists(st.tuples(PRODUCERS, RUN_STARTS, st.integers(1, 6)), max_size=5).map(batch_of),
        ),
        st.tuples(st.just("persist"), st.dictionaries(PRODUCERS, RUN_STARTS, max_size=3)),
        # A chunked message in progress, acknowledged up to its chunk 0: a record without
        # chunk headers at its sequence is bad input.
        st.tuples(st.just("chunk"), st.tuples(PRODUCERS, RUN_STARTS)),
        st.tuples(st.just("reset"), st.none()),
    ),
    max_size=12,
)


@settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],  # fresh prefixes per example
)
@given(operations=RUN_OPERATIONS, token=st.booleans())
async def test_runs_give_what_records_give(
    client: redis.asyncio.Redis, operations: list[tuple[str, Any]], token: bool
) -> None:
    """Verdicts, the state and the token's call count, as record by record (`Pair`), and
    the statuses as the model's while no chunk is involved."""
    pair = Pair(client)
    if token:
        await pair.recover(f"token-{uuid.uuid4().hex[:6]}")
    model: Model | None = Model()
    for operation, argument in operations:
        if operation == "check":
            verdict = await pair.check(argument)
            if model is not None:
                assert verdict.statuses == model.check(argument)
        elif operation == "persist":
            await pair.persist(argument)
            if model is not None:
                model.persist(argument)
        elif operation == "chunk":
            producer, sequence = argument
            await pair.persist({producer: ChunkProgress(sequence, "u", 0, 2, 10, 5)})
            model = None
        else:
            await pair.reset()
            if model is not None:
                model.reset()
        if model is not None:
            assert await maps(pair.runs) == (model.pushed, model.persisted)
    assert set(pair.strides) <= {"2", "4"}


async def test_calls_answered_before_a_failed_re_send_are_counted(
    client: redis.asyncio.Redis,
) -> None:
    """A re-send after "expand" that fails (the connection lost) leaves the other
    partitions' calls answered and counted by Redis: their owner counts them too, or it
    would no longer notice a Redis that lost them."""
    state = DedupState(client, key_prefix=fresh_prefix(), check_encoding=CheckEncoding.RUNS)
    big = 2**60
    await state.load_recovered("orders", 0, {}, "token-a", now_ms=1)
    await state.load_recovered("orders", 1, {"p": (big + 10, 1)}, "token-b", now_ms=1)
    real, rounds = state._run, 0

    async def second_round_fails(calls: Sequence[Any], before: Sequence[Any] = ()) -> list[Any]:
        nonlocal rounds
        rounds += 1
        if rounds == 2:
            raise redis.ConnectionError("lost on the way")
        return await real(calls, before)

    state._run = second_round_fails  # type: ignore[method-assign]
    checks = [
        PartitionCheck("orders", 0, seq("p", range(5)), "token-a"),
        PartitionCheck("orders", 1, seq("p", range(big + 5, big + 15)), "token-b"),
    ]
    with pytest.raises(redis.ConnectionError):
        await state.check_and_push(checks, 2)
    state._run = real  # type: ignore[method-assign]
    token_key = state.partition_keys("orders", 0)[3]
    assert await client.get(token_key) == b"token-a 1"
    keys = state.partition_keys("orders", 0)[:6]
    earlier = {key: await client.dump(key) for key in keys}
    (verdict,) = await state.check_and_push([PartitionCheck("orders", 0, [("p", 5)], "token-a")], 3)
    assert verdict.statuses == (NOT_DUP,)
    for key, dumped in earlier.items():  # Redis goes back to before that call
        await client.delete(key)
        if dumped is not None:
            await client.restore(key, 0, dumped)
    (verdict,) = await state.check_and_push([PartitionCheck("orders", 0, [("p", 5)], "token-a")], 4)
    assert verdict.lost


# ----------------------------------------------------------------------------- policies


async def test_the_policies_last_read_serve_on_while_redis_is_down(tmp_path: Path) -> None:
    """The produce path keeps the policies it read (its check refuses, "retry", for want of
    Redis); the admin API's fresh read, and a proxy that never read them, fail."""
    with redis_server(POLICY_OUTAGE_REDIS, tmp_path) as server:
        # No reconnection attempts with back-off: the outage shows at the first call.
        client = redis.asyncio.Redis(
            port=POLICY_OUTAGE_REDIS, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)
        )
        try:
            store = PolicyStore(client, Mode.ENABLED, key_prefix=fresh_prefix(), cache_s=0.0)
            await store.set_topic("logs", Mode.DISABLED)
            read = await store.snapshot()
            assert read.mode_for("logs") is Mode.DISABLED
            server.terminate()
            server.wait(10)
            await asyncio.sleep(0.01)  # older than cache_s: read again, and Redis is gone
            assert await store.snapshot() == read
            with pytest.raises(redis.RedisError):
                await store.snapshot(fresh=True)
            never_read = PolicyStore(client, Mode.ENABLED, key_prefix=fresh_prefix())
            with pytest.raises(redis.RedisError):
                await never_read.snapshot()
        finally:
            await client.aclose()


async def test_a_record_too_far_above_its_producers_last_is_refused(
    client: redis.asyncio.Redis,
) -> None:
    """max_sequence_jump: a forged huge sequence cannot raise a known producer's pushed (its
    next records would read as duplicates); a new producer may start anywhere."""
    pair = Pair(client, max_jump=100)
    assert (await pair.check(seq("p", range(10)))).statuses == (NOT_DUP,) * 10
    before = await pair.runs.producers("orders", 0)
    for forged in ([("p", 110)], [("p", 2**63 - 1)], [*seq("p", range(10, 12)), ("p", 200)]):
        verdict = await pair.check(forged)
        assert verdict.jump and verdict.refused and verdict.statuses == ()
        assert verdict.bad is not None and "max_sequence_jump" in verdict.bad
        assert verdict.bad_index == len(forged) - 1
        assert await pair.runs.producers("orders", 0) == before, "nothing changed"
    assert (await pair.check([("p", 109)])).statuses == (NOT_DUP,)  # 100 above 9: allowed
    assert (await pair.check(seq("q", range(10**17, 10**17 + 3)))).statuses == (NOT_DUP,) * 3
    old = await pair.check([("p", 5)])  # pushed, not acknowledged: UNKNOWN, as without a bound
    assert old.statuses == (UNKNOWN,) and not old.jump


# --- the held connection (dedup.held_connection) -------------------------------------------


async def test_a_held_round_trip_gives_each_reply_in_order_an_error_as_its_result(
    client: redis.asyncio.Redis,
) -> None:
    held = HeldConnection(client)
    key = f"{fresh_prefix()}:k"
    replies = await held.round_trip(
        [("SET", key, "1"), ("EVALSHA", "0" * 40, 0), ("INCR", key), ("GET", key)]
    )
    assert replies[0] is True or replies[0] == b"OK"
    assert isinstance(replies[1], NoScriptError)
    assert replies[2:] == [2, b"2"]
    assert not held.busy


async def test_a_held_connection_redis_closed_is_opened_again_without_a_failure(
    client: redis.asyncio.Redis,
) -> None:
    """As the pool's check would: a connection Redis dropped while idle (a restart, an idle
    timeout) costs no round trip."""
    held = HeldConnection(client)
    name = f"held-{fresh_prefix()}"
    assert await held.round_trip([("CLIENT", "SETNAME", name)]) == [b"OK"]
    killed = await client.execute_command("CLIENT", "KILL", "SKIPME", "yes", "TYPE", "normal")
    assert killed >= 1
    await asyncio.sleep(0.1)  # the loop reads the connection's end
    assert await held.round_trip([("PING",)]) == [b"PONG"]


async def test_a_round_trip_cancelled_while_waiting_leaves_no_reply_for_the_next(
    client: redis.asyncio.Redis,
) -> None:
    held = HeldConnection(client)
    slow = asyncio.create_task(
        held.round_trip(
            [("EVAL", "local t = redis.call('TIME') return 'slow'", 0), ("DEBUG", "SLEEP", "0.3")]
        )
    )
    await asyncio.sleep(0.1)
    slow.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await slow
    assert not held.busy
    # The slow command's replies are still on their way: they must not answer this one.
    assert await held.round_trip([("ECHO", "mine")]) == [b"mine"]


async def test_checks_while_the_held_connection_is_busy_go_through_the_pool(
    client: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = DedupState(client, key_prefix=fresh_prefix())
    pipelines = 0
    pipeline = client.pipeline

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal pipelines
        pipelines += 1
        return pipeline(*args, **kwargs)

    await check(state, [("p", 0)], topic="warm-up")  # the scripts loaded (through the pool)
    monkeypatch.setattr(client, "pipeline", counted)
    firsts = await asyncio.gather(
        *(check(state, [("p", n)], topic="busy", partition=n) for n in range(5))
    )
    assert [v.statuses for v in firsts] == [(NOT_DUP,)] * 5
    assert pipelines == 4  # the first took the held connection, the others the pool
    # Each saw its own partition's state: a re-send (not yet acknowledged) is unknown.
    again = await check(state, [("p", 3)], topic="busy", partition=3)
    assert again.statuses == (UNKNOWN,)
    assert pipelines == 4


# ----------------------------------------------------------------------------- lease deadlines


async def test_a_lease_is_valid_here_only_until_its_time_from_the_last_renewal(
    state: DedupState,
) -> None:
    """The deadline the owner keeps on its own clock never outlives the lease in Redis:
    before it no other instance can take the partition; after it, only a renewal that
    Redis granted makes the lease valid here again."""
    mine = PartitionLeases(state, "a", "inc-a", ttl_s=0.4)
    other = PartitionLeases(state, "b", "inc-b", ttl_s=0.4)
    key = ("orders", 0)
    (granted,) = (await mine.acquire([key])).values()
    assert isinstance(granted, Granted) and mine.valid(key)
    assert isinstance((await other.acquire([key]))[key], Held), "taken only after its time"
    await asyncio.sleep(0.25)
    assert await mine.renew([granted.lease]) == []
    await asyncio.sleep(0.25)  # past the first deadline, not past the renewed one
    assert mine.valid(key)
    await asyncio.sleep(0.2)
    assert not mine.valid(key), "not renewed: another instance may take it now"
    (taken,) = (await other.acquire([key])).values()
    assert isinstance(taken, Granted) and other.valid(key)
    assert await mine.renew([granted.lease]) == [granted.lease]
    assert not mine.valid(key)
