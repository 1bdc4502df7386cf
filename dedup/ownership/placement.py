"""Who should own a partition, from the live members alone (pure functions).

- ``balanced``: rendezvous hashing: each partition goes to the member with the highest
  hash of (partition, member). A member joining or leaving moves only the partitions it
  wins or held, and every instance with the same member list agrees.
- ``sidecar``: the member standing beside the partition's leader broker
  (``local_broker_id``); ownership follows leadership. A broker with no live sidecar has
  its partitions placed, all together, on one member chosen by rendezvous on the broker.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from dedup.ownership.members import Member


def _score(subject: str, member: Member) -> bytes:
    return hashlib.blake2b(f"{subject}\0{member.instance_id}".encode(), digest_size=8).digest()


def rendezvous(subject: str, members: Sequence[Member]) -> Member | None:
    if not members:
        return None
    return max(members, key=lambda member: _score(subject, member))


def broker_owner(broker_id: int, members: Sequence[Member]) -> Member | None:
    """Sidecar placement: the member beside this broker, else one chosen for it."""
    beside = [m for m in members if m.local_broker_id == broker_id]
    if beside:
        return min(beside)  # one per broker is the deployment; min keeps a tie stable
    return rendezvous(f"broker/{broker_id}", members)


def partition_owner(
    placement: str, topic: str, partition: int, leader_id: int | None, members: Sequence[Member]
) -> Member | None:
    """The member that should own the partition; None when no member (or leader) is known."""
    if placement == "sidecar":
        return None if leader_id is None else broker_owner(leader_id, members)
    return rendezvous(f"{topic}/{partition}", members)
