"""`serve --workers N`: N worker processes behind one bootstrap port.

Each worker is a full proxy instance (`python -m dedup serve`) with the supervisor's
settings, except for what must differ between them:

- its instance id, ``<instance id>-w<i>`` (fencing: a restarted worker fences what its
  previous run left in flight, and never what another worker writes);
- its broker listeners, ``broker_port_base + i * worker_port_stride + n`` for node n;
- its admin port, ``admin + i``;
- and the bootstrap listener, which every worker opens on the same port with SO_REUSEPORT:
  the kernel spreads new connections over the workers, and each answers with its own
  broker ports, so a client stays with the worker it reached first.

The supervisor forwards SIGTERM and SIGINT to the workers and waits for their drain,
restarts a worker that dies (with back-off), and gives up, with a non-zero exit, when a
worker cannot start at all (it exits with an error before its admin API ever answered: a
port in use, say). Workers get SIGTERM when the supervisor dies (Linux), so a
killed supervisor leaves no worker holding its ports.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import structlog
from pydantic import SecretStr
from pydantic_settings import NoDecode

from dedup.app.settings import Settings
from proxy.kafka.topology import Endpoint

log = structlog.get_logger(__name__)

ENV_PREFIX = "DEDUP_PROXY_"
# Restart back-off: doubles from the first delay after each quick death, up to the cap; a
# worker that ran this long before dying counts as healthy again.
RESTART_FIRST_DELAY_S = 0.5
RESTART_MAX_DELAY_S = 30.0
STABLE_RUN_S = 30.0
# Beyond the workers' own drain timeout before the supervisor SIGKILLs them.
STOP_GRACE_S = 10.0
POLL_S = 0.1


@dataclass(frozen=True)
class WorkerSpec:
    """What worker ``index`` gets of its own; everything else is the supervisor's."""

    index: int
    instance_id: str
    listen: str
    admin: str
    broker_port_base: int
    advertised_broker_port_base: int | None

    def overrides(self) -> dict[str, Any]:
        """The settings fields this worker sets differently from the supervisor."""
        return {
            "instance_id": self.instance_id,
            "listen": self.listen,
            "admin": self.admin,
            "broker_port_base": self.broker_port_base,
            "advertised_broker_port_base": self.advertised_broker_port_base,
            "reuse_port": True,
            "workers": 1,
        }

    @property
    def admin_url(self) -> str:
        endpoint = Endpoint.parse(self.admin)
        host = "127.0.0.1" if endpoint.host in ("0.0.0.0", "::", "") else endpoint.host
        return f"http://{host}:{endpoint.port}"


def plan_workers(settings: Settings) -> list[WorkerSpec]:
    """The workers of ``settings`` (whose validation checked that their ports fit)."""
    stride = settings.worker_port_stride
    admin = settings.admin_endpoint
    advertised = settings.advertised_broker_port_base
    return [
        WorkerSpec(
            index=index,
            instance_id=f"{settings.effective_instance_id}-w{index}",
            listen=settings.listen,
            admin=str(Endpoint(admin.host, admin.port + index)),
            broker_port_base=settings.effective_broker_port_base + index * stride,
            advertised_broker_port_base=None if advertised is None else advertised + index * stride,
        )
        for index in range(settings.workers)
    ]


def settings_environment(settings: Settings, overrides: Mapping[str, Any]) -> dict[str, str]:
    """``DEDUP_PROXY_<FIELD>`` variables that give a process exactly these settings (with
    ``overrides``): the supervisor's file, environment and flags, resolved once."""
    values = {**settings.model_dump(mode="json"), **overrides}
    for name in type(settings).model_fields:  # a dump masks secrets: the workers need them
        secret = getattr(settings, name)
        if isinstance(secret, SecretStr) and name not in overrides:
            values[name] = secret.get_secret_value()
    environment: dict[str, str] = {}
    for name, field in type(settings).model_fields.items():
        value = values.get(name)
        if value is None:
            continue  # unset, and nothing the worker inherits sets it either
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, list) and any(
            m is NoDecode or isinstance(m, NoDecode) for m in field.metadata
        ):
            text = ",".join(str(item) for item in value)
        elif isinstance(value, list | dict):
            text = json.dumps(value)
        else:
            text = str(value)
        environment[f"{ENV_PREFIX}{name.upper()}"] = text
    return environment


