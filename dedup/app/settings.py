"""The application's settings: the runtime's and dedup's in one flat class.

One TOML file, one ``DEDUP_PROXY_`` environment and one set of flags configure the whole
proxy; each layer receives the same object typed as its own settings class.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from dedup.settings import DedupSettings
from proxy.runtime.settings import ProxySettings
from proxy.runtime.settings import load_settings as _load


class Settings(ProxySettings, DedupSettings):
    pass_through: bool = Field(
        default=False,
        description="a plain Kafka proxy: no dedup filter, no Redis, no snapshot topic "
        "(--pass-through; unlike --no-dedup, policies cannot turn dedup on)",
    )
    workers: int = Field(
        default=1,
        ge=1,
        le=64,
        description="worker processes sharing the bootstrap port (SO_REUSEPORT), each a full "
        "instance with broker and admin ports of its own; 1: the proxy runs in-process",
    )
    worker_port_stride: int = Field(
        default=100,
        ge=1,
        description="with several workers, worker i's broker ports start at broker_port_base "
        "+ i * worker_port_stride (and its admin port at admin + i): each worker serves node "
        "ids node_id_offset .. node_id_offset + worker_port_stride - 1",
    )

    @model_validator(mode="after")
    def _check_worker_ports(self) -> Settings:
        problems = worker_port_problems(self) if self.workers > 1 else []
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def effective_instance_id(self) -> str:
        """The transactional id root of the upstream writer (see dedup.fencing)."""
        if self.instance_id:
            return self.instance_id
        host = self.advertised_host or self.listen_endpoint.host
        if host in ("0.0.0.0", "::", "", "127.0.0.1", "localhost"):
            # A wildcard or loopback listener says nothing about the machine: two hosts
            # would share the id and fence each other. The host name tells them apart.
            host = socket.gethostname()
        return re.sub(r"[^A-Za-z0-9._-]", "_", f"{host}-{self.listen_endpoint.port}")


def worker_port_problems(settings: Settings) -> list[str]:
    """Why the ports of ``settings.workers`` workers would not fit or would overlap (empty:
    they are fine). Worker i listens for broker node n on ``broker_port_base + i * stride + n
    - node_id_offset``, for n below ``node_id_offset + stride``, and serves its admin API on
    ``admin + i``; every worker shares the bootstrap port."""
    workers, stride = settings.workers, settings.worker_port_stride
    problems: list[str] = []
    if workers > 1 and settings.sni_bootstrap_host is not None:
        # Workers share one port; a client must reach the worker that owns a partition.
        problems.append(
            "workers: SNI routing puts every broker on the shared bootstrap port, where a "
            "client cannot choose its worker; run one worker per process with SNI routing"
        )
    bases = {"broker_port_base": settings.effective_broker_port_base}
    if settings.advertised_broker_port_base is not None:
        bases["advertised_broker_port_base"] = settings.advertised_broker_port_base
    for name, base in bases.items():
        top = base + workers * stride - 1
        if top > 65535:
            problems.append(
                f"worker_port_stride: {workers} workers {stride} ports apart need ports up "
                f"to {top} above {name} {base}, past 65535"
            )
    admin, listen = settings.admin_endpoint.port, settings.listen_endpoint.port
    if admin + workers - 1 > 65535:
        problems.append(f"admin: {workers} workers need admin ports {admin}..{admin + workers - 1}")
    base = settings.effective_broker_port_base
    named = {listen: "the bootstrap listener"}
    for index in range(workers):
        named.setdefault(admin + index, f"the admin port of worker {index}")
    if listen in range(admin, admin + workers):
        problems.append(
            f"admin: the admin ports {admin}..{admin + workers - 1} of {workers} workers "
            f"include the bootstrap listener's port {listen}"
        )
    for port, what in sorted(named.items()):
        if base <= port < base + workers * stride:
            index = (port - base) // stride
            problems.append(
                f"worker_port_stride: port {port} ({what}) is one of worker {index}'s broker "
                f"ports {base + index * stride}..{base + (index + 1) * stride - 1} "
                f"(broker_port_base {base}, worker_port_stride {stride})"
            )
    return problems


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """The settings from file, environment and flags (None: a flag not given)."""
    return _load(Settings, config_file, **overrides)
