"""Detached processes tracked by pid files, robust to stale files and reused pids."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

# Popen objects of the processes this interpreter started. Keeping them avoids "still
# running" ResourceWarnings and lets poll() reap a child killed while we still run.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def _reap(pid: int) -> None:
    child = _CHILDREN.get(pid)
    if child is not None:
        if child.poll() is not None:
            del _CHILDREN[pid]
        return
    # A child of ours whose Popen object is gone would linger as a zombie.
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


_PF_KTHREAD = 0x00200000  # include/linux/sched.h


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name: state, ppid, ..., flags at
    index 6 (None where /proc is absent or the pid is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name in parentheses may itself contain spaces or parentheses.
    return stat.rpartition(")")[2].split()


def _proc_state(pid: int) -> str | None:
    fields = _proc_stat(pid)
    return fields[0] if fields else None


def _live_threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def _cmdline(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace")


def pid_alive(pid: int, marker: str) -> bool:
    """Whether pid is a live (not zombie) process whose command line contains marker,
    which tells our process apart from an unrelated one that reused the pid."""
    _reap(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # another user's process: it cannot be one we started
    if not Path("/proc").is_dir():
        return True
    fields = _proc_stat(pid)
    if not fields:
        return False
    if fields[0] in ("Z", "X"):
        # The leader of a multi-threaded process (a JVM) turns zombie before its other
        # threads have exited, and its sockets close only with the last one.
        return _live_threads(pid) > 1
    cmdline = _cmdline(pid)
    if cmdline is None:
        return False
    if not cmdline:
        # An empty command line: a kernel thread, or a process that is exiting (its memory
        # is gone, its sockets not yet closed) and so still counts as running.
        return not int(fields[6]) & _PF_KTHREAD
    return marker in cmdline


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def port_bindable(host: str, port: int) -> bool:
    """Whether a listener could bind the port now. SO_REUSEADDR, as Kafka's, Redis's and
    Docker's listeners set it: the TIME_WAIT of an earlier connection does not count."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def wait_port_closed(host: str, port: int, timeout: float) -> bool:
    """Whether nothing accepts connections on the port any more, waiting up to timeout."""
    deadline = time.monotonic() + timeout
    while port_open(host, port, timeout=0.2):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def tail(path: Path, lines: int = 40) -> str:
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 64 * 1024))
            data = handle.read().decode(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(data.splitlines()[-lines:])


@dataclass(frozen=True)
class ManagedProcess:
    """One detached process: its pid file, the file its stdout/stderr go to, and a string
    its command line always contains (the path of its own config file)."""

    name: str
    pid_file: Path
    log_file: Path
    marker: str

    def recorded_pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None

    def running_pid(self) -> int | None:
        pid = self.recorded_pid()
        if pid is not None and pid_alive(pid, self.marker):
            return pid
        return None

    def is_running(self) -> bool:
        return self.running_pid() is not None

    def start(self, argv: list[str], cwd: Path, env: Mapping[str, str] | None = None) -> int:
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with self.log_file.open("ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting {self.name}\n".encode())
            log.flush()
            # A new session: Ctrl-C in the terminal, or the end of the command that
            # started it, must not reach the process.
            child = subprocess.Popen(
                argv,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
                env=None if env is None else dict(env),
            )
        _CHILDREN[child.pid] = child
        self.pid_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.pid_file.with_suffix(".tmp")
        tmp.write_text(f"{child.pid}\n")
        tmp.replace(self.pid_file)
        return child.pid

    def send(self, sig: signal.Signals) -> int | None:
        """Signal the process if it runs; the pid it had, else None."""
        pid = self.running_pid()
        if pid is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        return pid

    def wait_gone(self, pid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while pid_alive(pid, self.marker):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        return True

    def kill(self) -> bool:
        """SIGKILL and wait until it is gone; whether it was running."""
        pid = self.send(signal.SIGKILL)
        if pid is None:
            return False
        if not self.wait_gone(pid, 30.0):
            raise TimeoutError(f"{self.name} (pid {pid}) still exists 30 s after SIGKILL")
        return True

    def forget(self) -> None:
        self.pid_file.unlink(missing_ok=True)


def stop_all(processes: list[ManagedProcess], timeout: float) -> None:
    """SIGTERM them all at once (a clean shutdown), SIGKILL what is left after timeout."""
    pids = {proc: proc.send(signal.SIGTERM) for proc in processes}
    deadline = time.monotonic() + timeout
    for proc, pid in pids.items():
        if pid is None:
            continue
        if not proc.wait_gone(pid, max(0.0, deadline - time.monotonic())):
            proc.kill()
    for proc in processes:
        proc.forget()


@contextlib.contextmanager
def home_lock(home: Path) -> Iterator[None]:
    """Hold the state home's lock: one command at a time starts or stops what lives there."""
    home.mkdir(parents=True, exist_ok=True)
    with (home / "lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
