"""The admin HTTP port: /metrics (Prometheus), /healthz, and the routes plugged-in layers
mount (dedup's API under /v1)."""

from __future__ import annotations

import asyncio
import ipaddress
import os
from collections.abc import Callable, Sequence

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.runtime import background
from proxy.runtime.admin_auth import auth_middleware, load_admin_tokens, scopes_listed
from proxy.runtime.server import ProxyServer

log = structlog.get_logger(__name__)

# The upstream view is stale after this many missed refreshes: report unhealthy.
_STALE_REFRESHES = 3


AdminRoutes = Callable[[web.Application], None]


def build_admin_app(server: ProxyServer, routes: Sequence[AdminRoutes] = ()) -> web.Application:
    """The app, behind bearer-token checks when tokens are configured (`admin_auth`)."""
    settings = server.settings
    tokens = load_admin_tokens(settings.admin_tokens_file, settings.admin_tokens)
    certificates = settings.admin_tls_client_ca_file is not None
    if tokens is None and not certificates:
        if not _loopback(settings.admin_endpoint.host):
            log.warning(
                "the admin API is open to anyone who reaches it: configure admin_tokens_file, "
                "admin_tokens or admin_tls_client_ca_file, or bind it to a loopback address",
                admin=settings.admin,
            )
    else:
        log.info(
            "admin API needs credentials",
            tokens=scopes_listed(tokens.tokens) if tokens else None,
            client_certificates=certificates,
        )

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        now = asyncio.get_running_loop().time()
        last = server.last_refresh_ok
        max_age = _STALE_REFRESHES * server.settings.metadata_refresh_s
        fresh = last is not None and now - last <= max_age
        failed = background.failed()
        healthy = fresh and not failed
        body = {
            "status": "ok" if healthy else "unavailable",
            "pid": os.getpid(),
            "upstream_brokers": sorted(server.topology.node_ids),
            "broker_listeners": server.broker_ports(),
            "seconds_since_metadata": None if last is None else round(now - last, 1),
            "failed_tasks": failed,
        }
        return web.json_response(body, status=200 if healthy else 503)

    guarded = tokens is not None or certificates
    app = web.Application(middlewares=[auth_middleware(tokens, certificates)] if guarded else [])
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    for add_routes in routes:
        add_routes(app)
    return app


async def start_admin(server: ProxyServer, routes: Sequence[AdminRoutes] = ()) -> web.AppRunner:
    runner = web.AppRunner(build_admin_app(server, routes), access_log=None)
    await runner.setup()
    endpoint = server.settings.admin_endpoint
    tls = server.settings.admin_tls
    await web.TCPSite(
        runner, endpoint.host, endpoint.port, ssl_context=tls.context() if tls else None
    ).start()
    return runner


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
