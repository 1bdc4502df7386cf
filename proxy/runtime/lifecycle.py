"""Run the proxy until SIGINT/SIGTERM, then shut down gracefully."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Sequence

import structlog

from proxy.runtime.admin import AdminRoutes, start_admin
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
    await stop.wait()
    await server.shutdown()
    await admin.cleanup()


def install_event_loop() -> None:
    """uvloop where it is installed: a faster event loop for the same asyncio code."""
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
