"""TLS on the client listeners and the admin API; TLS and SASL toward Kafka.

One place builds every SSL context the proxy uses, from file paths in its settings, and
the same settings in librdkafka's names for the clients the dedup layer runs (replay,
snapshots, admin). A context is built once at start, so a bad certificate or key is a
configuration error then, not a failed connection later.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from proxy.kafka.sasl import Credentials
from proxy.kafka.upstream_client import LinkSecurity

UpstreamProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]


class SecurityConfigError(ValueError):
    """Certificate settings that cannot be used; the message names the setting."""


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
        _load_chain(context, self.cert_file, self.key_file, "listener")
        if self.client_ca_file is not None:
            _load_ca(context, self.client_ca_file, "client CA")
            context.verify_mode = (
                ssl.CERT_REQUIRED if self.require_client_certificate else ssl.CERT_OPTIONAL
            )
        return context


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
        if self.ca_file is not None:
            _load_ca(context, self.ca_file, "upstream CA")
        if self.cert_file is not None:
            if self.key_file is None:
                raise SecurityConfigError(
                    "upstream_tls_cert_file is set without upstream_tls_key_file"
                )
            _load_chain(context, self.cert_file, self.key_file, "upstream client")
        context.check_hostname = self.check_hostname
        return context

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
