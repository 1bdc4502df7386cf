"""The container engine and the project's images, as `engine.sh` provides them.

`ensure()` starts an engine where none answers and builds whatever image is out of date;
on a machine where containers cannot run it raises `EngineUnavailable` with the reason,
which tests turn into a skip. Any other failure (a broken image build) is an `EngineError`.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENGINE_SH = HERE / "engine.sh"
COMPOSE_FILE = HERE / "compose.yaml"
K8S_DIR = HERE / "k8s"
# engine.sh's exit status when containers cannot run on this machine.
UNAVAILABLE_STATUS = 3
# A fresh machine installs the engine and builds every image: minutes, not seconds.
ENSURE_TIMEOUT_S = 900.0

REPOSITORY = "kafka-dedup-proxy"
INPUTS_LABEL = "org.kafka-dedup-proxy.inputs"


def image(name: str) -> str:
    """The project's image `name` (kafka, redis, toxiproxy, proxy) as engine.sh tags it."""
    return f"{REPOSITORY}/{name}:latest"


KAFKA_IMAGE = image("kafka")
REDIS_IMAGE = image("redis")
TOXIPROXY_IMAGE = image("toxiproxy")
PROXY_IMAGE = image("proxy")


class EngineUnavailable(RuntimeError):
    """Containers cannot run on this machine; the message says why."""


class EngineError(RuntimeError):
    """The engine or an image could not be brought up to date."""


@dataclass(frozen=True)
class Engine:
    """An engine that answers, with the project's images built."""

    docker_host: str

    def environ(self) -> dict[str, str]:
        """What the docker CLI, compose and testcontainers need to use this engine (no
        Ryuk: the tests remove what they start themselves)."""
        return {
            "DOCKER_HOST": self.docker_host,
            "TESTCONTAINERS_RYUK_DISABLED": "true",
            "TESTCONTAINERS_HOST_OVERRIDE": "127.0.0.1",
            "TESTCONTAINERS_CONNECTION_MODE": "docker_host",
        }

    def activate(self) -> None:
        """Point this process (and what it starts) at the engine."""
        os.environ.update(self.environ())


def ensure(images: bool = True, timeout_s: float = ENSURE_TIMEOUT_S) -> Engine:
    """An engine that answers (started if need be) and, with `images`, every image up to
    date. Quick when nothing changed: one hash per image."""
    command = ["bash", str(ENGINE_SH), "up" if images else "host"]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError as exc:
        raise EngineUnavailable(f"cannot run {ENGINE_SH}: {exc}") from exc
    except subprocess.TimeoutExpired as exc:
        raise EngineError(f"{' '.join(command)} took longer than {timeout_s:.0f} s") from exc
    if done.returncode == UNAVAILABLE_STATUS:
        lines = done.stderr.strip().splitlines()
        raise EngineUnavailable(lines[-1] if lines else "containers cannot run here")
    if done.returncode != 0:
        raise EngineError(f"{' '.join(command)} failed ({done.returncode}):\n{_tail(done.stderr)}")
    return Engine(docker_host=done.stdout.strip().splitlines()[-1])


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