def worker_argv(spec: WorkerSpec, config: Path | None) -> list[str]:
    """The worker's command line. Its settings come from the environment
    (`settings_environment`); the flags repeat what tells the workers apart in `ps`."""
    argv = [sys.executable, "-m", "dedup", "serve"]
    if config is not None:
        argv += ["--config", str(config)]
    return [
        *argv,
        "--instance-id",
        spec.instance_id,
        "--listen",
        spec.listen,
        "--admin",
        spec.admin,
        "--broker-port-base",
        str(spec.broker_port_base),
    ]


def worker_env(
    settings: Settings, spec: WorkerSpec, inherited: Mapping[str, str]
) -> dict[str, str]:
    """The worker's environment: the inherited one without any other ``DEDUP_PROXY_``
    variable, plus the resolved settings."""
    kept = {k: v for k, v in inherited.items() if not k.upper().startswith(ENV_PREFIX)}
    return {**kept, **settings_environment(settings, spec.overrides())}


# ----------------------------------------------------------------------------- processes

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """For Popen's preexec_fn: the child gets SIGTERM when the supervisor dies (Linux)."""

    def arrange() -> None:
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # the parent died before the line above
            os.kill(os.getpid(), signal.SIGTERM)

    return arrange


def port_free(endpoint: Endpoint) -> bool:
    """Whether a listener could bind the address now (without SO_REUSEPORT: so a socket
    shared that way by another process counts as taken too)."""
    family = socket.AF_INET6 if ":" in endpoint.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((endpoint.host, endpoint.port))
        except OSError:
            return False
    return True


def serving_pid(admin_url: str) -> int | None:
    """The pid a proxy's /healthz reports (whether healthy or not), None if nothing answers."""
    try:
        with urllib.request.urlopen(f"{admin_url}/healthz", timeout=0.5) as answer:
            body = json.load(answer)
    except urllib.error.HTTPError as exc:  # 503: serving, upstream not (yet) reachable
        try:
            body = json.loads(exc.read())
        except ValueError:
            return None
    except (OSError, ValueError):
        return None
    pid = body.get("pid") if isinstance(body, dict) else None
    return pid if isinstance(pid, int) else None


@dataclass
class _Worker:
    spec: WorkerSpec
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    serving: bool = False  # its admin API answered since this start
    ever_served: bool = False
    quick_deaths: int = 0
    restart_at: float | None = None


