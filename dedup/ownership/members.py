"""Which proxy instances are alive: a membership list in Redis, renewed by heartbeats.

Each instance joins under its ``instance_id`` with a random incarnation (one per process)
and renews its entry every heartbeat; an entry not renewed for ``ttl`` is dead. A second
live process with the same id is refused at join (`DuplicateInstance`): two instances with
one id would share a transactional id and fence each other's writes. Expiry runs on
Redis's clock (``dedup/lua/members.lua``), so the instances' clocks need not agree.

Every member has a slot, a small number kept for good, from which the node ids clients
see for it are made (`dedup.ownership.nodes`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dedup.state import DedupState, Script
from proxy.kafka.topology import NODE_ID, Endpoint

_MEMBERS = Script.load("members")


class DuplicateInstance(Exception):
    """Another live process uses this instance id."""


@dataclass(frozen=True, slots=True, order=True)
class Member:
    instance_id: str
    incarnation: str
    slot: int
    host: str  # the advertised host clients connect to
    port_base: int  # the advertised port of its listener for broker node_id_offset
    node_id_offset: int
    local_broker_id: int | None = None  # sidecar placement: the broker it stands beside
    # SNI routing: every broker on port_base, under this name with its id for {node_id}.
    sni_host_pattern: str | None = None

    def endpoint_for(self, broker_id: int) -> Endpoint:
        """Where a client reaches ``broker_id`` through this member."""
        if self.sni_host_pattern is not None:
            return Endpoint(self.sni_host_pattern.replace(NODE_ID, str(broker_id)), self.port_base)
        return Endpoint(self.host, self.port_base + broker_id - self.node_id_offset)

    def info(self) -> str:
        info: dict[str, Any] = {
            "host": self.host,
            "port_base": self.port_base,
            "node_id_offset": self.node_id_offset,
            "local_broker_id": self.local_broker_id,
        }
        if self.sni_host_pattern is not None:  # absent otherwise: older members parse it
            info["sni_host_pattern"] = self.sni_host_pattern
        return json.dumps(info, sort_keys=True)

    @classmethod
    def parse(cls, instance_id: str, entry: str) -> Member:
        incarnation, slot, info = entry.split(" ", 2)
        data: dict[str, Any] = json.loads(info)
        return cls(
            instance_id,
            incarnation,
            int(slot),
            str(data["host"]),
            int(data["port_base"]),
            int(data["node_id_offset"]),
            None if data.get("local_broker_id") is None else int(data["local_broker_id"]),
            None if data.get("sni_host_pattern") is None else str(data["sni_host_pattern"]),
        )


class Membership:
    def __init__(self, state: DedupState, me: Member, ttl_s: float) -> None:
        self.me = me
        self._state = state
        self._ttl_ms = int(ttl_s * 1000)
        prefix = state.key_prefix
        self._keys = (
            f"{prefix}:{{members}}:info",
            f"{prefix}:{{members}}:alive",
            f"{prefix}:{{members}}:slots",
            f"{prefix}:{{members}}:next_slot",
        )

    async def join(self) -> list[Member]:
        """Enter the list (or renew): the live members, this one included, by id.
        Raises DuplicateInstance."""
        return await self._call("join")

    async def heartbeat(self) -> list[Member]:
        return await self._call("beat")

    async def leave(self) -> None:
        await self._call("leave")

    async def _call(self, mode: str) -> list[Member]:
        args = [mode, self.me.instance_id, self.me.incarnation, str(self._ttl_ms), self.me.info()]
        (reply,) = await self._state.run_scripts([(_MEMBERS, self._keys, args)])
        status, *rest = (_text(x) for x in reply)
        if status == "taken":
            incarnation, left_ms = rest
            raise DuplicateInstance(
                f"instance id {self.me.instance_id!r} is in use by another live proxy process "
                f"(incarnation {incarnation}, its entry expires in {int(left_ms) / 1000:.1f} s): "
                "give every instance its own --instance-id"
            )
        slot, entries = rest[0], rest[1:]
        if mode != "leave":
            self.me = _with_slot(self.me, int(slot))
        members = [
            Member.parse(i, e) for i, e in zip(entries[::2], entries[1::2], strict=True) if e
        ]
        return sorted(members)


def _with_slot(member: Member, slot: int) -> Member:
    if member.slot == slot:
        return member
    return Member(
        member.instance_id,
        member.incarnation,
        slot,
        member.host,
        member.port_base,
        member.node_id_offset,
        member.local_broker_id,
        member.sni_host_pattern,
    )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
