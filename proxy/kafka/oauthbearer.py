"""SASL OAUTHBEARER (RFC 7628, KIP-255/KIP-768): where the proxy's own bearer tokens come
from, the messages of the exchange, and the principal a client's token names.

The proxy never validates a token: Kafka does. It reads a client's token only to learn
the principal Kafka will give that client (the ``sub`` claim, Kafka's default), and only
once Kafka accepted it (`proxy.filters.principal`).

Its own tokens come from a file (re-read at every authentication, so whatever renews the
file renews the proxy's token: a sidecar, a Kubernetes projected token) or from an OAuth
token endpoint with the client-credentials grant (cached until most of its life is over).
"""

from __future__ import annotations

import base64
import binascii
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

PRINCIPAL_CLAIM = "sub"
# A token that says nothing of its expiry is asked for again this soon.
UNKNOWN_LIFETIME_S = 60.0
# A token from an endpoint is renewed once this share of its life has passed.
RENEW_AT = 0.8
SEPARATOR = "\x01"  # RFC 7628's kvsep
# The client's answer to a server's error challenge (RFC 7628 3.2.3): one kvsep.
ERROR_ACKNOWLEDGEMENT = SEPARATOR.encode()


class TokenUnavailable(ConnectionError):
    """The proxy's token could not be read or fetched; the message says from where."""


@dataclass(frozen=True, slots=True)
class BearerToken:
    value: str = field(repr=False)
    expires_at: float  # seconds since the epoch
    principal: str

    @classmethod
    def parse(cls, value: str, now: float, lifetime_s: float | None = None) -> BearerToken:
        """A token and what its claims say of it (a token that is no JWT is still passed
        on: Kafka decides; its lifetime is then ``lifetime_s`` or `UNKNOWN_LIFETIME_S`)."""
        claims = token_claims(value) or {}
        expiry = claims.get("exp")
        if isinstance(expiry, int | float) and not isinstance(expiry, bool):
            expires_at = float(expiry)
        else:
            expires_at = now + (lifetime_s if lifetime_s is not None else UNKNOWN_LIFETIME_S)
        principal = claims.get(PRINCIPAL_CLAIM)
        return cls(value, expires_at, principal if isinstance(principal, str) else "")


class TokenSource(Protocol):
    def token(self) -> BearerToken:
        """The current token (blocking: call it from a thread in asyncio code)."""
        ...

    def describe(self) -> str: ...

    def librdkafka(self) -> dict[str, Any]:
        """The same source in librdkafka's settings, for the proxy's librdkafka clients."""
        ...


@dataclass(frozen=True)
class TokenFile:
    """A token in a file, read at every authentication."""

    path: Path

    def token(self) -> BearerToken:
        try:
            value = self.path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenUnavailable(f"bearer token file {self.path}: {exc}") from None
        if not value:
            raise TokenUnavailable(f"bearer token file {self.path} is empty")
        return BearerToken.parse(value, time.time())

    def describe(self) -> str:
        return f"the token in {self.path}"

    def librdkafka(self) -> dict[str, Any]:
        # librdkafka asks the callback at once, yet connects only on its next 1 s tick:
        # each such client starts a second late (a token endpoint does not have this).
        return {"oauth_cb": librdkafka_callback(self)}


