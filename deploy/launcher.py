"""Start a proxy as a child process and wait until it is healthy (demo, tests, benchmarks).

The proxy runs as a separate process on purpose: what clients talk to is exactly what an
operator runs, and the chaos tests can SIGKILL it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import ssl
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
    # `serve --workers N`: worker i serves the admin API on admin_port + i.
    workers: int = 1
    # The admin API speaks HTTPS (admin_tls_* settings): the CA its certificate chains to,
    # and a client certificate with its key (admin_tls_client_ca_file: mutual TLS).
    admin_ca_file: Path | None = None
    admin_client_cert: tuple[Path, Path] | None = None
    _process: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.listen_port}"

    @property
    def admin_url(self) -> str:
        scheme = "http" if self.admin_ca_file is None else "https"
        return f"{scheme}://{self.host}:{self.admin_port}"

    @property
    def admin_tls(self) -> ssl.SSLContext | None:
        """For requests to an HTTPS admin API (None: plain HTTP)."""
        if self.admin_ca_file is None:
            return None
        context = ssl.create_default_context(cafile=self.admin_ca_file)
        if self.admin_client_cert is not None:
            context.load_cert_chain(*self.admin_client_cert)
        return context

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    def worker_admin_urls(self) -> list[str]:
        base = self.admin_url.rsplit(":", 1)[0]
        return [f"{base}:{self.admin_port + i}" for i in range(self.workers)]

    def worker_pids(self) -> list[int | None]:
        """The pid serving each worker's admin port (None: not answering)."""
        return [_health_pid(_health(url, self.admin_tls)) for url in self.worker_admin_urls()]

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
            *(["--workers", str(self.workers)] if self.workers > 1 else []),
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
        """The /healthz answer while healthy (200), else None."""
        health = self.health_answer()
        return health if health is not None and health.get("status") == "ok" else None

    def health_answer(self) -> dict[str, Any] | None:
        """The /healthz answer, healthy (200) or not (503); None if nothing answers."""
        return _health(self.admin_url, self.admin_tls)

    def broker_port(self, node_id: int = 0, timeout_s: float = 10.0) -> int:
        """The port of this proxy's listener for upstream broker ``node_id``, as /healthz
        reports it, healthy or not: a proxy whose metadata is stale still listens."""
        deadline = time.monotonic() + timeout_s
        while True:
            health = self.health_answer()
            port = None if health is None else health.get("broker_listeners", {}).get(str(node_id))
            if isinstance(port, int):
                return port
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"no listener for broker {node_id} after {timeout_s}s "
                    f"(/healthz answered {health}); log: {self.log_path}"
                )
            time.sleep(0.2)

    def metrics_text(self) -> str:
        with urllib.request.urlopen(
            f"{self.admin_url}/metrics", timeout=5, context=self.admin_tls
        ) as answer:
            text: str = answer.read().decode()
            return text

    def wait_healthy(self, timeout_s: float) -> None:
        """Until the proxy (every worker, with several) reports itself healthy."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise RuntimeError(
                    f"proxy exited with code {self._process.returncode}; log: {self.log_path}"
                )
            if all(self._healthy(url) for url in self.worker_admin_urls()):
                return
            time.sleep(0.2)
        raise TimeoutError(f"proxy not healthy after {timeout_s}s; log: {self.log_path}")

    def _healthy(self, admin_url: str) -> bool:
        health = _health(admin_url, self.admin_tls)
        if health is None:
            return False
        pid = _health_pid(health)
        # A worker of `serve --workers` is a child of the process started here.
        ours = pid == self.pid if self.workers == 1 else _parent_pid(pid) == self.pid
        if not ours:
            raise RuntimeError(
                f"another process (pid {pid}) serves {admin_url}; log: {self.log_path}"
            )
        return health.get("status") == "ok"

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (graceful: drains in-flight requests) and wait; returns the exit code."""
        if self._process is None:
            return 0
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._dump_stacks()
                self._process.kill()
                self._process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return self._process.returncode

    def _dump_stacks(self) -> None:
        """Before a stuck proxy is killed: its tasks (SIGUSR2) and threads (SIGUSR1) in its
        log, to show where it hung."""
        assert self._process is not None
        for sig in (signal.SIGUSR2, signal.SIGUSR1):
            with contextlib.suppress(ProcessLookupError):
                self._process.send_signal(sig)
            time.sleep(1.0)

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


def _health(admin_url: str, tls: ssl.SSLContext | None = None) -> dict[str, Any] | None:
    """The /healthz answer, healthy (200) or not (503); None if nothing answers."""
    try:
        with urllib.request.urlopen(f"{admin_url}/healthz", timeout=2, context=tls) as answer:
            body: dict[str, Any] = json.load(answer)
            return body
    except urllib.error.HTTPError as exc:  # 503: serving, but not healthy (yet)
        try:
            unhealthy: dict[str, Any] = json.loads(exc.read())
            return unhealthy
        except ValueError:
            return None
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _health_pid(health: dict[str, Any] | None) -> int | None:
    pid = None if health is None else health.get("pid")
    return pid if isinstance(pid, int) else None


def _parent_pid(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[1])