class Supervisor:
    def __init__(self, settings: Settings, config: Path | None = None) -> None:
        self.settings = settings
        self.config = config
        self.workers = [_Worker(spec) for spec in plan_workers(settings)]
        self._stop_signal: int | None = None

    # ------------------------------------------------------------------ entry point

    def run(self) -> int:
        """Run the workers until SIGTERM or SIGINT; the exit code of the whole."""
        busy = self._busy_ports()
        if busy:
            log.error("cannot start workers: port in use", ports=busy)
            print(f"dedup-proxy: cannot listen: {'; '.join(busy)}", file=sys.stderr)
            return 1
        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, self._forward)
        try:
            for worker in self.workers:
                self._start(worker)
            log.info(
                "workers started",
                workers=len(self.workers),
                bootstrap=self.settings.listen,
                admins=[w.spec.admin for w in self.workers],
                pids=[w.process.pid for w in self.workers if w.process],
            )
            failed = self._supervise()
            code = self._stop_all()
            if failed is not None:
                print(f"dedup-proxy: {failed}", file=sys.stderr)
                return 1
            return code
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _busy_ports(self) -> list[str]:
        listen = self.settings.listen_endpoint
        checks = [(listen, "the bootstrap listener")]
        for worker in self.workers:
            checks.append(
                (Endpoint.parse(worker.spec.admin), f"worker {worker.spec.index}'s admin")
            )
        return [f"{where} ({what}) is in use" for where, what in checks if not port_free(where)]

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self._stop_signal is None:
            self._stop_signal = signum

    def _forward(self, signum: int, _frame: FrameType | None) -> None:
        """SIGHUP (read renewed certificates) is for the workers."""
        for worker in self.workers:
            if worker.process is not None and worker.process.poll() is None:
                worker.process.send_signal(signum)

    # ------------------------------------------------------------------ the loop

    def _supervise(self) -> str | None:
        """Until a stop signal; the reason to give up, if a worker cannot start at all."""
        while self._stop_signal is None:
            now = time.monotonic()
            for worker in self.workers:
                process = worker.process
                if process is None:
                    if worker.restart_at is not None and now >= worker.restart_at:
                        self._start(worker)
                    continue
                code = process.poll()
                if code is None:
                    if not worker.serving and serving_pid(worker.spec.admin_url) == process.pid:
                        worker.serving = worker.ever_served = True
                        log.info("worker serving", worker=worker.spec.index, pid=process.pid)
                    continue
                if not worker.ever_served and code > 0:
                    # It exited by itself before it ever served (a port in use, a bad
                    # setting): starting it again would fail the same way. One killed by a
                    # signal is restarted like any other.
                    log.error(
                        "worker could not start",
                        worker=worker.spec.index,
                        pid=process.pid,
                        exit_code=code,
                    )
                    return (
                        f"worker {worker.spec.index} ({worker.spec.instance_id}) exited with "
                        f"code {code} before it served; its own error is above"
                    )
                self._schedule_restart(worker, code, now)
            time.sleep(POLL_S)
        log.info("stopping workers", signal=signal.Signals(self._stop_signal).name)
        return None

    def _start(self, worker: _Worker) -> None:
        spec = worker.spec
        worker.process = subprocess.Popen(
            worker_argv(spec, self.config),
            env=worker_env(self.settings, spec, os.environ),
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent(os.getpid()),  # the supervisor runs no threads
        )
        worker.started_at = time.monotonic()
        worker.serving = False
        worker.restart_at = None

    def _schedule_restart(self, worker: _Worker, code: int, now: float) -> None:
        assert worker.process is not None
        ran_s = now - worker.started_at
        worker.quick_deaths = 0 if ran_s >= STABLE_RUN_S else worker.quick_deaths + 1
        backoff = RESTART_FIRST_DELAY_S * 2 ** max(0, worker.quick_deaths - 1)
        delay = min(RESTART_MAX_DELAY_S, backoff)
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        log.warning(
            "worker died; restarting",
            worker=worker.spec.index,
            instance_id=worker.spec.instance_id,
            pid=worker.process.pid,
            exit=how,
            ran_s=round(ran_s, 1),
            restart_in_s=delay,
        )
        worker.process = None
        worker.restart_at = now + delay

    def _stop_all(self) -> int:
        """SIGTERM every worker (they drain), SIGKILL any still there after the drain
        timeout; 0 if every worker stopped cleanly."""
        running = [w.process for w in self.workers if w.process is not None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.settings.drain_timeout_s + STOP_GRACE_S
        codes: list[int] = []
        for process in running:
            try:
                codes.append(process.wait(max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                log.error("worker did not stop in time; killing it", pid=process.pid)
                process.kill()
                codes.append(process.wait())
        bad = [c for c in codes if c != 0]
        log.info("workers stopped", exit_codes=codes)
        return 1 if bad else 0


def run_workers(settings: Settings, config: Path | None) -> int:
    return Supervisor(settings, config).run()
