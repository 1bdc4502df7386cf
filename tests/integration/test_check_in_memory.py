"""The maps the owner keeps in memory (`dedup.sequences`) answer as the Lua scripts do.

The two places the check can run (``check_state`` memory or redis) must never disagree, so
hypothesis drives both through the same operations, against the local environment's real
Redis: checks (whole records, runs of sequences in a row, chunks, several producers,
retries overlapping what was pushed and acknowledged, sequence jumps), acknowledgements, the
reset after a failed write, an operator's reset of a producer, the idle purge, and
evictions at a small bound, with a clock that now and then steps back or stands still.
After each, the verdicts and every producer's entry (pushed, persisted, the chunked messages
in progress, last seen) must be the same.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis.asyncio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dedup.chunks import ChunkMeta
from dedup.sequences import PartitionSequences
from dedup.state import (
    DedupState,
    PartitionCheck,
    PartitionVerdict,
    Persisted,
    RunIdentities,
    check_runs,
)
from deploy.local import EnvInfo

pytestmark = pytest.mark.integration

REDIS_DB = 10
MAX_PRODUCERS = 3
JUMP = 6
PRODUCERS = ("a", "b", "c", "d", "e")

chunk_metas = st.builds(
    lambda uuid_text, count, chunk_id, total: ChunkMeta(uuid_text, chunk_id % count, count, total),
    st.sampled_from(["u", "v w"]),
    st.integers(1, 3),
    st.integers(0, 2),
    st.integers(0, 6),
)
# A plain record, or a run of sequences in a row (as a producer numbers its records).
plain = st.tuples(st.sampled_from(PRODUCERS), st.integers(-2, 12), st.integers(1, 4))
chunked = st.tuples(st.sampled_from(PRODUCERS), st.integers(0, 4), chunk_metas, st.integers(0, 4))
operations = st.lists(
    st.one_of(
        st.tuples(st.just("check"), st.lists(plain, min_size=1, max_size=4), st.booleans()),
        st.tuples(st.just("chunks"), st.lists(chunked, min_size=1, max_size=4), st.none()),
        st.tuples(st.just("persist"), st.sampled_from(PRODUCERS), st.integers(0, 3)),
        st.tuples(st.just("reset"), st.none(), st.none()),
        st.tuples(st.just("forget"), st.sampled_from(PRODUCERS), st.none()),
        st.tuples(st.just("purge"), st.integers(0, 4), st.none()),
    ),
    min_size=1,
    max_size=14,
)


@pytest.fixture(scope="module")
def lua() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def lua_state(
    local_env: EnvInfo, lua: asyncio.AbstractEventLoop
) -> Iterator[dict[int, DedupState]]:
    """The Lua check with no jump bound and with one, on the environment's Redis."""
    client = redis.asyncio.from_url(local_env.redis.rsplit("/", 1)[0] + f"/{REDIS_DB}")
    prefix = f"in-memory-{uuid.uuid4().hex[:8]}"
    yield {
        jump: DedupState(
            client,
            key_prefix=f"{prefix}-{jump}",
            max_producers=MAX_PRODUCERS,
            max_sequence_jump=jump,
        )
        for jump in (0, JUMP)
    }
    lua.run_until_complete(client.aclose())


def _plain_check(topic: str, parts: list[tuple[str, int, int]], as_runs: bool) -> PartitionCheck:
    identities = [(p, first + k) for p, first, count in parts for k in range(count)]
    if as_runs:  # the usual batch's form: runs known without a look at each record
        return PartitionCheck(topic, 0, RunIdentities(check_runs(identities)))
    return PartitionCheck(topic, 0, identities)


def _chunk_check(topic: str, parts: list[tuple[str, int, ChunkMeta, int]]) -> PartitionCheck:
    return PartitionCheck(
        topic,
        0,
        [(p, s) for p, s, _, _ in parts],
        chunks=[(meta, min(size, meta.total_size)) for _, _, meta, size in parts],
    )


def _view(found: dict[str, Any]) -> dict[str, tuple[Any, ...]]:
    return {
        p: (s.pushed, s.persisted, s.pushed_chunk, s.persisted_chunk, s.last_seen_ms)
        for p, s in found.items()
        if (s.pushed, s.persisted, s.pushed_chunk, s.persisted_chunk) != (None,) * 4
    }


