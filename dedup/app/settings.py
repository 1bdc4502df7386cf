"""The application's settings: the runtime's and dedup's in one flat class.

One TOML file, one ``DEDUP_PROXY_`` environment and one set of flags configure the whole
proxy; each layer receives the same object typed as its own settings class.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any

from pydantic import Field

from dedup.settings import DedupSettings
from proxy.runtime.settings import ProxySettings
from proxy.runtime.settings import load_settings as _load


class Settings(ProxySettings, DedupSettings):
    pass_through: bool = Field(
        default=False,
        description="a plain Kafka proxy: no dedup filter, no Redis, no snapshot topic "
        "(--pass-through; unlike --no-dedup, policies cannot turn dedup on)",
    )

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


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """The settings from file, environment and flags (None: a flag not given)."""
    return _load(Settings, config_file, **overrides)
