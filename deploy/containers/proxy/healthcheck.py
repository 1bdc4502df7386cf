"""The proxy image's HEALTHCHECK: GET /healthz on the proxy's admin listener, exit 0 on 200.

The admin address is found as the proxy finds it (flags aside): DEDUP_PROXY_ADMIN, else the
image's configuration file, else the product's default. Standard library only, so a check
costs a bare interpreter start, not the product's imports.
"""

from __future__ import annotations

import os
import sys
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

CONFIG = Path("/etc/dedup-proxy/proxy.toml")
DEFAULT_ADMIN = "127.0.0.1:29080"
WILDCARDS = {"0.0.0.0", "::", ""}


def admin_address(environ: dict[str, str], config: Path) -> str:
    if environ.get("DEDUP_PROXY_ADMIN"):
        return environ["DEDUP_PROXY_ADMIN"]
    try:
        with config.open("rb") as handle:
            return str(tomllib.load(handle).get("admin", DEFAULT_ADMIN))
    except (OSError, tomllib.TOMLDecodeError):
        return DEFAULT_ADMIN


def health_url(admin: str) -> str:
    host, _, port = admin.strip().rpartition(":")
    host = host.strip("[]")
    if host in WILDCARDS:
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/healthz"


def main() -> int:
    url = health_url(admin_address(dict(os.environ), CONFIG))
    try:
        with urllib.request.urlopen(url, timeout=3) as answer:
            return 0 if answer.status == 200 else 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"{url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
