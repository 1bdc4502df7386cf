"""TLS settings: contexts built at load time (a bad certificate is a configuration error
naming the setting), the librdkafka equivalents, and certificates of `deploy.tls`."""

from __future__ import annotations

import ssl

import pytest

from dedup.app.settings import load_settings as load_app_settings
from deploy.tls import LocalTls
from proxy.runtime.security import UpstreamSecurity
from proxy.runtime.settings import ConfigError, ProxySettings, load_settings

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> LocalTls:
    return LocalTls(tmp_path_factory.mktemp("certs")).ensure()


def test_certificates_are_made_once_and_kept(certs: LocalTls) -> None:
    before = certs.server_cert_file.read_bytes()
    assert LocalTls(certs.directory).ensure().server_cert_file.read_bytes() == before
    for path in (certs.server_key_file, certs.client_key_file, certs.password_file):
        assert path.stat().st_mode & 0o077 == 0, f"{path} is readable by others"


def test_listener_admin_and_upstream_contexts(certs: LocalTls) -> None:
    settings = load_settings(
        ProxySettings,
        listener_tls_cert_file=certs.server_cert_file,
        listener_tls_key_file=certs.server_key_file,
        listener_tls_client_ca_file=certs.ca_file,
        admin_tls_cert_file=certs.server_cert_file,
        admin_tls_key_file=certs.server_key_file,
        upstream_security_protocol="SSL",
        upstream_tls_ca_file=certs.ca_file,
    )
    assert settings.listener_tls is not None
    listener = settings.listener_tls.context()
    assert listener.verify_mode == ssl.CERT_REQUIRED  # a client CA: mutual TLS
    assert settings.admin_tls is not None
    assert settings.admin_tls.context().verify_mode == ssl.CERT_NONE
    upstream = settings.upstream_security.context()
    assert upstream is not None and upstream.check_hostname
    assert upstream.minimum_version >= ssl.TLSVersion.TLSv1_2


def test_plaintext_is_the_default_and_has_no_context() -> None:
    settings = load_settings(ProxySettings)
    assert settings.listener_tls is None and settings.admin_tls is None
    assert settings.upstream_security.context() is None
    assert settings.upstream_security.librdkafka() == {}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"listener_tls_cert_file": "CERT"}, "listener_tls_cert_file and listener_tls_key_file"),
        ({"admin_tls_key_file": "KEY"}, "admin_tls_cert_file and admin_tls_key_file"),
        ({"listener_tls_client_ca_file": "CA"}, "client_ca_file is set without a certificate"),
        (
            {"listener_tls_cert_file": "CERT", "listener_tls_key_file": "OTHER_KEY"},
            "listener certificate",
        ),
        (
            {"listener_tls_cert_file": "/nonexistent.pem", "listener_tls_key_file": "KEY"},
            "nonexistent",
        ),
        (
            {"upstream_security_protocol": "SSL", "upstream_tls_ca_file": "/nonexistent.pem"},
            "upstream CA file /nonexistent.pem",
        ),
        (
            {"upstream_security_protocol": "SSL", "upstream_tls_cert_file": "CERT"},
            "without upstream_tls_key_file",
        ),
    ],
)
def test_unusable_tls_settings_are_refused_at_load(
    certs: LocalTls, fields: dict[str, str], message: str
) -> None:
    named = {
        "CERT": certs.server_cert_file,
        "KEY": certs.server_key_file,
        "OTHER_KEY": certs.client_key_file,  # a key that does not match the certificate
        "CA": certs.ca_file,
    }
    given = {name: named.get(value, value) for name, value in fields.items()}
    with pytest.raises(ConfigError, match=message):
        load_settings(ProxySettings, **given)


def test_librdkafka_settings_say_the_same(certs: LocalTls) -> None:
    security = UpstreamSecurity(
        "SSL", certs.ca_file, certs.client_cert_file, certs.client_key_file, False
    )
    assert security.librdkafka() == {
        "security.protocol": "ssl",
        "ssl.endpoint.identification.algorithm": "none",
        "ssl.ca.location": str(certs.ca_file),
        "ssl.certificate.location": str(certs.client_cert_file),
        "ssl.key.location": str(certs.client_key_file),
    }
    context = security.context()
    assert context is not None and not context.check_hostname


def test_a_tls_handshake_with_the_generated_certificates(certs: LocalTls) -> None:
    """The server context accepts the client certificate and the client context the
    server's, for 127.0.0.1, in memory."""
    server = load_settings(
        ProxySettings,
        listener_tls_cert_file=certs.server_cert_file,
        listener_tls_key_file=certs.server_key_file,
        listener_tls_client_ca_file=certs.ca_file,
    ).listener_tls
    assert server is not None
    client = UpstreamSecurity(
        "SSL", certs.ca_file, certs.client_cert_file, certs.client_key_file
    ).context()
    assert client is not None
    # Each side reads from one memory buffer and writes to another; bytes are passed over.
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    server_side = server.context().wrap_bio(to_server, to_client, server_side=True)
    client_side = client.wrap_bio(to_client, to_server, server_hostname="127.0.0.1")
    done = {"client": False, "server": False}
    for _ in range(10):
        for name, side in (("client", client_side), ("server", server_side)):
            if not done[name]:
                try:
                    side.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
        if all(done.values()):
            break
    assert all(done.values()), f"the handshake did not complete: {done}"
    assert server_side.getpeercert()  # the client's certificate was checked
    assert client_side.getpeercert()["subjectAltName"]  # and the server's


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"upstream_security_protocol": "SASL_SSL"}, "needs upstream_sasl_mechanism"),
        (
            {"upstream_sasl_mechanism": "PLAIN", "upstream_sasl_username": "u"},
            "needs upstream_sasl_username and upstream_sasl_password",
        ),
        (
            {
                "upstream_sasl_mechanism": "PLAIN",
                "upstream_sasl_username": "u",
                "upstream_sasl_password": "p",
            },
            "need upstream_security_protocol SASL_SSL or SASL_PLAINTEXT, not PLAINTEXT",
        ),
        ({"upstream_sasl_mechanism": "GSSAPI"}, "upstream_sasl_mechanism"),
    ],
)
def test_unusable_sasl_settings_are_refused_at_load(fields: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(ProxySettings, **fields)


def test_sasl_settings_reach_librdkafka_and_hide_the_password() -> None:
    settings = load_settings(
        ProxySettings,
        upstream_security_protocol="SASL_PLAINTEXT",
        upstream_sasl_mechanism="SCRAM-SHA-256",
        upstream_sasl_username="proxy",
        upstream_sasl_password="pw-123",
    )
    assert settings.upstream_security.librdkafka() == {
        "security.protocol": "sasl_plaintext",
        "sasl.mechanism": "SCRAM-SHA-256",
        "sasl.username": "proxy",
        "sasl.password": "pw-123",
    }
    assert settings.upstream_security.link().tls is None
    assert "pw-123" not in repr(settings) and "pw-123" not in str(settings.model_dump())


def test_redis_tls_files_need_a_tls_url(certs: LocalTls) -> None:
    files = {"redis_tls_ca_file": certs.ca_file}
    for url in ("rediss://h:6379/0", "rediss+sentinel://h:26379/m", "rediss+cluster://h:7000"):
        assert load_app_settings(None, redis=url, **files).redis_tls == {
            "ssl_ca_certs": str(certs.ca_file)
        }
    for url in ("redis://h:6379/0", "redis+sentinel://h:26379/m", "rediss+other://h"):
        with pytest.raises(ConfigError, match="need a TLS Redis URL"):
            load_app_settings(None, redis=url, **files)
