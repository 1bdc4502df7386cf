"""Secrets of the local environment: a CA of its own, a certificate for the brokers and
the proxy (valid for 127.0.0.1, localhost and any name under `SNI_DOMAIN`, for SNI
routing), one for a client (mutual TLS), and the
passwords of its SASL users (`SASL_USERS`: the proxy's own, and a client's), and unsigned
OAUTHBEARER tokens, which its brokers' test-only validator accepts (`unsigned_token`).

Generated once per environment home and kept, so a restarted environment keeps its
certificates and clients keep trusting it. Kafka reads a PKCS#12 keystore; everything
else reads PEM.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALID_DAYS = 825
SASL_USERS = ("proxy", "client")  # the proxy's own connections; a client through the proxy
SNI_DOMAIN = "dedup.localhost"  # the server certificate names *.SNI_DOMAIN too


@dataclass(frozen=True)
class LocalTls:
    """The files of one environment's certificates (all under `directory`)."""

    directory: Path

    @property
    def ca_file(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def server_cert_file(self) -> Path:
        return self.directory / "server.pem"

    @property
    def server_key_file(self) -> Path:
        return self.directory / "server.key"

    @property
    def client_cert_file(self) -> Path:
        return self.directory / "client.pem"

    @property
    def client_key_file(self) -> Path:
        return self.directory / "client.key"

    @property
    def keystore_file(self) -> Path:
        """The server's key and chain for Kafka (PKCS#12)."""
        return self.directory / "server.p12"

    @property
    def truststore_file(self) -> Path:
        """The CA for Kafka's clients in Java (PKCS#12, no key)."""
        return self.directory / "ca.p12"

    @property
    def password_file(self) -> Path:
        return self.directory / "keystore.password"

    @property
    def keystore_password(self) -> str:
        return self.password_file.read_text().strip()

    @property
    def redis_password(self) -> str:
        """The password of the environment's Redis when it is secured (`up --security
        sasl_ssl`): the environment's one secret, like the keystores'."""
        return self.keystore_password

    @property
    def sasl_users_file(self) -> Path:
        return self.directory / "sasl-users.json"

    @property
    def sasl_users(self) -> dict[str, str]:
        """User name -> password, for SASL PLAIN and SCRAM alike."""
        users: dict[str, str] = json.loads(self.sasl_users_file.read_text())
        return users

    def ensure(self) -> LocalTls:
        """Generate the certificates unless they are there already (and name what the
        current ones must: a set from an older version is made again)."""
        if (
            self.password_file.is_file()
            and self.sasl_users_file.is_file()
            and _names_sni_domain(self.server_cert_file)
        ):
            return self
        self.directory.mkdir(parents=True, exist_ok=True)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = _name("kafka-dedup-proxy local CA")
        ca_cert = (
            _builder(ca_name, ca_name, ca_key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(ca_key, hashes.SHA256())
        )
        server_key, server_cert = _leaf(
            ca_key, ca_name, "localhost", ExtendedKeyUsageOID.SERVER_AUTH
        )
        client_key, client_cert = _leaf(ca_key, ca_name, "client", ExtendedKeyUsageOID.CLIENT_AUTH)
        password = secrets.token_hex(16)
        encryption = serialization.BestAvailableEncryption(password.encode())
        _write(self.ca_file, ca_cert.public_bytes(serialization.Encoding.PEM))
        _write(self.server_cert_file, server_cert.public_bytes(serialization.Encoding.PEM))
        _write(self.server_key_file, _pem_key(server_key))
        _write(self.client_cert_file, client_cert.public_bytes(serialization.Encoding.PEM))
        _write(self.client_key_file, _pem_key(client_key))
        _write(
            self.keystore_file,
            pkcs12.serialize_key_and_certificates(
                b"server", server_key, server_cert, [ca_cert], encryption
            ),
        )
        _write(
            self.truststore_file,
            pkcs12.serialize_java_truststore(
                [pkcs12.PKCS12Certificate(ca_cert, b"ca")], encryption
            ),
        )
        users = {user: secrets.token_hex(12) for user in SASL_USERS}
        _write(self.sasl_users_file, json.dumps(users).encode())
        _write(self.password_file, f"{password}\n".encode())  # last: marks the set complete
        return self


def unsigned_token(subject: str, lifetime_s: float = 3600.0) -> str:
    """A JWT without signature (``alg: none``) naming ``subject``: what Kafka's default,
    test-only OAUTHBEARER validator accepts, and Kafka's principal is ``User:SUBJECT``."""

    def part(value: dict[str, object]) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()

    now = int(time.time())
    claims = {"sub": subject, "iat": now, "exp": now + int(lifetime_s)}
    return f"{part({'alg': 'none'})}.{part(claims)}."


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=_VALID_DAYS))
    )


def _leaf(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_name: x509.Name,
    common_name: str,
    usage: x509.ObjectIdentifier,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(_name(common_name), ca_name, key.public_key())
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.DNSName(f"*.{SNI_DOMAIN}"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                ]
            ),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def _names_sni_domain(cert_file: Path) -> bool:
    try:
        cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, x509.ExtensionNotFound):
        return False
    return f"*.{SNI_DOMAIN}" in names.get_values_for_type(x509.DNSName)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    tmp.chmod(0o600)
    tmp.replace(path)