@dataclass
class TokenEndpoint:
    """OAuth 2 client-credentials grant (RFC 6749 4.4) at ``url``, the client authenticated
    with HTTP Basic as librdkafka does it (id and secret as they are, not form-encoded, so
    the proxy's two kinds of client present the same credentials); the answer's
    ``access_token`` is the token."""

    url: str
    client_id: str
    client_secret: str = field(repr=False)
    scope: str | None = None
    timeout_s: float = 10.0
    _cached: BearerToken | None = field(default=None, init=False, repr=False)
    _renew_at: float = field(default=0.0, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        if urllib.parse.urlsplit(self.url).scheme not in ("http", "https"):
            raise ValueError(f"token endpoint {self.url!r} is not an http(s) URL")

    def token(self) -> BearerToken:
        with self._lock:  # one fetch at a time; the others take its token
            now = time.time()
            if self._cached is None or now >= self._renew_at:
                self._cached = self._fetch(now)
                self._renew_at = now + RENEW_AT * max(0.0, self._cached.expires_at - now)
            return self._cached

    def describe(self) -> str:
        return f"client {self.client_id!r} at {self.url}"

    def librdkafka(self) -> dict[str, Any]:
        # librdkafka's own client of the endpoint (KIP-768): it asks as `_fetch` does.
        config = {
            "sasl.oauthbearer.method": "oidc",
            "sasl.oauthbearer.token.endpoint.url": self.url,
            "sasl.oauthbearer.client.id": self.client_id,
            "sasl.oauthbearer.client.secret": self.client_secret,
        }
        if self.scope:
            config["sasl.oauthbearer.scope"] = self.scope
        return config

    def _fetch(self, now: float) -> BearerToken:
        form = {"grant_type": "client_credentials"}
        if self.scope:
            form["scope"] = self.scope
        basic = base64.b64encode(f"{self.client_id}:{self.client_secret}".encode()).decode()
        request = urllib.request.Request(
            self.url,
            data=urllib.parse.urlencode(form).encode(),
            headers={
                "Authorization": f"Basic {basic}",
                "Content-Type": "application/x-www-form-urlencoded",
                "Accept": "application/json",
            },
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                body = json.loads(answer.read(1 << 20))
        except urllib.error.HTTPError as exc:
            raise TokenUnavailable(
                f"token endpoint {self.url} refused client {self.client_id!r}: HTTP {exc.code}"
            ) from None
        except (OSError, ValueError) as exc:
            raise TokenUnavailable(f"token endpoint {self.url}: {exc}") from None
        value = body.get("access_token") if isinstance(body, dict) else None
        if not isinstance(value, str) or not value:
            raise TokenUnavailable(f"token endpoint {self.url} answered without access_token")
        lifetime = body.get("expires_in")
        return BearerToken.parse(
            value, now, float(lifetime) if isinstance(lifetime, int | float) else None
        )


def token_claims(token: str) -> dict[str, Any] | None:
    """The claims of a JWS compact token (its middle part), unverified; None if it is none."""
    parts = token.split(".")
    if len(parts) != 3:
        return None
    payload = parts[1]
    try:
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (binascii.Error, ValueError):
        return None
    return claims if isinstance(claims, dict) else None


def initial_response(token: str) -> bytes:
    """The client's one message: GS2 header without authzid, then ``auth=Bearer TOKEN``."""
    return f"n,,{SEPARATOR}auth=Bearer {token}{SEPARATOR}{SEPARATOR}".encode()


def client_token(message: bytes) -> str | None:
    """The bearer token of a client's initial response (None if the message carries none)."""
    try:
        text = message.decode("utf-8")
    except UnicodeDecodeError:
        return None
    header, _, rest = text.partition(SEPARATOR)
    if not header.startswith(("n,", "y,")):
        return None
    for pair in rest.split(SEPARATOR):
        key, _, value = pair.partition("=")
        if key == "auth":
            scheme, _, token = value.partition(" ")
            return token.strip() or None if scheme.lower() == "bearer" else None
    return None


def client_principal(message: bytes, claim: str = PRINCIPAL_CLAIM) -> str | None:
    """The name Kafka gives a client whose initial response is ``message`` (its token's
    ``claim``), or None when the message or the token says none."""
    token = client_token(message)
    claims = token_claims(token) if token is not None else None
    name = claims.get(claim) if claims is not None else None
    return name if isinstance(name, str) and name else None


def librdkafka_callback(source: TokenSource) -> Callable[[str], tuple[str, float, str]]:
    """confluent-kafka's ``oauth_cb``: the same token for the proxy's librdkafka clients."""

    def oauth_cb(_config: str) -> tuple[str, float, str]:
        token = source.token()
        return token.value, token.expires_at, token.principal or "dedup-proxy"

    return oauth_cb
