"""A dedup proxy process of a test's own: its ports, its own Redis key prefix, settings as
``DEDUP_PROXY_*`` variables."""

from __future__ import annotations

from pathlib import Path

from deploy.launcher import ProxyProcess
from deploy.local import EnvInfo
from tests.support.ports import ProxyPorts


def own_proxy(
    env: EnvInfo,
    ports: ProxyPorts,
    key_prefix: str,
    log_path: Path,
    *,
    upstream: str | None = None,
    admin_ca_file: Path | None = None,
    admin_client_cert: tuple[Path, Path] | None = None,
    **settings: str,
) -> ProxyProcess:
    """Not started: call ``.start()`` (and ``.stop()``). ``upstream``: other bootstrap
    servers than the environment's plaintext ones (its TLS or SASL_SSL listeners);
    ``admin_ca_file``: the admin API speaks HTTPS (``admin_client_cert``: with this client
    certificate and key)."""
    return ProxyProcess(
        upstream=upstream or env.bootstrap,
        listen_port=ports.listen,
        admin_port=ports.admin,
        extra_args=["--broker-port-base", str(ports.broker_base)],
        env={
            "DEDUP_PROXY_REDIS": env.redis,
            "DEDUP_PROXY_REDIS_KEY_PREFIX": key_prefix,
            **settings,
        },
        log_path=log_path,
        admin_ca_file=admin_ca_file,
        admin_client_cert=admin_client_cert,
    )


def rss_bytes(pid: int) -> int:
    """The resident memory of a (proxy) process, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")