def _describe(verdict: PartitionVerdict) -> str:
    if verdict.bad is not None:
        return "gap" if verdict.gap else "jump" if verdict.jump else "bad"
    if verdict.evicted:
        return "evicted"
    return "refused" if verdict.refused else "checked"


@settings(
    max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(operations, st.sampled_from([0, JUMP]), st.lists(st.integers(-3, 2), max_size=14))
def test_the_maps_in_memory_answer_as_the_lua_scripts(
    lua: asyncio.AbstractEventLoop,
    lua_state: dict[int, DedupState],
    ops: list[tuple[str, Any, Any]],
    jump: int,
    clock_steps: list[int],
) -> None:
    state = lua_state[jump]
    topic = f"t{uuid.uuid4().hex[:10]}"
    memory = PartitionSequences("", max_producers=MAX_PRODUCERS, max_jump=jump)
    pushed: dict[str, list[Persisted]] = {}  # every position a producer was pushed to
    now_ms = 1000
    for step, (op, arg, flag) in enumerate(ops):
        now_ms += clock_steps[step] if step < len(clock_steps) else 1
        if op in ("check", "chunks"):
            check = _chunk_check(topic, arg) if op == "chunks" else _plain_check(topic, arg, flag)
            (expected,) = lua.run_until_complete(state.check_and_push([check], now_ms))
            verdict = memory.check(check, now_ms)
            event(f"{op}: {_describe(expected)}")
            assert verdict == expected, (op, check)
        elif op == "persist":
            # What the engine acknowledges: a position a batch of the producer was pushed
            # to, the latest or an earlier one (an acknowledgement that comes after a reset,
            # or after a later batch was checked).
            history = pushed.get(arg)
            if not history:
                continue
            position = history[-1 - min(flag, len(history) - 1)]
            lua.run_until_complete(state.mark_persisted([(topic, 0, {arg: position})], now_ms))
            memory.persisted({arg: position}, now_ms)
        elif op == "reset":
            lua.run_until_complete(state.reset_pushed(topic, 0))
            memory.reset()
        elif op == "forget":
            forgot = lua.run_until_complete(state.forget_producer(topic, 0, arg))
            assert memory.forget(arg) == forgot
        else:
            older_than = now_ms - arg
            purged = lua.run_until_complete(state.purge_idle(topic, 0, older_than))
            assert sorted(memory.purge_idle(older_than)) == sorted(purged)
        view = memory.producers()
        assert _view(view) == _view(lua.run_until_complete(state.producers(topic, 0)))
        for name, entry in view.items():
            position = entry.pushed_chunk or entry.pushed
            if position is not None and (not pushed.get(name) or pushed[name][-1] != position):
                pushed.setdefault(name, []).append(position)
    lua.run_until_complete(state.clear(topic))


def test_a_recovered_partition_answers_as_the_one_loaded_into_redis(
    lua: asyncio.AbstractEventLoop, lua_state: dict[int, DedupState]
) -> None:
    """Recovery loads the same maps into both: then a retry of what the log holds is a
    duplicate, the next record new, in either."""
    state = lua_state[0]
    topic = f"t{uuid.uuid4().hex[:10]}"
    producers = {"a": (7, 100), "b": (3, 50)}
    assert lua.run_until_complete(state.load_recovered(topic, 0, producers, "tok", 200))
    memory = PartitionSequences.recovered("tok", producers)
    check = PartitionCheck(topic, 0, [("a", 7), ("a", 8), ("b", 2), ("c", 0)], "tok")
    (expected,) = lua.run_until_complete(state.check_and_push([check], 300))
    assert memory.check(check, 300) == expected
    assert _view(memory.producers()) == _view(lua.run_until_complete(state.producers(topic, 0)))
    stale = PartitionCheck(topic, 0, [("a", 9)], "older-token")
    (lost,) = lua.run_until_complete(state.check_and_push([stale], 400))
    assert memory.check(stale, 400) == lost
    assert lost.lost
