"""The demo's child processes: loaders that crash and are restarted, and the Spark job,
each in a process group of its own so that a kill takes the JVM with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from deploy.demo.loader import Checkpoint
from deploy.launcher import set_parent_death_signal


@dataclass
class LoaderSpec:
    producer: str
    source: Path
    topic: str
    bootstrap: str
    checkpoint: Path
    checkpoint_every: int
    rows_per_s: float
    crash_after_row: int | None  # None: this loader does not crash
    reports: Path  # its delivery reports, appended by every run (`deploy.demo.delivery`)


@dataclass
class Loader:
    """A loader under a supervisor: restarted (from its checkpoint, without the crash) as
    soon as it dies, like a pod with restartPolicy Always."""

    spec: LoaderSpec
    log_path: Path
    crashes: int = 0
    _process: subprocess.Popen[bytes] | None = None
    _crash_pending: bool = field(default=True)

    def start(self) -> None:
        crash = self.spec.crash_after_row if self._crash_pending else None
        args = [
            sys.executable,
            "-m",
            "deploy.demo.loader",
            "--source",
            str(self.spec.source),
            "--bootstrap",
            self.spec.bootstrap,
            "--topic",
            self.spec.topic,
            "--producer",
            self.spec.producer,
            "--checkpoint",
            str(self.spec.checkpoint),
            "--checkpoint-every",
            str(self.spec.checkpoint_every),
            "--rows-per-s",
            str(self.spec.rows_per_s),
            "--reports",
            str(self.spec.reports),
        ]
        if crash is not None:
            args += ["--crash-after-row", str(crash)]
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                args, stdout=log, stderr=log, preexec_fn=set_parent_death_signal
            )

    def supervise(self) -> str | None:
        """Poll once; restart after a crash. Returns an event to show, if any."""
        if self._process is None or self._process.poll() is None:
            return None
        code = self._process.returncode
        if code == -signal.SIGKILL:
            self.crashes += 1
            self._crash_pending = False
            resume = self.checkpoint().next_row
            self.start()
            return (
                f"{self.spec.producer} → {self.spec.topic} crashed; restarted from row {resume:,}"
            )
        if code != 0:
            raise RuntimeError(
                f"loader {self.spec.producer} exited with {code}; see {self.log_path}"
            )
        self._process = None
        return None

    @property
    def done(self) -> bool:
        return self._process is None and self.checkpoint().runs > 0

    def checkpoint(self) -> Checkpoint:
        return Checkpoint.load(self.spec.checkpoint)

    def kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()


@dataclass
class SparkJob:
    """``dedup-proxy spark run`` as a child process."""

    args: list[str]
    log_path: Path
    ready_file: Path
    _process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.ready_file.unlink(missing_ok=True)
        command = [sys.executable, "-m", "dedup", "spark", "run", *self.args]
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [*command, "--ready-file", str(self.ready_file)],
                stdout=log,
                stderr=log,
                start_new_session=True,  # its own group: the kill reaches the JVM too
                # The JVM exits by itself when its driver process is gone.
                preexec_fn=set_parent_death_signal,
            )

    def wait_ready(self, timeout_s: float) -> None:
        """Until the query runs (the JVM takes a few seconds to start)."""
        deadline = time.monotonic() + timeout_s
        while not self.ready_file.exists():
            if self._process is None or self._process.poll() is not None:
                raise RuntimeError(f"the Spark job exited early; see {self.log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Spark job did not start in {timeout_s:.0f} s")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL to the driver and its JVM, mid-batch or between batches."""
        if self._process is not None and self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()

    def stop(self, timeout_s: float = 120.0) -> None:
        """SIGTERM: the job stops its query and exits."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()

    def wait(self, timeout_s: float) -> int:
        assert self._process is not None
        try:
            return self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
