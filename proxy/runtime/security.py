"""TLS on the client listeners and the admin API; TLS and SASL toward Kafka.

One place builds every SSL context the proxy uses, from file paths in its settings, and
the same settings in librdkafka's names for the clients the dedup layer runs (replay,
snapshots, admin). A context is built once at start, so a bad certificate or key is a
configuration error then, not a failed connection later.

Renewed certificates are taken without a restart: `reload_certificates` (on SIGHUP) reads
every context's files again, and new connections get them (open ones keep theirs). A file
that cannot be read then leaves its context as it was, and says so. librdkafka's clients
and Redis's connections read their files whenever they connect, so they need nothing.
"""

from __future__ import annotations

import ssl
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import structlog

from proxy.kafka.sasl import Credentials
from proxy.kafka.upstream_client import LinkSecurity

UpstreamProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]


log = structlog.get_logger(__name__)


class SecurityConfigError(ValueError):
    """Certificate settings that cannot be used; the message names the setting."""


# Every context built here, with how to read its files again (weak: a context no longer
# used by anything drops out).
_RELOADERS: weakref.WeakKeyDictionary[ssl.SSLContext, tuple[str, Callable[[ssl.SSLContext], None]]]
_RELOADERS = weakref.WeakKeyDictionary()


def reload_certificates() -> int:
    """Read every live context's certificate, key and CA files again; how many were
    reloaded (a failed one keeps what it had, logged)."""
    reloaded = 0
    for context, (what, load) in list(_RELOADERS.items()):
        try:
            load(context)
        except SecurityConfigError as exc:
            log.error("certificates not reloaded; the old ones stay", context=what, error=str(exc))
            continue
        reloaded += 1
    log.info("certificates reloaded", contexts=reloaded, of=len(_RELOADERS))
    return reloaded


@dataclass(frozen=True, slots=True)
class ServerTls:
    """A listener that terminates TLS: its certificate chain and key, and optionally the
    CA that client certificates must chain to (then a client without one is refused, or,
    with ``require_client_certificate`` off, let in for the application to decide)."""

    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None
    require_client_certificate: bool = True

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._load(context)
        if self.client_ca_file is not None:
            context.verify_mode = (
                ssl.CERT_REQUIRED if self.require_client_certificate else ssl.CERT_OPTIONAL
            )
        _RELOADERS[context] = (f"server {self.cert_file}", self._load)
        return context

    def _load(self, context: ssl.SSLContext) -> None:
        _load_chain(context, self.cert_file, self.key_file, "listener")
        if self.client_ca_file is not None:  # a renewed CA is added; the old one stays
            _load_ca(context, self.client_ca_file, "client CA")


@dataclass(frozen=True, slots=True)
class UpstreamSecurity:
    """How the proxy connects to Kafka. TLS applies to every connection it opens (its own
    and the ones it relays for clients, whatever the client used to reach the proxy); SASL
    credentials to its own only (a client authenticates itself, through the proxy)."""

    protocol: UpstreamProtocol = "PLAINTEXT"
    ca_file: Path | None = None  # None: the system's CAs
    cert_file: Path | None = None  # a client certificate, for brokers that ask for one
    key_file: Path | None = None
    check_hostname: bool = True
    sasl: Credentials | None = None

    def __post_init__(self) -> None:
        if self.protocol.startswith("SASL_") and self.sasl is None:
            raise SecurityConfigError(
                f"upstream_security_protocol {self.protocol} needs upstream_sasl_mechanism, "
                "upstream_sasl_username and upstream_sasl_password"
            )
        if not self.protocol.startswith("SASL_") and self.sasl is not None:
            raise SecurityConfigError(
                f"upstream_sasl_* settings need upstream_security_protocol SASL_SSL or "
                f"SASL_PLAINTEXT, not {self.protocol}"
            )

    @property
    def uses_tls(self) -> bool:
        return self.protocol in ("SSL", "SASL_SSL")

    def link(self) -> LinkSecurity:
        """For the proxy's own connections (TLS context built here, once)."""
        return LinkSecurity(self.context(), self.sasl)

    def context(self) -> ssl.SSLContext | None:
        """For asyncio connections; None for plaintext."""
        if not self.uses_tls:
            return None
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.cert_file is not None and self.key_file is None:
            raise SecurityConfigError("upstream_tls_cert_file is set without upstream_tls_key_file")
        self._load(context)
        context.check_hostname = self.check_hostname
        _RELOADERS[context] = ("upstream", self._load)
        return context

    def _load(self, context: ssl.SSLContext) -> None:
        if self.ca_file is not None:  # a renewed CA is added; the old one stays
            _load_ca(context, self.ca_file, "upstream CA")
        if self.cert_file is not None and self.key_file is not None:
            _load_chain(context, self.cert_file, self.key_file, "upstream client")

    def librdkafka(self) -> dict[str, Any]:
        """The same, as librdkafka client settings (with OAUTHBEARER, an ``oauth_cb``)."""
        config = {} if self.sasl is None else self.sasl.librdkafka()
        if self.protocol != "PLAINTEXT":
            config["security.protocol"] = self.protocol.lower()
        if not self.uses_tls:
            return config
        config["ssl.endpoint.identification.algorithm"] = "https" if self.check_hostname else "none"
        if self.ca_file is not None:
            config["ssl.ca.location"] = str(self.ca_file)
        if self.cert_file is not None and self.key_file is not None:
            config["ssl.certificate.location"] = str(self.cert_file)
            config["ssl.key.location"] = str(self.key_file)
        return config


def _load_chain(context: ssl.SSLContext, cert: Path, key: Path, what: str) -> None:
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise SecurityConfigError(f"{what} certificate {cert} with key {key}: {exc}") from None


def _load_ca(context: ssl.SSLContext, ca: Path, what: str) -> None:
    try:
        context.load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise SecurityConfigError(f"{what} file {ca}: {exc}") from None
