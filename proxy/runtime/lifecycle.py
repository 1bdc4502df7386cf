"""Run the proxy until SIGINT/SIGTERM, then shut down gracefully."""

from __future__ import annotations

import asyncio
import signal

import structlog

from proxy.runtime.admin import start_admin
from proxy.runtime.server import ProxyServer
from proxy.runtime.settings import ProxySettings

log = structlog.get_logger(__name__)


async def run_proxy(settings: ProxySettings) -> None:
    server = ProxyServer(settings)
    await server.start()
    admin = await start_admin(server)
    log.info("admin listener open", admin=settings.admin)
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
