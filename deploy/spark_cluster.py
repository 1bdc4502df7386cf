"""A standalone Spark cluster on loopback: a master and N workers run from the installed
pyspark's own jars and launcher (``bin/spark-class``), each a detached process, so the
Spark job can run beyond one process (``dedup-proxy spark run --master
spark://127.0.0.1:PORT``) and lose a worker under it.

Everything lives under a home directory (``$DEDUP_SPARK_CLUSTER_HOME``, else
``${XDG_STATE_HOME:-~/.local/state}/kafka-dedup-proxy/spark-cluster``, beside the local
environment's home rather than in it, which ``local down --purge`` empties)::

    state.json                              worker count, size and ports
    master/spark.conf                       its properties; the path marks the process as ours
    master/process.log, master.pid          the master's log and pid
    worker-<i>/spark.conf, process.log, worker.pid
    worker-<i>/work/<app>/<executor>/       an executor's stdout, stderr and fetched jars
    worker-<i>/local/                       its executors' shuffle files and scratch space

Every process runs on this host, so a local directory is storage every worker sees: the
job's sink and checkpoint can be plain paths. Workers on several hosts would need them on
shared storage (HDFS, S3, a shared volume).

Each worker is a process group of its own (the worker JVM, its executors' JVMs and their
Python workers): ``kill_worker`` SIGKILLs the whole group, like a machine that is lost.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from deploy.config import HOST
from deploy.paths import MissingRuntimeError
from deploy.processes import (
    ManagedProcess,
    home_lock,
    stop_all,
    tail,
    wait_port_closed,
)

STATE_VERSION = 1
HOME_ENV = "DEDUP_SPARK_CLUSTER_HOME"
PORT_ENV = "DEDUP_SPARK_CLUSTER_PORT"
# Below Linux's ephemeral range (32768+), where outgoing connections cannot hold them.
DEFAULT_PORT_BASE = 30700
MAX_WORKERS = 9
START_TIMEOUT = 60.0
STOP_TIMEOUT = 20.0
# Heap of the master and worker daemons (SPARK_DAEMON_MEMORY); executors are sized apart.
DAEMON_MEMORY = "256m"


class SparkClusterError(RuntimeError):
    """The cluster could not be brought to the requested state."""


@dataclass(frozen=True)
class ClusterPorts:
    """The master's RPC port is ``base`` and its web UI (which also answers the JSON status
    this module reads) ``base + 1``; worker i listens on ``base + 10 + i``, its UI on
    ``base + 20 + i``. Executors and the driver take ports of the kernel's choosing."""

    base: int = DEFAULT_PORT_BASE

    def __post_init__(self) -> None:
        if not 1024 <= self.base <= 32768 - 20 - MAX_WORKERS:
            raise ValueError(
                f"Spark cluster port base {self.base} is outside 1024..{32768 - 20 - MAX_WORKERS}"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ClusterPorts:
        env = os.environ if environ is None else environ
        value = env.get(PORT_ENV, "")
        return cls(int(value)) if value else cls()

    @property
    def master(self) -> int:
        return self.base

    @property
    def master_ui(self) -> int:
        return self.base + 1

    def worker(self, index: int) -> int:
        return self.base + 10 + index

    def worker_ui(self, index: int) -> int:
        return self.base + 20 + index


@dataclass(frozen=True)
class ClusterShape:
    """How many workers and what each offers to executors."""

    workers: int = 2
    cores: int = 1
    memory: str = "1g"

    def __post_init__(self) -> None:
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ValueError(f"workers must be 1..{MAX_WORKERS}, not {self.workers}")
        if self.cores < 1:
            raise ValueError(f"cores must be at least 1, not {self.cores}")


@dataclass(frozen=True)
class ClusterInfo:
    master_url: str  # what `spark run --master` takes
    master_ui: str
    workers: dict[int, str]  # index -> host:port

    def to_json(self) -> dict[str, Any]:
        return {
            "master": self.master_url,
            "master_ui": self.master_ui,
            "workers": {str(i): address for i, address in sorted(self.workers.items())},
        }


def cluster_home(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    explicit = env.get(HOME_ENV, "")
    if explicit:
        return Path(explicit).expanduser().resolve()
    value = env.get("XDG_STATE_HOME", "")
    # XDG says relative values are invalid and must be ignored.
    base = Path(value) if value and os.path.isabs(value) else Path.home() / ".local" / "state"
    return base / "kafka-dedup-proxy" / "spark-cluster"


def spark_home() -> Path:
    """The installed pyspark's directory: Spark's jars and its bin/spark-class are there."""
    from dedup.spark.runtime import spark_version

    spark_version()  # pyspark is installed, or the error says how to install it
    import pyspark

    home = Path(pyspark.__file__).resolve().parent
    if not os.access(home / "bin" / "spark-class", os.X_OK):
        raise MissingRuntimeError(f"{home}/bin/spark-class is missing or not executable")
    return home


def master_properties() -> str:
    return (
        "# The lab's standalone Spark master (deploy/spark_cluster.py).\n"
        # No REST submission port: jobs connect as clients to the RPC port.
        "spark.master.rest.enabled false\n"
    )


def worker_properties() -> str:
    return (
        "# A worker of the lab's standalone Spark cluster (deploy/spark_cluster.py).\n"
        # Finished applications' directories (executor logs) stay until `down --purge`.
        "spark.worker.cleanup.enabled false\n"
    )


class SparkCluster:
    """Starts, stops, kills and inspects the cluster under `home`. Public methods that
    change something take a file lock on the home, so concurrent callers serialize."""

    def __init__(self, home: Path | None = None, ports: ClusterPorts | None = None) -> None:
        self.home = home if home is not None else cluster_home()
        self.ports = ports if ports is not None else ClusterPorts.from_env()

    # --- layout -------------------------------------------------------------------------

    @property
    def master_url(self) -> str:
        return f"spark://{HOST}:{self.ports.master}"

    @property
    def master_ui(self) -> str:
        return f"http://{HOST}:{self.ports.master_ui}"

    def worker_dir(self, index: int) -> Path:
        return self.home / f"worker-{index}"

    def work_dir(self, index: int) -> Path:
        """Where worker `index` keeps its executors' directories (logs, fetched jars)."""
        return self.worker_dir(index) / "work"

    def _master_process(self) -> ManagedProcess:
        directory = self.home / "master"
        return ManagedProcess(
            name="spark master",
            pid_file=directory / "master.pid",
            log_file=directory / "process.log",
            marker=str(directory / "spark.conf"),
        )

    def _worker_process(self, index: int) -> ManagedProcess:
        directory = self.worker_dir(index)
        return ManagedProcess(
            name=f"spark worker {index}",
            pid_file=directory / "worker.pid",
            log_file=directory / "process.log",
            marker=str(directory / "spark.conf"),
        )

    def _recorded_workers(self) -> list[int]:
        """Worker indexes with a directory, whatever state.json says."""
        found: list[int] = []
        for directory in self.home.glob("worker-*"):
            with contextlib.suppress(ValueError):
                found.append(int(directory.name.removeprefix("worker-")))
        return sorted(found)

    # --- state --------------------------------------------------------------------------

    @property
    def _state_file(self) -> Path:
        return self.home / "state.json"

    def _load_state(self) -> tuple[ClusterShape, ClusterPorts] | None:
        try:
            data = json.loads(self._state_file.read_text())
            if data.get("version") != STATE_VERSION:
                return None
            shape = ClusterShape(int(data["workers"]), int(data["cores"]), str(data["memory"]))
            return shape, ClusterPorts(int(data["port_base"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def _save_state(self, shape: ClusterShape) -> None:
        data = {"version": STATE_VERSION, **asdict(shape), "port_base": self.ports.base}
        tmp = self._state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(self._state_file)

    def _shape(self) -> ClusterShape:
        state = self._load_state()
        if state is None:
            raise SparkClusterError(f"no Spark cluster in {self.home}: run `up` first")
        return state[0]

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        return home_lock(self.home)

    def _adopt_recorded_ports(self) -> None:
        """The ports the running processes were given win over the environment's."""
        state = self._load_state()
        if state is not None:
            self.ports = state[1]

    # --- up / down ----------------------------------------------------------------------

    def up(self, shape: ClusterShape | None = None, timeout: float = START_TIMEOUT) -> ClusterInfo:
        """Start whatever is not running and wait until the master lists every worker as
        alive. Another shape or port base than the recorded one restarts the cluster."""
        wanted = shape or ClusterShape()
        with self._locked():
            state = self._load_state()
            if state is not None and state != (wanted, self.ports):
                self._stop_all(state[1])
            self._save_state(wanted)
            deadline = time.monotonic() + timeout
            master = self._master_process()
            if not master.is_running():
                self._start_master()
            self._wait_for_master(deadline)
            for index in range(wanted.workers):
                if not self._worker_process(index).is_running():
                    self._start_worker(index, wanted)
            for index in range(wanted.workers):
                self._wait_for_worker(index, deadline)
            return self._info(wanted)

    def down(self, purge: bool = False) -> None:
        """Stop the workers (their executors with them) and the master: SIGTERM, then
        SIGKILL after a grace period. With purge, also delete their files."""
        with self._locked():
            self._adopt_recorded_ports()
            self._stop_all(self.ports)
            if purge:
                for child in self.home.iterdir():
                    if child.name != "lock":
                        _remove(child)

    def _stop_all(self, ports: ClusterPorts) -> None:
        workers = [self._worker_process(i) for i in self._recorded_workers()]
        groups = [pid for pid in (w.running_pid() for w in workers) if pid is not None]
        stop_all([*workers, self._master_process()], STOP_TIMEOUT)
        for group in groups:
            # Executors a worker could not stop in time (they are in its group).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        for index in self._recorded_workers():
            wait_port_closed(HOST, ports.worker(index), 10.0)
        wait_port_closed(HOST, ports.master, 10.0)

    # --- failure injection --------------------------------------------------------------

    def kill_worker(self, index: int) -> bool:
        """SIGKILL worker `index` with its executors and their Python workers (its whole
        process group), and wait until its port is closed; whether it was running."""
        with self._locked():
            self._adopt_recorded_ports()
            self._check_worker(index)
            proc = self._worker_process(index)
            pid = proc.running_pid()
            if pid is None:
                return False
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)  # started as a session leader: pgid == pid
            if not proc.wait_gone(pid, 30.0):
                raise SparkClusterError(f"spark worker {index} (pid {pid}) survived SIGKILL")
            wait_port_closed(HOST, self.ports.worker(index), 10.0)
            return True

    def start_worker(self, index: int, timeout: float = START_TIMEOUT) -> None:
        """Start worker `index` (if it is not running) and wait until the master lists it
        as alive; the master then gives it executors of the applications that want more."""
        with self._locked():
            self._adopt_recorded_ports()
            shape = self._shape()
            self._check_worker(index)
            if not self._worker_process(index).is_running():
                self._start_worker(index, shape)
            self._wait_for_worker(index, time.monotonic() + timeout)

    def _check_worker(self, index: int) -> None:
        workers = self._shape().workers
        if not 0 <= index < workers:
            raise SparkClusterError(f"no worker {index}: the cluster has workers 0..{workers - 1}")

    # --- processes ----------------------------------------------------------------------

    def _environment(self) -> dict[str, str]:
        home = spark_home()
        return {
            **os.environ,
            "SPARK_HOME": str(home),
            "SPARK_CONF_DIR": str(self.home / "conf"),  # none of this user's Spark settings
            "SPARK_LOCAL_IP": HOST,
            "SPARK_DAEMON_MEMORY": DAEMON_MEMORY,
            # Executors inherit the worker's environment: their Python workers run this
            # interpreter, which has the job's packages, like the driver's.
            "PYSPARK_PYTHON": sys.executable,
        }

    def _launch(self, proc: ManagedProcess, port: int, argv: list[str], **env: str) -> None:
        if not wait_port_closed(HOST, port, 5.0):
            raise SparkClusterError(
                f"port {port} of the {proc.name} is taken by a process this cluster does not "
                f"know; free it or set {PORT_ENV}"
            )
        (self.home / "conf").mkdir(parents=True, exist_ok=True)
        proc.start(argv, cwd=Path(proc.marker).parent, env={**self._environment(), **env})

    def _start_master(self) -> None:
        proc = self._master_process()
        conf = Path(proc.marker)
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text(master_properties())
        argv = [
            str(spark_home() / "bin" / "spark-class"),
            "org.apache.spark.deploy.master.Master",
            *("--host", HOST, "--port", str(self.ports.master)),
            *("--webui-port", str(self.ports.master_ui)),
            *("--properties-file", str(conf)),
        ]
        self._launch(proc, self.ports.master, argv)

    def _start_worker(self, index: int, shape: ClusterShape) -> None:
        proc = self._worker_process(index)
        directory = self.worker_dir(index)
        for sub in ("work", "local"):
            (directory / sub).mkdir(parents=True, exist_ok=True)
        conf = Path(proc.marker)
        conf.write_text(worker_properties())
        argv = [
            str(spark_home() / "bin" / "spark-class"),
            "org.apache.spark.deploy.worker.Worker",
            *("--host", HOST, "--port", str(self.ports.worker(index))),
            *("--webui-port", str(self.ports.worker_ui(index))),
            *("--cores", str(shape.cores), "--memory", shape.memory),
            *("--work-dir", str(directory / "work")),
            *("--properties-file", str(conf)),
            self.master_url,
        ]
        self._launch(
            proc, self.ports.worker(index), argv, SPARK_LOCAL_DIRS=str(directory / "local")
        )

    # --- status -------------------------------------------------------------------------

    def master_status(self) -> dict[str, Any] | None:
        """The master's own JSON status (workers, applications), None if it does not answer."""
        try:
            with urllib.request.urlopen(f"{self.master_ui}/json/", timeout=2) as answer:
                body: dict[str, Any] = json.load(answer)
                return body
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def alive_workers(self) -> dict[int, dict[str, Any]]:
        """The master's entries of the workers alive now, by index: cores, coresused
        (1 per running executor of 1 core), memory, memoryused."""
        status = self.master_status() or {}
        by_port = {self.ports.worker(i): i for i in range(MAX_WORKERS)}
        alive: dict[int, dict[str, Any]] = {}
        for worker in status.get("workers", []):
            index = by_port.get(int(worker.get("port", -1)))
            # A restarted worker registers anew; the master keeps its dead predecessor.
            if index is not None and worker.get("state") == "ALIVE":
                alive[index] = worker
        return alive

    def status(self) -> dict[str, Any]:
        """Pids and states of every process, and the master's view. Takes no lock."""
        state = self._load_state()
        result: dict[str, Any] = {"home": str(self.home), "created": state is not None}
        if state is None:
            return result
        shape, ports = state
        recorded = SparkCluster(self.home, ports)  # the ports the processes were given
        info = recorded._info(shape)
        result.update(info.to_json())
        result["shape"] = asdict(shape)
        master_pid = self._master_process().running_pid()
        status = recorded.master_status()
        result["master_process"] = {
            "pid": master_pid,
            "running": master_pid is not None,
            "answering": status is not None,
            "log": str(self._master_process().log_file),
        }
        alive = recorded.alive_workers() if status is not None else {}
        workers: dict[str, Any] = {}
        for index in range(shape.workers):
            pid = self._worker_process(index).running_pid()
            workers[str(index)] = {
                "address": info.workers[index],
                "pid": pid,
                "running": pid is not None,
                "registered": index in alive,
                "cores_used": alive.get(index, {}).get("coresused"),
                "log": str(self._worker_process(index).log_file),
                "work_dir": str(self.work_dir(index)),
            }
        result["worker_processes"] = workers
        result["applications"] = [
            {"id": app.get("id"), "name": app.get("name"), "cores": app.get("cores")}
            for app in (status or {}).get("activeapps", [])
        ]
        return result

    def _info(self, shape: ClusterShape) -> ClusterInfo:
        return ClusterInfo(
            master_url=self.master_url,
            master_ui=self.master_ui,
            workers={i: f"{HOST}:{self.ports.worker(i)}" for i in range(shape.workers)},
        )

    def info(self) -> ClusterInfo:
        """Addresses of the cluster as last brought up (whether or not it runs now)."""
        self._adopt_recorded_ports()
        return self._info(self._shape())

    # --- waiting ------------------------------------------------------------------------

    def _wait_for_master(self, deadline: float) -> None:
        proc = self._master_process()
        while True:
            status = self.master_status()
            if status is not None and status.get("status") == "ALIVE":
                return
            if not proc.is_running():
                raise self._failure(proc, "the spark master exited during start")
            if time.monotonic() >= deadline:
                raise self._failure(proc, "timed out waiting for the spark master")
            time.sleep(0.2)

    def _wait_for_worker(self, index: int, deadline: float) -> None:
        proc = self._worker_process(index)
        while index not in self.alive_workers():
            if not proc.is_running():
                raise self._failure(proc, f"spark worker {index} exited during start")
            if time.monotonic() >= deadline:
                raise self._failure(
                    proc, f"timed out waiting for the master to list spark worker {index}"
                )
            time.sleep(0.2)

    @staticmethod
    def _failure(proc: ManagedProcess, what: str) -> SparkClusterError:
        return SparkClusterError(f"{what}; last lines of {proc.log_file}:\n{tail(proc.log_file)}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
