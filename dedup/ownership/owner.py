"""This instance's part in owning partitions: membership, leases, placement, handoffs.

Every heartbeat the instance renews its membership (learning who else is alive) and every
lease it holds; a lease found lost (taken over while this instance was cut off) closes the
partition here at once. A held partition that the placement now gives to another member
(it joined, or the leader moved in sidecar placement) is handed over gracefully: no new
requests, the writes in flight settle, a snapshot, then a clean release (`handoff`), so the
next owner replays only the tail and needs no fence.

Taking a partition is not done here: the recovery does it (`dedup.recovery`), when the
first request for a partition this instance should own arrives. So an instance never takes
partitions nobody asks it for, and a partition is recovered once per owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import structlog
from redis.exceptions import RedisError

from dedup import metrics
from dedup.ownership.leases import Key, Lease, PartitionLeases
from dedup.ownership.members import DuplicateInstance, Member, Membership
from dedup.ownership.nodes import Node, NodeMap
from dedup.ownership.placement import partition_owner
from proxy.runtime import background
from proxy.runtime.cluster import NoSuchPartition

log = structlog.get_logger(__name__)

LEADER_TTL_S = 10.0  # a partition's leader as learned is trusted this long
HANDOFF_TIMEOUT_S = 30.0  # how long writes in flight may take to settle before a release


@dataclass(frozen=True, slots=True)
class Redirect:
    """Where a client should send a partition's requests instead: the owner's node."""

    owner: str
    node: Node
    leader_epoch: int


LeaderLookup = Callable[[str, int], Awaitable[tuple[int, int] | None]]
Handoff = Callable[[Lease], Awaitable[bool]]  # settle and snapshot; True: clean


Leader = tuple[int, int] | None  # a partition's leader id and epoch; None: not known


async def leaders_by_topic(
    keys: Iterable[Key], learn: Callable[[Key], Awaitable[Leader]], topics_at_once: int
) -> list[tuple[Key, Leader | BaseException]]:
    """Each partition's leader by ``learn`` (`Ownership.learn_leader`), or what it raised:
    a topic's partitions at once, so that their lookups share one Metadata request
    (`UpstreamCluster.partition_leader`), and at most ``topics_at_once`` topics at a time
    (each a connection to Kafka), in topic order."""
    keys = sorted(keys)
    limit = asyncio.Semaphore(topics_at_once)

    async def of_topic(topic_keys: list[Key]) -> list[Leader | BaseException]:
        async with limit:
            return await asyncio.gather(*(learn(key) for key in topic_keys), return_exceptions=True)

    groups = [list(group) for _, group in itertools.groupby(keys, key=lambda key: key[0])]
    found = await asyncio.gather(*(of_topic(group) for group in groups))
    return list(zip(keys, itertools.chain.from_iterable(found), strict=True))


class Ownership:
    def __init__(
        self,
        membership: Membership,
        leases: PartitionLeases,
        *,
        placement: str,
        node_id_stride: int,
        heartbeat_s: float,
        ttl_s: float,
        leader_lookup: LeaderLookup,
    ) -> None:
        self.membership = membership
        self.leases = leases
        self.placement = placement
        self._stride = node_id_stride
        self._heartbeat_s = heartbeat_s
        self._ttl_s = ttl_s
        self._leader_lookup = leader_lookup
        self.members: list[Member] = [membership.me]
        self.held: dict[Key, Lease] = {}  # leases this instance holds
        self.handing_off: set[Key] = set()
        self._leaders: dict[Key, tuple[int, int, float]] = {}  # id, epoch, learned at
        self._on_lost: Callable[[Key], None] = lambda key: None
        self._handoff: Handoff | None = None
        self._task: asyncio.Task[None] | None = None
        self._handoffs: set[asyncio.Task[None]] = set()
        self._lookups: asyncio.Task[None] | None = None  # the leaders of held partitions
        self._joined = False

    @property
    def me(self) -> Member:
        return self.membership.me

    def bind(self, on_lost: Callable[[Key], None], handoff: Handoff) -> None:
        """What to do when a lease is lost, and how to hand a partition over."""
        self._on_lost, self._handoff = on_lost, handoff

    # ------------------------------------------------------------- life

    async def start(self) -> None:
        """Join the membership (raises DuplicateInstance), then keep it and the leases
        alive. Redis down at start is not fatal: the join is retried by the heartbeat."""
        # A process restarted after a crash finds its previous incarnation's entry still
        # alive: it waits for it to expire. One that is still renewed after a whole lease
        # belongs to another live process with this id: a configuration error.
        give_up = asyncio.get_running_loop().time() + self._ttl_s + 2 * self._heartbeat_s
        while True:
            try:
                self._set_members(await self.membership.join())
                self._joined = True
                break
            except RedisError as exc:
                log.error("cannot join the instance membership yet; retrying", error=str(exc))
                break
            except DuplicateInstance as exc:
                if asyncio.get_running_loop().time() >= give_up:
                    raise
                log.warning("waiting for an earlier incarnation to expire", error=str(exc))
                await asyncio.sleep(self._heartbeat_s)
        self._task = background.start(self._loop(), "ownership")

    async def close(self) -> None:
        """Hand every held partition over, then leave the membership."""
        for task in (self._task, self._lookups):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await asyncio.gather(
            *(self._hand_over(key) for key in list(self.held) if key not in self.handing_off),
            *self._handoffs,
            return_exceptions=True,
        )
        with contextlib.suppress(RedisError):
            await self.membership.leave()

    # ------------------------------------------------------------- asking

    def ready(self) -> bool:
        """Joined: only a member may take partitions (a second process with this id must be
        found out before it takes anything)."""
        return self._joined

    def nodes(self) -> NodeMap:
        if self.placement == "balanced" and not self.renames_nodes():
            # One instance: the brokers' own node ids, exactly what Kafka would say.
            return NodeMap("sidecar", self.me, [self.me], self._stride)
        return NodeMap(self.placement, self.me, self.members, self._stride)

    def renames_nodes(self) -> bool:
        """Whether clients know brokers by node ids other than the brokers' own (balanced
        placement with several instances), so answers naming a broker by id are renamed."""
        return self.placement == "balanced" and len(self.members) > 1

    def owner_of(self, key: Key) -> Member | None:
        """The member the placement gives this partition; None: unknown (leader unknown)."""
        leader = self.leader(key)
        return partition_owner(
            self.placement, key[0], key[1], None if leader is None else leader[0], self.members
        )

    def serves_here(self, key: Key) -> bool:
        """Whether this instance serves the partition: it holds the lease (and is not
        handing it over), or the placement gives it here (it takes the lease on first use),
        or nobody can be named (no leader known yet in sidecar placement)."""
        if key in self.handing_off:
            return False
        if key in self.held:
            return True
        owner = self.owner_of(key)
        return owner is None or owner.instance_id == self.me.instance_id

    def holds(self, key: Key) -> bool:
        """Whether this instance holds the partition's lease (renewed in time or not)."""
        return key in self.held

    def lease_valid(self, key: Key) -> bool:
        """Whether this instance holds the partition's lease and no other can have taken it
        since (its last renewal is not older than the lease's time)."""
        return key in self.held and self.leases.valid(key)

    def redirect(self, key: Key, holder: str | None = None) -> Redirect | None:
        """Where to send the partition's requests instead: the lease holder if one is
        known, else the member the placement names; None: no node can be named (yet)."""
        if holder is not None:
            member = next((m for m in self.members if m.instance_id == holder), None)
        else:
            member = self.owner_of(key)
        if member is None or member.instance_id == self.me.instance_id:
            return None
        return self._redirect_to(key, member)

    def _redirect_to(self, key: Key, owner: Member) -> Redirect | None:
        leader = self.leader(key)
        if leader is None:
            return None
        return Redirect(owner.instance_id, self.nodes().of(owner, leader[0]), leader[1])

    def leader(self, key: Key) -> tuple[int, int] | None:
        """The partition's leader broker id and epoch, as last learned."""
        found = self._leaders.get(key)
        if found is None:
            return None
        return found[0], found[1]

    def observe_leader(self, key: Key, leader_id: int, epoch: int) -> None:
        """A metadata response named the partition's leader."""
        if leader_id >= 0:
            self._leaders[key] = (leader_id, epoch, asyncio.get_running_loop().time())

    async def learn_leader(self, key: Key) -> tuple[int, int] | None:
        """The leader, asked of the cluster when not learned recently. Raises
        `NoSuchPartition` when Kafka answered that the partition does not exist."""
        found = self._leaders.get(key)
        now = asyncio.get_running_loop().time()
        if found is None or now - found[2] > LEADER_TTL_S:
            fresh = await self._leader_lookup(*key)
            if fresh is not None:
                self.observe_leader(key, *fresh)
        return self.leader(key)

    # ------------------------------------------------------------- leases held

    def granted(self, lease: Lease) -> None:
        self.held[lease.key] = lease
        metrics.OWNED_PARTITIONS.set(len(self.held))

    def dropped(self, key: Key) -> None:
        self.held.pop(key, None)
        metrics.OWNED_PARTITIONS.set(len(self.held))

    def let_go(self, key: Key) -> bool:
        """Give up the partition's lease as in a handoff (its topic was deleted: no instance
        is to hold it); whether that started now."""
        if key not in self.held or key in self.handing_off:
            return False
        # Its leader as learned is gone too: the partition's next request asks Kafka, and
        # is answered that no such partition exists, without a recovery taking it again.
        self._leaders.pop(key, None)
        self._start_handoff(key)
        return True

    async def still_mine(self, key: Key) -> bool:
        """Whether Redis still gives this instance the partition (asked now)."""
        lease = self.held.get(key)
        if lease is None:
            return False
        try:
            return not await self.leases.renew([lease])
        except RedisError:
            return False

    # ------------------------------------------------------------- the beat

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_s)
            with background.one_pass("ownership"):
                try:
                    await self._beat()
                except DuplicateInstance as exc:
                    log.critical("another process took this instance id", error=str(exc))
                    for key in list(self.held):
                        self._lost(key)
                except RedisError as exc:
                    log.warning("heartbeat failed", error=str(exc))

    async def _beat(self) -> None:
        beat = self.membership.heartbeat if self._joined else self.membership.join
        self._set_members(await beat())
        self._joined = True
        held = [lease for key, lease in self.held.items() if key not in self.handing_off]
        if held:
            for lease in await self.leases.renew(held):
                if self.held.get(lease.key) == lease:
                    log.error(
                        "partition lease lost (taken over)",
                        topic=lease.topic,
                        partition=lease.partition,
                    )
                    self._lost(lease.key)
        if self.placement == "sidecar" and (self._lookups is None or self._lookups.done()):
            # Beside the beat, not in it: a slow or unreachable broker must not hold back
            # the next renewal, which the maps kept in memory answer under. The handoffs
            # below go by what was learned so far (a beat later at most).
            self._lookups = asyncio.create_task(self._learn_leaders(list(self.held)))
        for key in list(self.held):
            owner = self.owner_of(key)
            mine = owner is None or owner.instance_id == self.me.instance_id
            if not mine and key not in self.handing_off:
                self._start_handoff(key)

    def _start_handoff(self, key: Key) -> None:
        self.handing_off.add(key)  # now: the task starts later, and one is enough
        task = asyncio.create_task(self._hand_over(key))
        self._handoffs.add(task)
        task.add_done_callback(self._handoffs.discard)

    async def _learn_leaders(self, keys: list[Key]) -> None:
        """Topic after topic (`leaders_by_topic`)."""
        for key, result in await leaders_by_topic(keys, self.learn_leader, topics_at_once=1):
            # No such partition: a topic deleted under it, which the engine's topic watch
            # lets go (`DedupEngine.confirm_topics`). Anything else: the next beat asks again.
            if isinstance(result, Exception) and not isinstance(result, NoSuchPartition):
                log.warning("partition leader not learned", topic=key[0], error=str(result))

    def _lost(self, key: Key) -> None:
        self.dropped(key)
        metrics.LEASES.labels("lost").inc()
        self._on_lost(key)

    async def _hand_over(self, key: Key) -> None:
        lease = self.held.get(key)
        if lease is None or self._handoff is None:
            self.handing_off.discard(key)
            return
        self.handing_off.add(key)  # (already, when started by `_start_handoff`)
        started = asyncio.get_running_loop().time()
        try:
            try:
                clean = await asyncio.wait_for(self._handoff(lease), HANDOFF_TIMEOUT_S)
            except Exception as exc:
                log.warning(
                    "handoff could not settle; releasing for a fenced takeover",
                    topic=key[0],
                    partition=key[1],
                    error=f"{type(exc).__name__}: {exc}",
                )
                clean = False
            await self.leases.release(lease, clean)
            metrics.LEASES.labels("released_clean" if clean else "released_unclean").inc()
            log.info(
                "partition handed over",
                topic=key[0],
                partition=key[1],
                clean=clean,
                seconds=round(asyncio.get_running_loop().time() - started, 3),
            )
        except RedisError as exc:
            log.warning("lease release failed; it expires instead", error=str(exc))
        finally:
            self.dropped(key)
            self.handing_off.discard(key)
            self._on_lost(key)

    def _set_members(self, members: list[Member]) -> None:
        if [m.instance_id for m in members] != [m.instance_id for m in self.members]:
            log.info("instances", members=[m.instance_id for m in members])
        self.members = members or [self.me]
