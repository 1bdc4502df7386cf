"""The proxy runtime's settings, and loading any settings class from its sources.

Sources, lowest first: defaults, a TOML file, the environment, command-line flags.
Environment variables use the prefix ``DEDUP_PROXY_`` (``DEDUP_PROXY_UPSTREAM``,
``DEDUP_PROXY_LISTEN``...). A validation error names the field that is wrong. Plugged-in
layers (dedup) define settings classes of their own with the same prefix; the application
combines them into one flat class, so one file and one environment configure everything.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from proxy.kafka.oauthbearer import TokenEndpoint, TokenFile, TokenSource
from proxy.kafka.sasl import Credentials, OAuthBearerCredentials, SaslCredentials, SaslMechanism
from proxy.kafka.topology import Endpoint, SniRouting
from proxy.runtime.admin_auth import TokenError, load_admin_tokens
from proxy.runtime.security import (
    SecurityConfigError,
    ServerTls,
    UpstreamProtocol,
    UpstreamSecurity,
)

DEFAULT_LISTEN = "127.0.0.1:29092"
DEFAULT_ADMIN = "127.0.0.1:29080"
DEFAULT_UPSTREAM = "127.0.0.1:19092"
KAFKA_DEFAULT_MAX_REQUEST_BYTES = 104_857_600  # Kafka's socket.request.max.bytes


class ConfigError(Exception):
    """Configuration that cannot be used; the message names the bad field."""


class ProxySettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="DEDUP_PROXY_",
        extra="forbid",
        validate_default=True,
    )

    upstream: Annotated[list[str], NoDecode] = Field(
        default=[DEFAULT_UPSTREAM],
        description="Kafka bootstrap servers, HOST:PORT each (comma-separated in env and flags)",
    )
    listen: str = Field(default=DEFAULT_LISTEN, description="the bootstrap listener, HOST:PORT")
    advertised_host: str | None = Field(
        default=None,
        description="host name clients are told to connect to (default: the listen host)",
    )
    broker_port_base: int | None = Field(
        default=None,
        description="port of the listener for broker node 0 (default: listen port + 1)",
    )
    node_id_offset: int = Field(default=0, description="node id that maps to broker_port_base")
    advertised_broker_port_base: int | None = Field(
        default=None,
        description="broker port base clients are told, behind port forwarding "
        "(default: broker_port_base)",
    )
    sni_bootstrap_host: str | None = Field(
        default=None,
        description="SNI routing: the host name clients bootstrap with; with "
        "sni_broker_host_pattern, every broker shares the bootstrap listener's TLS port",
    )
    sni_broker_host_pattern: str | None = Field(
        default=None,
        description="SNI routing: each broker's host name, with {node_id} in it "
        "(e.g. broker-{node_id}.kafka.example.com); the listener certificate must name them",
    )
    sni_advertised_port: int | None = Field(
        default=None,
        description="SNI routing: the port clients are told (default: the listen port)",
    )
    admin: str = Field(default=DEFAULT_ADMIN, description="admin HTTP listener, HOST:PORT")
    admin_tokens_file: Path | None = Field(
        default=None,
        description="bearer tokens of the admin API, one 'SCOPE TOKEN' per line (scope read "
        "or admin; proxy.runtime.admin_auth)",
    )
    admin_tokens: str | None = Field(
        default=None,
        description="more bearer tokens: 'SCOPE:TOKEN' items, comma separated (e.g. "
        "DEDUP_PROXY_ADMIN_TOKENS from a secret)",
        repr=False,
    )
    listener_tls_cert_file: Path | None = Field(
        default=None,
        description="PEM certificate chain: the client listeners speak TLS (with the key)",
    )
    listener_tls_key_file: Path | None = Field(default=None, description="its PEM private key")
    listener_tls_client_ca_file: Path | None = Field(
        default=None,
        description="PEM CA bundle: clients must present a certificate chaining to it (mTLS)",
    )
    upstream_security_protocol: UpstreamProtocol = Field(
        default="PLAINTEXT",
        description="how the proxy connects to Kafka: PLAINTEXT, SSL, SASL_PLAINTEXT or "
        "SASL_SSL (TLS for every connection, its own and the ones it relays; SASL with the "
        "upstream_sasl_* credentials for its own, clients authenticate themselves)",
    )
    upstream_tls_ca_file: Path | None = Field(
        default=None,
        description="PEM CA bundle that Kafka's certificates chain to (default: the system's)",
    )
    upstream_tls_cert_file: Path | None = Field(
        default=None, description="PEM client certificate, for brokers that ask for one"
    )
    upstream_tls_key_file: Path | None = Field(default=None, description="its PEM private key")
    upstream_sasl_mechanism: SaslMechanism | None = Field(
        default=None,
        description="SASL of the proxy's own connections to Kafka (upstream_security_protocol "
        "SASL_SSL or SASL_PLAINTEXT): PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER",
    )
    upstream_sasl_username: str | None = Field(default=None, description="the proxy's user")
    upstream_sasl_password: SecretStr | None = Field(
        default=None, description="its password (DEDUP_PROXY_UPSTREAM_SASL_PASSWORD)"
    )
    upstream_sasl_oauthbearer_token_file: Path | None = Field(
        default=None,
        description="OAUTHBEARER: a file holding the proxy's bearer token, read at every "
        "authentication (whatever renews the file renews the token)",
    )
    upstream_sasl_oauthbearer_token_endpoint_url: str | None = Field(
        default=None,
        description="OAUTHBEARER: an OAuth token endpoint; the proxy asks it for tokens with "
        "the client-credentials grant",
    )
    upstream_sasl_oauthbearer_client_id: str | None = Field(
        default=None, description="the proxy's client id at the token endpoint"
    )
    upstream_sasl_oauthbearer_client_secret: SecretStr | None = Field(
        default=None,
        description="its secret (DEDUP_PROXY_UPSTREAM_SASL_OAUTHBEARER_CLIENT_SECRET)",
    )
    upstream_sasl_oauthbearer_scope: str | None = Field(
        default=None, description="the scope asked for, if the endpoint needs one"
    )
    upstream_tls_check_hostname: bool = Field(
        default=True, description="check that a broker's certificate names its host"
    )
    admin_tls_cert_file: Path | None = Field(
        default=None, description="PEM certificate chain: the admin API speaks HTTPS (with the key)"
    )
    admin_tls_key_file: Path | None = Field(default=None, description="its PEM private key")
    admin_tls_client_ca_file: Path | None = Field(
        default=None,
        description="PEM CA bundle: a client certificate chaining to it authenticates an admin "
        "request (admin scope), as a bearer token does; probes stay open",
    )
    reuse_port: bool = Field(
        default=False,
        description="open the bootstrap listener with SO_REUSEPORT, so several processes share "
        "its port (set by `serve --workers` for its workers)",
    )
    max_frame_bytes: int = Field(default=KAFKA_DEFAULT_MAX_REQUEST_BYTES, gt=0)
    max_in_flight_per_connection: int = Field(
        default=64,
        gt=0,
        description="requests of one connection being handled (acks=0 ones included); the "
        "connection is not read meanwhile",
    )
    max_connections_per_listener: int = Field(
        default=10_000,
        gt=0,
        description="open client connections per listener; one more is closed at once",
    )
    upstream_connect_timeout_s: float = Field(default=10.0, gt=0)
    metadata_refresh_s: float = Field(default=30.0, gt=0)
    drain_timeout_s: float = Field(default=30.0, ge=0)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["json", "console"] = "json"
    log_stream: Literal["stderr", "stdout"] = Field(
        default="stderr", description="where log lines go (stdout in a container image)"
    )

    @field_validator("upstream", mode="before")
    @classmethod
    def _split_upstream(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("upstream")
    @classmethod
    def _check_upstream(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("at least one upstream bootstrap server is required")
        for item in value:
            Endpoint.parse(item)
        return value

    @field_validator("listen", "admin")
    @classmethod
    def _check_endpoint(cls, value: str) -> str:
        Endpoint.parse(value)
        return value

    @model_validator(mode="after")
    def _check_ports(self) -> ProxySettings:
        base = self.broker_port_base
        if base is not None and not 0 < base < 65536:
            raise ValueError(f"broker_port_base {base} is not a valid port")
        try:
            load_admin_tokens(self.admin_tokens_file, self.admin_tokens)
        except TokenError as exc:
            raise ValueError(str(exc)) from None
        try:
            self.sni_routing  # noqa: B018 (validates)
        except (ValueError, SecurityConfigError) as exc:
            raise ValueError(str(exc)) from None
        try:  # built once here, so a bad certificate is found at start
            for server in (self.listener_tls, self.admin_tls):
                if server is not None:
                    server.context()
            self.upstream_security.context()
        except SecurityConfigError as exc:
            raise ValueError(str(exc)) from None
        return self

    @property
    def listener_tls(self) -> ServerTls | None:
        return _server_tls(
            "listener",
            self.listener_tls_cert_file,
            self.listener_tls_key_file,
            self.listener_tls_client_ca_file,
        )

    @property
    def sni_routing(self) -> SniRouting | None:
        bootstrap, pattern = self.sni_bootstrap_host, self.sni_broker_host_pattern
        if bootstrap is None and pattern is None:
            if self.sni_advertised_port is not None:
                raise SecurityConfigError("sni_advertised_port is set without SNI routing")
            return None
        if bootstrap is None or pattern is None:
            raise SecurityConfigError("sni_bootstrap_host and sni_broker_host_pattern go together")
        if self.listener_tls_cert_file is None:
            raise SecurityConfigError(
                "SNI routing needs TLS on the listener (listener_tls_cert_file and _key_file)"
            )
        port = self.sni_advertised_port or self.listen_endpoint.port
        return SniRouting(bootstrap, pattern, port)

    @property
    def admin_tls(self) -> ServerTls | None:
        return _server_tls(
            "admin",
            self.admin_tls_cert_file,
            self.admin_tls_key_file,
            self.admin_tls_client_ca_file,
            require_client_certificate=False,  # /healthz and /metrics stay open to probes
        )

    @property
    def upstream_security(self) -> UpstreamSecurity:
        sasl: Credentials | None = None
        if self.upstream_sasl_mechanism == "OAUTHBEARER":
            sasl = OAuthBearerCredentials(self._bearer_tokens())
        elif self.upstream_sasl_mechanism is not None:
            if not self.upstream_sasl_username or self.upstream_sasl_password is None:
                raise SecurityConfigError(
                    "upstream_sasl_mechanism needs upstream_sasl_username and "
                    "upstream_sasl_password"
                )
            sasl = SaslCredentials(
                self.upstream_sasl_mechanism,
                self.upstream_sasl_username,
                self.upstream_sasl_password.get_secret_value(),
            )
        return UpstreamSecurity(
            self.upstream_security_protocol,
            self.upstream_tls_ca_file,
            self.upstream_tls_cert_file,
            self.upstream_tls_key_file,
            self.upstream_tls_check_hostname,
            sasl,
        )

    def _bearer_tokens(self) -> TokenSource:
        file, url = (
            self.upstream_sasl_oauthbearer_token_file,
            self.upstream_sasl_oauthbearer_token_endpoint_url,
        )
        if (file is None) == (url is None):
            raise SecurityConfigError(
                "upstream_sasl_mechanism OAUTHBEARER needs one of "
                "upstream_sasl_oauthbearer_token_file and "
                "upstream_sasl_oauthbearer_token_endpoint_url"
            )
        if file is not None:
            return TokenFile(file)
        secret = self.upstream_sasl_oauthbearer_client_secret
        if not self.upstream_sasl_oauthbearer_client_id or secret is None:
            raise SecurityConfigError(
                "upstream_sasl_oauthbearer_token_endpoint_url needs "
                "upstream_sasl_oauthbearer_client_id and upstream_sasl_oauthbearer_client_secret"
            )
        assert url is not None
        try:
            return TokenEndpoint(
                url,
                self.upstream_sasl_oauthbearer_client_id,
                secret.get_secret_value(),
                self.upstream_sasl_oauthbearer_scope,
            )
        except ValueError as exc:
            raise SecurityConfigError(
                f"upstream_sasl_oauthbearer_token_endpoint_url: {exc}"
            ) from None

    @property
    def upstream_endpoints(self) -> list[Endpoint]:
        return [Endpoint.parse(item) for item in self.upstream]

    @property
    def listen_endpoint(self) -> Endpoint:
        return Endpoint.parse(self.listen)

    @property
    def admin_endpoint(self) -> Endpoint:
        return Endpoint.parse(self.admin)

    @property
    def effective_advertised_host(self) -> str:
        if self.advertised_host:
            return self.advertised_host
        host = self.listen_endpoint.host
        return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host

    @property
    def effective_broker_port_base(self) -> int:
        if self.broker_port_base is not None:
            return self.broker_port_base
        return self.listen_endpoint.port + 1

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Flags (init) override the environment, which overrides the file (if any).
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls))


def _server_tls(
    name: str,
    cert: Path | None,
    key: Path | None,
    client_ca: Path | None,
    require_client_certificate: bool = True,
) -> ServerTls | None:
    if cert is None and key is None:
        if client_ca is not None:
            raise SecurityConfigError(f"{name}_tls_client_ca_file is set without a certificate")
        return None
    if cert is None or key is None:
        raise SecurityConfigError(f"{name}_tls_cert_file and {name}_tls_key_file go together")
    return ServerTls(cert, key, client_ca, require_client_certificate)


SettingsT = TypeVar("SettingsT", bound=BaseSettings)


def load_settings(
    settings_cls: type[SettingsT], config_file: Path | None = None, **overrides: Any
) -> SettingsT:
    """Build settings of ``settings_cls``; ``overrides`` are command-line flags (None means
    not given). Precedence: flags, then environment, then the TOML file, then defaults."""
    if config_file is not None:
        if not config_file.is_file():
            raise ConfigError(f"config file {config_file} does not exist")
        try:
            with config_file.open("rb") as handle:
                tomllib.load(handle)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {config_file} is not valid TOML: {exc}") from exc
        # A subclass that names the file: the TOML source of settings_customise_sources reads it.
        settings_cls = type(
            f"File{settings_cls.__name__}",
            (settings_cls,),
            {"model_config": SettingsConfigDict(toml_file=config_file)},
        )
    try:
        return settings_cls(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in error['loc']) or 'settings'}: {error['msg']}"
            for error in exc.errors()
        )
        raise ConfigError(f"invalid configuration: {problems}") from exc
