"""Partition ownership leases in Redis: one owner per partition, a fencing epoch per lease.

A lease lives beside the partition's dedup state, in its hash slot (``...:lease``), so every
script checks it atomically with the state. Taking one (``dedup/lua/lease_acquire.lua``)
raises the epoch and removes the partition's token, so an older owner's calls answer "lost"
from that moment; loading the recovered state checks the lease again and opens it
(``dedup/lua/load.lua``). The owner renews its leases every heartbeat; a lease not renewed
for ``ttl`` can be taken by another instance, which then fences the suspects the lease
names (see `dedup.recovery`).

Each lease granted or renewed here has a deadline on this process's clock
(`valid_until`): the time the request went out plus ``ttl``. Redis counts the lease's
``ttl`` from when it ran the script, which is later, so until the deadline no other
instance can have taken the lease: an owner that keeps its maps in memory checks against
them only before it (`dedup.engine`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from dedup.state import DedupState, Script

_ACQUIRE = Script.load("lease_acquire")
_RENEW = Script.load("lease_renew")
_RELEASE = Script.load("lease_release")

Key = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Lease:
    topic: str
    partition: int
    owner: str
    incarnation: str
    epoch: int

    @property
    def key(self) -> Key:
        return self.topic, self.partition

    @property
    def text(self) -> str:
        """As the scripts compare it."""
        return f"{self.owner} {self.incarnation} {self.epoch}"


UNKNOWN = "?"  # the suspect of a partition that never had an owner: look at the log


@dataclass(frozen=True, slots=True)
class Granted:
    """The lease is ours. ``suspects``: instances whose writes may still land (fence them;
    `UNKNOWN`: decide from the log). ``opened``: it was ours and open already (this
    instance recovers it again: its own writes are the suspects)."""

    lease: Lease
    suspects: tuple[str, ...] = ()
    has_state: bool = False  # Redis holds dedup state for the partition
    opened: bool = False


@dataclass(frozen=True, slots=True)
class Held:
    """Another live instance holds the lease."""

    owner: str
    ms_left: int


class PartitionLeases:
    def __init__(self, state: DedupState, instance_id: str, incarnation: str, ttl_s: float):
        self._state = state
        self.instance_id = instance_id
        self.incarnation = incarnation
        self._ttl_s = ttl_s
        self._ttl_ms = str(int(ttl_s * 1000))
        # Per lease held: event-loop time before which no other instance can have taken it.
        self.valid_until: dict[Key, float] = {}

    def valid(self, key: Key) -> bool:
        """Whether the lease on the partition, if this instance has one, cannot have expired."""
        return asyncio.get_running_loop().time() < self.valid_until.get(key, 0.0)

    async def acquire(self, keys: Sequence[Key]) -> dict[Key, Granted | Held]:
        calls = [
            (
                _ACQUIRE,
                self._state.partition_keys(*key),
                [self.instance_id, self.incarnation, self._ttl_ms],
            )
            for key in keys
        ]
        outcomes: dict[Key, Granted | Held] = {}
        sent = asyncio.get_running_loop().time()
        for key, reply in zip(keys, await self._state.run_scripts(calls), strict=True):
            status, *rest = (_text(x) for x in reply)
            if status == "held":
                outcomes[key] = Held(rest[0], int(rest[1]))
                continue
            self.valid_until[key] = sent + self._ttl_s
            lease = Lease(*key, self.instance_id, self.incarnation, int(rest[0]))
            if status == "mine":
                state, suspects = rest[1:]
                outcomes[key] = Granted(lease, tuple(suspects.split()), opened=state == "open")
                continue
            suspects, has_state = rest[1:]
            outcomes[key] = Granted(lease, tuple(suspects.split()), has_state == "1")
        return outcomes

    async def renew(self, leases: Sequence[Lease]) -> list[Lease]:
        """Renew every lease; those no longer ours come back."""
        calls = [
            (
                _RENEW,
                (self._state.partition_keys(lease.topic, lease.partition)[6],),
                [lease.owner, lease.incarnation, str(lease.epoch), self._ttl_ms],
            )
            for lease in leases
        ]
        sent = asyncio.get_running_loop().time()
        replies = await self._state.run_scripts(calls)
        lost = []
        for lease, ok in zip(leases, replies, strict=True):
            if int(ok):
                self.valid_until[lease.key] = sent + self._ttl_s
            else:
                self.valid_until.pop(lease.key, None)
                lost.append(lease)
        return lost

    async def release(self, lease: Lease, clean: bool) -> bool:
        """Hand the partition back: ``clean`` when every write of ours is settled and the
        state snapshotted (the next owner then needs no fence)."""
        self.valid_until.pop(lease.key, None)
        keys = self._state.partition_keys(lease.topic, lease.partition)
        (done,) = await self._state.run_scripts(
            [
                (
                    _RELEASE,
                    (keys[3], keys[6]),
                    [lease.owner, lease.incarnation, str(lease.epoch), "1" if clean else "0"],
                )
            ]
        )
        return bool(int(done))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
