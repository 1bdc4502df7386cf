"""Work a process runs in the background for its whole life (the metadata refresh, the
ownership beat, snapshots, the dedup layer's watches), started through `start`: such a
task never ends unseen.

One that ends with an error is logged with its traceback, counted
(`dedup_proxy_background_task_failures_total`), named by /healthz, which reports the
process unhealthy from then on, and told to whoever asked (`when_one_fails`): the
lifecycle then shuts the process down, gracefully, for its supervisor to start it again,
as a Kafka broker stops on a fatal error. A process whose lease renewals or refreshes have
stopped would otherwise go on serving as if nothing were wrong. A task that returns, or is
cancelled (at shutdown), has ended as it should.

Their loops run each pass inside `one_pass`: an error a pass did not expect (a defect, a
malformed record in Redis) is logged and counted, and the next pass runs as usual. So a
task ends with an error only when something outside its passes fails.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import structlog

from proxy.runtime import metrics

log = structlog.get_logger(__name__)

# The process's failed background tasks: name, error. One event loop per process.
_failed: dict[str, str] = {}
_listeners: list[Callable[[str], None]] = []


def start(work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
    task = asyncio.create_task(work, name=name)
    task.add_done_callback(_ended)
    return task


@contextlib.contextmanager
def one_pass(task: str) -> Iterator[None]:
    """One pass of ``task``'s loop: an error it did not expect is logged with its traceback
    and counted (`dedup_proxy_background_pass_errors_total`), and the loop goes on."""
    try:
        yield
    except Exception:
        metrics.BACKGROUND_PASS_ERRORS.labels(task).inc()
        log.exception("background pass failed; the next one runs as usual", task=task)


def when_one_fails(listener: Callable[[str], None]) -> Callable[[], None]:
    """Call ``listener`` with a task's name when one ends with an error; returns the call
    that stops listening."""
    _listeners.append(listener)
    return lambda: _listeners.remove(listener)


def failed() -> dict[str, str]:
    """The background tasks that ended with an error, by name, with that error."""
    return dict(_failed)


def _ended(task: asyncio.Task[None]) -> None:
    if task.cancelled():
        return
    error = task.exception()
    if error is None:
        return
    name = task.get_name()
    _failed[name] = f"{type(error).__name__}: {error}"
    metrics.BACKGROUND_FAILURES.labels(name).inc()
    log.critical(
        "background task ended with an error; the process is unhealthy from now on",
        task=name,
        exc_info=error,
    )
    for listener in list(_listeners):
        listener(name)
