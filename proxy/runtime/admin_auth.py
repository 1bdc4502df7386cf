"""Bearer tokens for the admin HTTP API.

Tokens come from `admin_tokens_file` (one ``SCOPE TOKEN`` per line, ``#`` comments) and
the `admin_tokens` setting (``SCOPE:TOKEN`` items, comma separated; e.g. from the
environment as ``DEDUP_PROXY_ADMIN_TOKENS``). Two scopes:

- ``read``: every GET, and ``POST /v1/producer-names`` (a fresh producer name, which is what
  `DedupProducer` asks for besides its last sequence id);
- ``admin``: everything.

With tokens configured, every request but ``/healthz`` and ``/metrics`` (probes and
Prometheus scrapes) needs ``Authorization: Bearer <token>``: none or an unknown one is
answered 401, a read token on a write 403. Or mutual TLS (``admin_tls_client_ca_file``):
a client certificate that chains to that CA authenticates a request with the admin scope,
with or without a token (the TLS handshake verified it; a client without one may still
reach the open paths). Without either the API is open, as before; the proxy then warns at
start when the admin listener is not on a loopback address.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Middleware

OPEN_PATHS = frozenset({"/healthz", "/metrics"})
READ_POSTS = frozenset({"/v1/producer-names"})


class Scope(StrEnum):
    READ = "read"
    ADMIN = "admin"


class TokenError(ValueError):
    """The configured tokens cannot be read (the message says where and why)."""


@dataclass(frozen=True)
class AdminTokens:
    tokens: tuple[tuple[bytes, Scope], ...]

    def scope_of(self, presented: str) -> Scope | None:
        """The scope of a presented token, compared in constant time with every token."""
        given = presented.encode()
        found = None
        for token, scope in self.tokens:
            if hmac.compare_digest(given, token):
                found = scope
        return found


def load_admin_tokens(file: Path | None, inline: str | None) -> AdminTokens | None:
    """Every token of the file and the inline setting; None when there is none."""
    pairs: list[tuple[bytes, Scope]] = []
    if file is not None:
        try:
            text = file.read_text()
        except OSError as exc:
            raise TokenError(f"admin_tokens_file {file}: {exc.strerror or exc}") from None
        for number, line in enumerate(text.splitlines(), start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            scope, _, token = line.partition(" ")
            pairs.append(_pair(scope, token.strip(), f"{file}, line {number}"))
    for item in (inline or "").split(","):
        if item.strip():
            scope, _, token = item.strip().partition(":")
            pairs.append(_pair(scope, token, "admin_tokens"))
    return AdminTokens(tuple(pairs)) if pairs else None


def _pair(scope: str, token: str, where: str) -> tuple[bytes, Scope]:
    if scope not in tuple(Scope):
        raise TokenError(f"{where}: scope must be read or admin, not {scope!r}")
    if len(token) < 16 or any(c.isspace() for c in token):
        # The token itself is never shown: this message may reach a log.
        raise TokenError(f"{where}: a token needs at least 16 characters and no spaces")
    return token.encode(), Scope(scope)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def needed_scope(method: str, path: str) -> Scope | None:
    """What a request needs: None for the open paths."""
    if path in OPEN_PATHS:
        return None
    if method in ("GET", "HEAD") or (method == "POST" and path in READ_POSTS):
        return Scope.READ
    return Scope.ADMIN


def auth_middleware(tokens: AdminTokens | None, certificates: bool = False) -> Middleware:
    """Checks tokens, and with ``certificates`` takes a verified client certificate as an
    admin credential (the listener verified it against its client CA)."""

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        needed = needed_scope(request.method, request.path)
        if needed is None:
            return await handler(request)
        if certificates and _verified_certificate(request):
            return await handler(request)
        kind, _, presented = request.headers.get("Authorization", "").partition(" ")
        scope = None
        if tokens is not None and kind.lower() == "bearer":
            scope = tokens.scope_of(presented.strip())
        if scope is None:
            what = "a bearer token (Authorization: Bearer <token>)" if tokens else ""
            if certificates:
                what = f"{what} or a client certificate" if what else "a client certificate"
            raise web.HTTPUnauthorized(
                text=f"{what} is needed",
                headers={"WWW-Authenticate": 'Bearer realm="dedup-proxy"'},
            )
        if needed is Scope.ADMIN and scope is not Scope.ADMIN:
            raise web.HTTPForbidden(text="this needs an admin token; the one given is read-only")
        return await handler(request)

    return authenticate


def _verified_certificate(request: web.Request) -> bool:
    transport = request.transport
    return transport is not None and bool(transport.get_extra_info("peercert"))


def scopes_listed(tokens: Iterable[tuple[bytes, Scope]]) -> dict[str, int]:
    """How many tokens of each scope (for the start-up log line; never the tokens)."""
    counts = {scope.value: 0 for scope in Scope}
    for _, scope in tokens:
        counts[scope.value] += 1
    return counts
