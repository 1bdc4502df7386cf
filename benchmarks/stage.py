"""The stage a side-by-side benchmark runs on: the environment (local or given), a
pass-through and a dedup proxy on ports of the benchmark's own, its topics and Redis keys,
and their teardown, with the processes pinned to CPUs if asked (`benchmarks.pinning`).
Built from `benchmarks.passthrough`'s pieces; used by `kafka_tools` and `stall`."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from benchmarks.passthrough import (
    DIRECT,
    LABELS,
    PROXY_TARGETS,
    SHORT,
    BenchmarkError,
    Environment,
    ProxyTarget,
    RedisStats,
    Topics,
    close_environment,
    make_proxies,
    open_environment,
    port_listening,
    sigterm_as_interrupt,
    start_proxy,
)
from benchmarks.passthrough import _ports as proxy_ports
from benchmarks.pinning import add_pin_argument, pinned


def add_stage_arguments(
    parser: argparse.ArgumentParser, default_ports: Mapping[str, tuple[int, int, int]]
) -> None:
    """The options of where a benchmark runs: --bootstrap/--redis, --keep-env, --pin, and
    each proxy's ports."""
    parser.add_argument("--bootstrap", help="benchmark this Kafka instead of the local one")
    parser.add_argument("--redis", help="Redis URL for the proxies (required with --bootstrap)")
    parser.add_argument(
        "--keep-env",
        action="store_true",
        help="leave the local environment running if the benchmark started it",
    )
    add_pin_argument(parser)
    for target in PROXY_TARGETS:
        default = default_ports[target]
        parser.add_argument(
            f"--{target}-ports",
            type=proxy_ports,
            default=default,
            metavar="LISTEN,ADMIN,BROKER_BASE",
            help=f"ports of the {SHORT[target]} proxy (default {','.join(map(str, default))})",
        )


@dataclass
class StageSettings:
    out: Path
    ports: dict[str, tuple[int, int, int]]  # target -> LISTEN, ADMIN, BROKER_BASE
    bootstrap: str | None = None  # an external Kafka (with redis) instead of the local one
    redis: str | None = None
    keep_env: bool = False
    proxy_env: Mapping[str, str] = field(default_factory=dict)  # extra DEDUP_PROXY_* settings
    pin: bool = False  # `benchmarks.pinning`


class StagedRun(Protocol):
    """What a benchmark's settings say of its stage."""

    out: Path
    ports: dict[str, tuple[int, int, int]]
    bootstrap: str | None
    redis: str | None
    keep_env: bool
    pin: bool


def stage_settings(settings: StagedRun) -> StageSettings:
    return StageSettings(
        settings.out,
        settings.ports,
        settings.bootstrap,
        settings.redis,
        settings.keep_env,
        pin=settings.pin,
    )


class Stage:
    """Open with `open()`, always `close()`; `bootstraps[target]` is where clients go."""

    def __init__(self, settings: StageSettings, console: Any, meta: dict[str, Any], name: str):
        self.settings = settings
        self.console = console
        self.meta = meta
        self.run_id = f"{os.getpid()}-{int(time.time())}"
        self.topic_prefix = f"bench-{name}-{self.run_id}"
        self.environment: Environment | None = None
        self.proxies: dict[str, ProxyTarget] = {}
        self._topics: Topics | None = None
        self._redis: RedisStats | None = None
        self.bootstraps: dict[str, str] = {}
        self.started = time.monotonic()
        self._exits = contextlib.ExitStack()  # undone first on close: the pinning

    @property
    def topics(self) -> Topics:
        assert self._topics is not None, "the stage is not open"
        return self._topics

    @property
    def redis(self) -> RedisStats:
        assert self._redis is not None, "the stage is not open"
        return self._redis

    @contextlib.contextmanager
    def opened(self) -> Iterator[Stage]:
        """The stage open for the block and closed after it, whatever ends it (SIGTERM
        is taken as Ctrl-C)."""
        with sigterm_as_interrupt():
            try:
                self.open()
                yield self
            finally:
                self.close()

    def open(self) -> None:
        settings = self.settings
        for target in PROXY_TARGETS:
            busy = [p for p in settings.ports[target] if port_listening(p)]
            if busy:
                raise BenchmarkError(f"port(s) {busy} have a listener: see --{target}-ports")
        self.environment = open_environment(settings.bootstrap, settings.redis, settings.keep_env)
        self.meta["environment"] = self.environment.description
        self.say(self.environment.description)
        self._redis = RedisStats(self.environment.redis)
        self._topics = Topics(self.environment.bootstrap, self.topic_prefix)
        self.meta["brokers"] = self._topics.brokers
        self.bootstraps[DIRECT] = self.environment.bootstrap
        proxies = make_proxies(
            settings.ports, settings.out, self.environment, self.run_id, settings.proxy_env
        )
        for proxy in proxies:
            self.proxies[proxy.target] = proxy
            start_proxy(proxy.process, proxy.ports, lambda text: self.say(f"[yellow]{text}[/]"))
            self.bootstraps[proxy.target] = proxy.process.bootstrap
            self.say(
                f"{LABELS[proxy.target]}: pid {proxy.process.pid} on {proxy.process.bootstrap}"
            )
        if settings.pin:
            pids = [proxy.process.pid for proxy in self.proxies.values()]
            pinning = self._exits.enter_context(pinned(pids, self.say))
            self.meta["pinning"] = pinning.describe()

    def close(self) -> None:
        self._exits.close()
        for proxy in self.proxies.values():
            code = proxy.process.stop()
            if code not in (0, None):
                self.meta.setdefault("oddities", []).append(f"{proxy.target} proxy exited {code}")
        if self._topics is not None:
            self._topics.delete_all()
        if self._redis is not None:
            for proxy in self.proxies.values():
                with contextlib.suppress(Exception):
                    self._redis.delete_prefix(proxy.key_prefix)
            with contextlib.suppress(Exception):
                self._redis.client.close()
        if self.environment is not None:
            close_environment(self.environment)

    def say(self, text: str) -> None:
        elapsed = time.monotonic() - self.started
        self.console.print(f"[dim]{elapsed:6.1f}s[/] {text}", highlight=False)

    def create_topic(self, slug: str, config: dict[str, str] | None = None) -> str:
        return self.topics.create(slug, 1, config)


PYTHON_LOOP_ADDITIONS = 10_000_000


def python_loop_s() -> float:
    """Seconds this machine takes now for a pure-Python loop of 10M additions: the
    interpreter's speed, which is what the proxy runs on. Shared machines differ by several
    times from day to day (0.47 s to 4.2 s here); written beside a run's figures, it tells
    which runs can be set side by side."""
    started = time.perf_counter()
    total = 0
    for n in range(PYTHON_LOOP_ADDITIONS):
        total += n
    return round(time.perf_counter() - started, 3)


def git_commit() -> str:
    """The checkout's commit (short), for the results' metadata; "" outside a git checkout."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=10,
        )
        return done.stdout.strip()
    return ""
