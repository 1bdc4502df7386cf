"""Run the proxy until SIGINT/SIGTERM, then shut down gracefully; SIGHUP reads renewed
certificates (`proxy.runtime.security.reload_certificates`)."""

from __future__ import annotations

import asyncio
import faulthandler
import io
import signal
from collections.abc import Sequence

import structlog

from proxy.runtime.admin import AdminRoutes, start_admin
from proxy.runtime.security import reload_certificates
from proxy.runtime.server import ProxyServer

log = structlog.get_logger(__name__)


async def run_proxy(server: ProxyServer, admin_routes: Sequence[AdminRoutes] = ()) -> None:
    """Serve until SIGINT or SIGTERM, then drain: answers already owed are still sent."""
    await server.start()
    admin = await start_admin(server, admin_routes)
    log.info("admin listener open", admin=server.settings.admin)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR2, log_tasks)
    loop.add_signal_handler(signal.SIGHUP, reload_certificates)
    await stop.wait()
    await server.shutdown()
    await admin.cleanup()


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
