"""The sidecar deployment (compose.yaml) brought up and down from Python, for tests.

A program on the host reaches the sidecars by the names they advertise (kafka-1..3) once
they name 127.0.0.1 there; `with_host_names` gives one command that view without touching
the machine's /etc/hosts (a private mount namespace with its own copy).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from deploy.containers.engine import COMPOSE_FILE, EngineError
from deploy.containers.stack import HOST, port_free

PROJECT = "kafka-dedup-proxy"
# What compose.yaml publishes on loopback, per sidecar: admin, bootstrap, brokers 1..3.
SIDECARS = {f"kafka-{n}": 31000 + 100 * n for n in (1, 2, 3)}
ADMIN_OFFSET = 90
BOOTSTRAP_OFFSET = 92
PUBLISHED_PORTS = sorted(
    base + offset
    for base in SIDECARS.values()
    for offset in (ADMIN_OFFSET, BOOTSTRAP_OFFSET, 93, 94, 95)
)
UP_TIMEOUT_S = 240.0
# More than the proxies' drain timeout (30 s), as compose.yaml's stop_grace_period.
STOP_TIMEOUT_S = 40


def bootstrap(sidecar: str) -> str:
    """The bootstrap address of a sidecar, as clients name it (kafka-1:31192...)."""
    return f"{sidecar}:{SIDECARS[sidecar] + BOOTSTRAP_OFFSET}"


def admin_url(sidecar: str) -> str:
    """A sidecar's admin port as the host reaches it."""
    return f"http://{HOST}:{SIDECARS[sidecar] + ADMIN_OFFSET}"


def compose_command() -> list[str]:
    """The compose plugin where the docker CLI has it, else Debian's docker-compose."""
    plugin = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
    if plugin.returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise EngineError("neither `docker compose` nor docker-compose is installed")


class ComposeDeployment:
    """compose.yaml as one project: `up` (after removing what a killed run left), `down`
    (containers, network and volumes); a context manager does both."""

    def __init__(self, project: str = PROJECT, compose_file: Path = COMPOSE_FILE) -> None:
        self.project = project
        self.compose_file = compose_file
        self._compose = compose_command()

    def run(self, *args: str, timeout_s: float = 120.0) -> str:
        argv = [*self._compose, "-p", self.project, "-f", str(self.compose_file), *args]
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
        )
        if done.returncode != 0:
            raise EngineError(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr}")
        return done.stdout

    def up(self, timeout_s: float = UP_TIMEOUT_S) -> None:
        """Start everything and wait until every service with a HEALTHCHECK is healthy."""
        self.down()
        taken = [port for port in PUBLISHED_PORTS if not port_free(port)]
        if taken:
            raise EngineError(f"ports {taken} are taken; compose.yaml publishes them")
        deadline = time.monotonic() + timeout_s
        try:
            self.run("up", "-d", timeout_s=timeout_s)
            self._wait_ready(deadline)
        except BaseException:
            self.down()
            raise

    def down(self) -> None:
        self.run("down", "-v", "--remove-orphans", "-t", str(STOP_TIMEOUT_S), timeout_s=180)

    def container_id(self, service: str) -> str:
        ids = self.run("ps", "-q", service).split()
        if len(ids) != 1:
            raise EngineError(f"service {service} has containers {ids}")
        return ids[0]

    def inspect(self, service: str) -> dict[str, Any]:
        raw = _docker("inspect", self.container_id(service))
        state: dict[str, Any] = json.loads(raw)[0]["State"]
        return state

    def _wait_ready(self, deadline: float) -> None:
        services = self.run("config", "--services").split()
        pending = set(services)
        while pending:
            for service in sorted(pending):
                state = self.inspect(service)
                health = state.get("Health", {}).get("Status")
                if not state.get("Running") or health == "unhealthy":
                    raise EngineError(
                        f"{service} is {health or state.get('Status')}:\n{self.logs(service)}"
                    )
                if health in (None, "healthy"):
                    pending.discard(service)
            if pending and time.monotonic() > deadline:
                raise EngineError(f"not healthy in time: {sorted(pending)}")
            time.sleep(1.0)

    def logs(self, service: str, lines: int = 40) -> str:
        return self.run("logs", "--no-color", "--tail", str(lines), service)

    def exec(self, service: str, argv: list[str], stdin: bytes | None = None) -> str:
        """Run argv in a service's container; its standard output."""
        return _docker("exec", "-i", self.container_id(service), *argv, stdin=stdin)

    def __enter__(self) -> ComposeDeployment:
        self.up()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.down()


def _docker(*args: str, stdin: bytes | None = None, timeout_s: float = 180.0) -> str:
    done = subprocess.run(["docker", *args], input=stdin, capture_output=True, timeout=timeout_s)
    if done.returncode != 0:
        raise EngineError(f"docker {args[0]} failed ({done.returncode}):\n{done.stderr.decode()}")
    return done.stdout.decode()


def host_names_unavailable() -> str | None:
    """Why `with_host_names` cannot work here, or None."""
    if os.geteuid() != 0:
        return "a private /etc/hosts needs root (unshare --mount)"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    return None


def with_host_names(argv: list[str], names: list[str], hosts_file: Path) -> list[str]:
    """argv run where `names` resolve to 127.0.0.1, as with those names in /etc/hosts:
    in a mount namespace of its own, over a copy of /etc/hosts written to `hosts_file`."""
    current = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else ""
    hosts_file.write_text(f"{current.rstrip()}\n{HOST} {' '.join(names)}\n")
    script = 'mount --bind "$0" /etc/hosts && exec "$@"'
    return ["unshare", "--mount", "--", "sh", "-c", script, str(hosts_file), *argv]
