"""A py-spy flame graph of a running process while a load runs (``kafka_tools --profile``).

py-spy (a dev dependency) samples the target's Python stacks from outside: it needs ptrace
on the process (root, or ``kernel.yama.ptrace_scope`` 0 for a child of the same user).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

SAMPLE_RATE = 100  # samples per second (py-spy's default)


class ProfilerError(RuntimeError):
    """py-spy could not be run or wrote no flame graph."""


def py_spy_executable() -> str:
    """py-spy next to this interpreter (the venv's), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file():
        return str(beside)
    found = shutil.which("py-spy")
    if found is None:
        raise ProfilerError("py-spy not found: install the dev extra (pip install -e '.[dev]')")
    return found


def record_command(pid: int, svg: Path, rate: int = SAMPLE_RATE) -> list[str]:
    return [
        py_spy_executable(),
        "record",
        "--pid",
        str(pid),
        "--format",
        "flamegraph",
        "--rate",
        str(rate),
        "--output",
        str(svg),
    ]


@contextlib.contextmanager
def flame_graph(pid: int, svg: Path, log: Path) -> Iterator[None]:
    """Sample `pid` for as long as the block runs, then write the flame graph to `svg`.
    py-spy writes its output when interrupted (SIGINT), as after Ctrl-C."""
    with log.open("ab") as output:
        process = subprocess.Popen(record_command(pid, svg), stdout=output, stderr=output)
        try:
            time.sleep(1.0)  # attach before the load starts
            if process.poll() is not None:
                raise ProfilerError(f"py-spy exited with {process.returncode}; see {log}")
            yield
        finally:
            _stop(process)
    if not svg.is_file() or svg.stat().st_size == 0:
        raise ProfilerError(f"py-spy wrote no flame graph to {svg}; see {log}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
