"""A task cancelled in the middle of a Redis call ends, every time, on real Redis.

redis-py bounds writes with `asyncio.wait_for` when a socket timeout is set, which on
Python 3.11 loses a cancellation that arrives as the write completes; the proxy's clients
bound writes otherwise (`dedup.redis_connect`). Before, about one cancellation in a few
hundred was lost here, and a proxy being shut down waited for ever on a connection whose
task went on (a Metadata answer reading policies from Redis when the drain came)."""

from __future__ import annotations

import asyncio
import random

import pytest

from dedup.policies import Mode, PolicyStore
from dedup.redis_connect import redis_from_url
from deploy.local import EnvInfo

pytestmark = pytest.mark.integration

ATTEMPTS = 2000


async def test_a_cancelled_redis_call_always_ends_its_task(local_env: EnvInfo) -> None:
    client = redis_from_url(local_env.redis, socket_timeout=5, socket_connect_timeout=2)
    policies = PolicyStore(client, Mode.ENABLED, key_prefix="cancellation", cache_s=0)
    await policies.snapshot()
    rng = random.Random(7)

    async def reading() -> None:
        while True:  # as a connection's tasks loop: a lost cancellation never ends it
            await policies.snapshot()

    try:
        for attempt in range(ATTEMPTS):
            task = asyncio.create_task(reading())
            await asyncio.sleep(rng.random() * 0.003)
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=2)
            assert done, f"cancellation {attempt} was lost: the task goes on"
            assert task.cancelled()
    finally:
        await client.aclose()
