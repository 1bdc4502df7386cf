"""Start a proxy as a child process and wait until it is healthy (demo, tests, benchmarks).

The proxy runs as a separate process on purpose: what clients talk to is exactly what an
operator runs, and the chaos tests can SIGKILL it.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any


def set_parent_death_signal() -> None:
    """In the child before exec: ask Linux to SIGTERM it when its parent process dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


_PR_SET_PDEATHSIG = 1


@dataclass
class ProxyProcess:
    upstream: str
    listen_port: int = 29092
    admin_port: int = 29080
    host: str = "127.0.0.1"
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    # A test run or demo that is itself killed must not leave a proxy holding its ports.
    die_with_parent: bool = True
    _process: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.listen_port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.host}:{self.admin_port}"

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "dedup",
            "serve",
            "--upstream",
            self.upstream,
            "--listen",
            f"{self.host}:{self.listen_port}",
            "--admin",
            f"{self.host}:{self.admin_port}",
            *self.extra_args,
        ]

    def start(self, timeout_s: float = 30.0) -> ProxyProcess:
        self._log = self.log_path.open("ab") if self.log_path else None
        output: IO[bytes] | int = self._log if self._log is not None else subprocess.DEVNULL
        self._process = subprocess.Popen(
            self.command(),
            stdout=output,
            stderr=output,
            env={**os.environ, **self.env},
            preexec_fn=set_parent_death_signal if self.die_with_parent else None,
        )
        self.wait_healthy(timeout_s)
        return self

    def health(self) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"{self.admin_url}/healthz", timeout=2) as answer:
                body: dict[str, Any] = json.load(answer)
                return body
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"{self.admin_url}/metrics", timeout=5) as answer:
            text: str = answer.read().decode()
            return text

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise RuntimeError(
                    f"proxy exited with code {self._process.returncode}; log: {self.log_path}"
                )
            health = self.health()
            if health is not None and health.get("pid") != self.pid:
                raise RuntimeError(
                    f"another process (pid {health.get('pid')}) serves {self.admin_url}; "
                    f"log: {self.log_path}"
                )
            if health is not None and health.get("status") == "ok":
                return
            time.sleep(0.2)
        raise TimeoutError(f"proxy not healthy after {timeout_s}s; log: {self.log_path}")

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (graceful: drains in-flight requests) and wait; returns the exit code."""
        if self._process is None:
            return 0
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return self._process.returncode

    def kill(self) -> None:
        """SIGKILL: the crash the chaos tests inject."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def __enter__(self) -> ProxyProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
