"""A group of dedup proxy instances on one Redis in front of one cluster, as a test runs
them: real processes sharing a Redis key prefix and a snapshot topic, each one killed,
frozen and started again as the same instance."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from deploy.launcher import ProxyProcess
from deploy.local import EnvInfo
from tests.support.ports import ProxyPorts
from tests.support.proxy_api import admin_call, metric_total
from tests.support.restartable import RestartableProxy


class Group:
    """Instances inst-0..n-1 (one per entry of `ports`) sharing a key prefix and a
    snapshot topic."""

    def __init__(
        self,
        env: EnvInfo,
        log_dir: Path,
        ports: Sequence[ProxyPorts],
        redis_db: int,
        name: str,
        per_member: Sequence[Mapping[str, str]] = (),
        **settings: str,
    ) -> None:
        """`redis_db` is the calling module's own; `settings` are for every instance, and
        `per_member[i]` for inst-i alone."""
        tag = uuid.uuid4().hex[:8]
        shared = {
            "DEDUP_PROXY_REDIS_KEY_PREFIX": f"{name}-{tag}",
            "DEDUP_PROXY_SNAPSHOT_TOPIC": f"__dedup_snapshots_{name}_{tag}",
            **settings,
        }
        self.members = [
            RestartableProxy(
                env,
                log_dir / f"inst-{i}",
                member_ports,
                redis_db,
                name,
                DEDUP_PROXY_INSTANCE_ID=f"inst-{i}-{tag}",
                **shared,
                **(per_member[i] if i < len(per_member) else {}),
            )
            for i, member_ports in enumerate(ports)
        ]
        for member in self.members:
            member.log_dir.mkdir(parents=True, exist_ok=True)
        self.ids = [member.settings["DEDUP_PROXY_INSTANCE_ID"] for member in self.members]

    def start(self) -> Group:
        for member in self.members:
            member.start()
        return self

    def proxy(self, i: int) -> ProxyProcess:
        process = self.members[i].process
        assert process is not None, f"inst-{i} is not running"
        return process

    def bootstrap(self) -> str:
        """Every running instance's client listener, as a client's bootstrap list."""
        return ",".join(m.process.bootstrap for m in self.members if m.process is not None)

    def ownership(self, i: int) -> dict[str, Any]:
        found: dict[str, Any] = admin_call(self.proxy(i), "GET", "/v1/ownership")
        return found

    def holder(self, topic: str, partition: int) -> int:
        """The index of the instance holding the partition's lease (asked of each)."""
        name = f"{topic}/{partition}"
        holders = [
            i
            for i, m in enumerate(self.members)
            if m.process is not None and name in self.ownership(i)["held"]
        ]
        assert len(holders) == 1, f"{name} held by {holders}"
        return holders[0]

    def metric(self, series: str) -> float:
        return sum(metric_total(m.process, series) for m in self.members if m.process is not None)

    def stop(self) -> None:
        for member in self.members:
            if member.process is not None:
                member.process.kill()
                member.process = None
