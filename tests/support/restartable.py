"""A dedup proxy that a test can kill with -9 and start again as the same instance (ports,
instance id, Redis database and key prefix, snapshot topic), as a supervisor would."""

from __future__ import annotations

import uuid
from pathlib import Path

from deploy.launcher import ProxyProcess
from deploy.local import EnvInfo
from tests.support.ports import ProxyPorts


class RestartableProxy:
    def __init__(
        self,
        env: EnvInfo,
        log_dir: Path,
        ports: ProxyPorts,
        redis_db: int,
        name: str,
        **settings: str,
    ) -> None:
        """`redis_db` should be the calling module's own, so a FLUSHDB there touches no
        other test's state; `settings` are DEDUP_PROXY_* variables."""
        self.env = env
        self.ports = ports
        self.redis_url = env.redis.rsplit("/", 1)[0] + f"/{redis_db}"
        self.snapshot_topic = f"__dedup_snapshots_{name}_{uuid.uuid4().hex[:8]}"
        self.settings = {
            "DEDUP_PROXY_REDIS": self.redis_url,
            "DEDUP_PROXY_REDIS_KEY_PREFIX": f"{name}-{uuid.uuid4().hex[:8]}",
            "DEDUP_PROXY_INSTANCE_ID": f"{name}-test-{uuid.uuid4().hex[:8]}",
            "DEDUP_PROXY_SNAPSHOT_TOPIC": self.snapshot_topic,
            **settings,
        }
        self.log_dir = log_dir
        self.runs = 0
        self.process: ProxyProcess | None = None

    def start(self) -> ProxyProcess:
        self.runs += 1
        self.process = ProxyProcess(
            upstream=self.env.bootstrap,
            listen_port=self.ports.listen,
            admin_port=self.ports.admin,
            extra_args=["--broker-port-base", str(self.ports.broker_base), "--log-format", "json"],
            env=self.settings,
            log_path=self.log_dir / f"proxy-{self.runs}.log",
        ).start()
        return self.process

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()  # SIGKILL: no drain, no flush, writes left in flight
        self.process = None

    def stop(self) -> None:
        if self.process is not None:
            assert self.process.stop() == 0
            self.process = None

    def log_events(self) -> list[str]:
        """Every log line of every run so far."""
        return [
            line
            for run in range(1, self.runs + 1)
            for line in (self.log_dir / f"proxy-{run}.log").read_text().splitlines()
        ]

    def log_lines(self, words: str) -> list[str]:
        return [line for line in self.log_events() if words in line]
