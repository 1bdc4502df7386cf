"""Run the proxy until SIGINT/SIGTERM, then shut down gracefully; SIGHUP reads renewed
certificates (`proxy.runtime.security.reload_certificates`)."""

from __future__ import annotations

import asyncio
import faulthandler
import io
import signal
from collections.abc import Sequence

import structlog

from proxy.runtime import background
from proxy.runtime.admin import AdminRoutes, start_admin
from proxy.runtime.security import reload_certificates
from proxy.runtime.server import ProxyServer

log = structlog.get_logger(__name__)


class BackgroundFailure(RuntimeError):
    """A background task of the process ended with an error (`background`): it was shut
    down, gracefully, and exits non-zero for its supervisor to start it again."""


async def run_proxy(server: ProxyServer, admin_routes: Sequence[AdminRoutes] = ()) -> None:
    """Serve until SIGINT or SIGTERM, then drain: answers already owed are still sent. A
    background task that fails shuts the proxy down the same way, then raises
    `BackgroundFailure`."""
    stop = asyncio.Event()
    failures: list[str] = []

    def failed(task: str) -> None:
        failures.append(task)
        stop.set()

    loop = asyncio.get_running_loop()
    handlers = {
        signal.SIGINT: stop.set,
        signal.SIGTERM: stop.set,
        signal.SIGUSR2: log_tasks,
        signal.SIGHUP: reload_certificates,
    }
    stop_listening = background.when_one_fails(failed)
    try:
        await server.start()
        admin = await start_admin(server, admin_routes)
        log.info("admin listener open", admin=server.settings.admin)
        for sig, handler in handlers.items():
            loop.add_signal_handler(sig, handler)
        await stop.wait()
        if failures:
            log.critical("shutting down: a background task failed", tasks=failures)
        await server.shutdown()
        await admin.cleanup()
    finally:
        stop_listening()
        for sig in handlers:
            loop.remove_signal_handler(sig)
    if failures:
        raise BackgroundFailure(f"background task {failures[0]} ended with an error")


def install_stack_dumps() -> None:
    """SIGUSR1 prints every thread's stack to stderr, even while the event loop is stuck
    (like jstack); SIGUSR2 (`run_proxy`) logs every asyncio task and where it waits."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def log_tasks() -> None:
    for task in asyncio.all_tasks():
        stack = io.StringIO()
        task.print_stack(limit=8, file=stack)
        log.warning("task", name=task.get_name(), stack=stack.getvalue())


def install_event_loop() -> None:
    """uvloop where it is installed: a faster event loop for the same asyncio code."""
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
