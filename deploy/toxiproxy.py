"""Network faults between Kafka clients, the proxy and the brokers, with Toxiproxy.

A Toxiproxy *link* (Toxiproxy calls it a proxy) listens on one address and forwards every
connection it accepts to an upstream address; faults are applied per link:

- ``cut``: every connection the link carries is closed, on both sides (the client's and the
  upstream's), and new ones are accepted again at once;
- ``latency``: data through the link is delayed (towards the client, the upstream, or both);
- ``clear`` / ``remove``: the faults go away, or the link does.

``Toxiproxy`` drives a server that runs somewhere through its REST API; ``ToxiproxyServer``
also runs one as a detached process with its files under a home directory::

    toxiproxy.json    the (empty) startup config; its path marks the process as ours
    toxiproxy.pid     the server's pid
    process.log       the server's log (JSON lines)

Links live in the server's memory only: a restarted server has none until they are made
again. The client is a few REST calls over urllib rather than the PyPI `toxiproxy-python`:
that one keeps the server address in class attributes (one server per interpreter), sends
requests without a timeout (a stuck Toxiproxy would hang the caller with it), lets server
errors other than 400/404/409 pass as success, and has had no release since 2019.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from deploy import paths
from deploy.config import HOST
from deploy.processes import (
    ManagedProcess,
    home_lock,
    port_open,
    stop_all,
    tail,
    wait_port_closed,
)

Direction = Literal["downstream", "upstream", "both"]
DEFAULT_API_PORT = 8474
REQUEST_TIMEOUT = 10.0
START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0
# Connections accepted and ended, links started and stopped (so every cut shows); `debug`
# adds a line per API request and `trace` (the server's default) the toxics' internals.
SERVER_LOG_LEVEL = "info"


class ToxiproxyError(RuntimeError):
    """The Toxiproxy API refused a request, failed, or did not answer in time."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Toxic:
    name: str
    type: str
    stream: str
    toxicity: float
    attributes: dict[str, Any]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Toxic:
        return cls(
            name=str(data["name"]),
            type=str(data["type"]),
            stream=str(data["stream"]),
            toxicity=float(data["toxicity"]),
            attributes=dict(data.get("attributes") or {}),
        )


@dataclass(frozen=True)
class Link:
    name: str
    listen: str
    upstream: str
    enabled: bool
    toxics: tuple[Toxic, ...] = field(default=())

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Link:
        return cls(
            name=str(data["name"]),
            listen=str(data["listen"]),
            upstream=str(data["upstream"]),
            enabled=bool(data["enabled"]),
            toxics=tuple(Toxic.from_json(t) for t in data.get("toxics") or []),
        )


class Toxiproxy:
    """The links of a running Toxiproxy server. Holds no state besides its address, so one
    instance may be used from several threads at once (say, cuts in a background thread
    while the main thread changes latency)."""

    def __init__(self, api_port: int = DEFAULT_API_PORT, host: str = HOST) -> None:
        self.host = host
        self.api_port = api_port
        self.timeout = REQUEST_TIMEOUT

    @property
    def api_url(self) -> str:
        return f"http://{self.host}:{self.api_port}"

    # --- REST ---------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One API call; the decoded JSON answer (None for an empty one)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.api_url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json", "User-Agent": "kafka-dedup-proxy"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            raise ToxiproxyError(
                f"toxiproxy {method} {path}: {exc.code} {_error_text(exc.read())}", exc.code
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            # A timeout too: the server may be stuck (see `clear`), or not running.
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            raise ToxiproxyError(
                f"toxiproxy {method} {path}: no answer from {self.api_url} ({reason})"
            ) from None
        return json.loads(raw) if raw.strip() else None

    @staticmethod
    def _path(*parts: str) -> str:
        return "".join("/" + urllib.parse.quote(part, safe="") for part in parts)

    def version(self) -> str:
        return str(self._request("GET", "/version")["version"])

    def answers(self) -> bool:
        """Whether a Toxiproxy API answers at the address (quickly, for start-up polls)."""
        if not port_open(self.host, self.api_port, timeout=0.2):
            return False
        try:
            self.version()
        except (ToxiproxyError, KeyError, TypeError, ValueError):
            return False
        return True

    def links(self) -> dict[str, Link]:
        data: dict[str, Any] = self._request("GET", "/proxies")
        return {name: Link.from_json(value) for name, value in data.items()}

    def get(self, name: str) -> Link | None:
        try:
            return Link.from_json(self._request("GET", self._path("proxies", name)))
        except ToxiproxyError as exc:
            if exc.status == 404:
                return None
            raise

    def _set_enabled(self, name: str, enabled: bool) -> None:
        self._request("PATCH", self._path("proxies", name), {"enabled": enabled})

    # --- links --------------------------------------------------------------------------

    def link(self, name: str, listen: str, upstream: str) -> Link:
        """A link from listen ("host:port") to upstream, enabled and without faults. An
        existing link of that name with other addresses is replaced; one with the same
        addresses is kept (with its connections), re-enabled and cleared."""
        existing = self.get(name)
        if existing is not None and (existing.listen, existing.upstream) == (listen, upstream):
            if not existing.enabled:
                self._set_enabled(name, True)
            self.clear(name)
        else:
            if existing is not None:
                self.remove(name)
            body = {"name": name, "listen": listen, "upstream": upstream, "enabled": True}
            self._request("POST", "/proxies", body)
        link = self.get(name)
        if link is None:
            raise ToxiproxyError(f"toxiproxy link {name} vanished right after it was made")
        return link

    def remove(self, name: str) -> bool:
        """Delete the link, closing its connections; whether it existed."""
        try:
            self._request("DELETE", self._path("proxies", name))
        except ToxiproxyError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def cut(self, name: str) -> None:
        """Close every connection the link carries, then accept new ones again. Toxiproxy
        closes both sockets of each connection when a link is disabled, so the client and
        the upstream each see their connection end; in between (a few milliseconds) new
        connections are refused."""
        self._set_enabled(name, False)
        self._set_enabled(name, True)

    def cut_for(
        self,
        names: Iterable[str],
        seconds: float,
        every_s: float,
        stop: threading.Event | None = None,
    ) -> int:
        """Cut every named link at once, then again every `every_s`, until `seconds` have
        passed (or `stop` is set); the number of rounds. Clients therefore keep losing
        the connections they have just made again for the whole period."""
        links = list(names)
        if every_s <= 0:
            raise ValueError(f"every_s must be positive, not {every_s}")
        wake = stop if stop is not None else threading.Event()
        deadline = time.monotonic() + seconds
        rounds = 0
        while not wake.is_set():
            for name in links:
                self.cut(name)
            rounds += 1
            left = deadline - time.monotonic()
            if left <= 0 or wake.wait(min(every_s, left)) or time.monotonic() >= deadline:
                break
        return rounds

    def cut_in_background(
        self, names: Iterable[str], seconds: float, every_s: float
    ) -> BackgroundCuts:
        """`cut_for` in a thread of its own, started at once."""
        return BackgroundCuts(self, list(names), seconds, every_s)

    def latency(
        self, name: str, ms: int, jitter_ms: int = 0, direction: Direction = "downstream"
    ) -> None:
        """Delay the data through the link by `ms` (± `jitter_ms`): "downstream" is what
        the upstream sends back (responses), "upstream" what the client sends, "both"
        delays each way (a request and its response then take 2 * ms longer). Applies to
        the connections the link has as well as new ones; calling it again changes the
        delay in place."""
        if ms < 0 or jitter_ms < 0:
            raise ValueError(f"latency and jitter must not be negative ({ms}, {jitter_ms})")
        streams = ("upstream", "downstream") if direction == "both" else (direction,)
        present = {toxic.name for toxic in self.toxics(name)}
        for stream in streams:
            toxic = f"latency-{stream}"
            attributes = {"latency": ms, "jitter": jitter_ms}
            if toxic in present:
                path = self._path("proxies", name, "toxics", toxic)
                self._request("PATCH", path, {"attributes": attributes})
            else:
                body = {
                    "name": toxic,
                    "type": "latency",
                    "stream": stream,
                    "toxicity": 1.0,
                    "attributes": attributes,
                }
                self._request("POST", self._path("proxies", name, "toxics"), body)

    def toxics(self, name: str) -> list[Toxic]:
        data: list[dict[str, Any]] = self._request("GET", self._path("proxies", name, "toxics"))
        return [Toxic.from_json(item) for item in data]

    def clear(self, name: str) -> None:
        """Remove every fault (toxic) of the link; its connections stay. Toxiproxy
        releases before 2.13 can hang while removing a toxic from a link whose
        connections are closing at that very moment (Shopify/toxiproxy#558, #760): such
        a hang shows up here as a ToxiproxyError after the request timeout, and only a
        restart of the server recovers from it."""
        for toxic in self.toxics(name):
            try:
                self._request("DELETE", self._path("proxies", name, "toxics", toxic.name))
            except ToxiproxyError as exc:
                if exc.status != 404:  # gone already: what was wanted
                    raise


class BackgroundCuts:
    """A `cut_for` running in a daemon thread. `wait` gives its number of rounds and
    raises what it raised; leaving the `with` block stops it early and waits."""

    def __init__(
        self, toxiproxy: Toxiproxy, names: list[str], seconds: float, every_s: float
    ) -> None:
        self._stop = threading.Event()
        self._rounds = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run,
            args=(toxiproxy, names, seconds, every_s),
            name="toxiproxy-cuts",
            daemon=True,
        )
        self._thread.start()

    def _run(self, toxiproxy: Toxiproxy, names: list[str], seconds: float, every_s: float) -> None:
        try:
            self._rounds = toxiproxy.cut_for(names, seconds, every_s, self._stop)
        except BaseException as exc:  # handed to the thread that waits
            self._error = exc

    def stop(self) -> None:
        self._stop.set()

    def wait(self, timeout: float | None = None) -> int:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the cuts did not end within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._rounds

    def __enter__(self) -> BackgroundCuts:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
        # While an error propagates, don't replace it with one from the cuts.
        if exc is None:
            self.wait()
        else:
            self._thread.join()


class ToxiproxyServer(Toxiproxy):
    """A Toxiproxy server run as a detached process (like the environment's Redis), with
    its files under home; the link methods of `Toxiproxy` drive it. `start` and `stop`
    are idempotent and serialize on a lock file in home; as a context manager it is
    started on entry and stopped on exit."""

    def __init__(self, home: Path, api_port: int = DEFAULT_API_PORT) -> None:
        super().__init__(api_port, HOST)
        self.home = home

    @property
    def config_file(self) -> Path:
        return self.home / "toxiproxy.json"

    @property
    def log_file(self) -> Path:
        return self.home / "process.log"

    def _process(self) -> ManagedProcess:
        return ManagedProcess(
            name="toxiproxy",
            pid_file=self.home / "toxiproxy.pid",
            log_file=self.log_file,
            marker=str(self.config_file),
        )

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        return home_lock(self.home)

    def is_running(self) -> bool:
        return self._process().is_running()

    def start(self, timeout: float = START_TIMEOUT) -> None:
        """Start the server unless it runs, and wait until its API answers."""
        with self._locked():
            proc = self._process()
            if not proc.is_running():
                self._launch(proc)
            self._wait_for_api(proc, time.monotonic() + timeout)

    def _launch(self, proc: ManagedProcess) -> None:
        binary = paths.toxiproxy_server()
        if not wait_port_closed(self.host, self.api_port, 5.0):
            raise ToxiproxyError(
                f"port {self.api_port} is taken by a process this Toxiproxy home "
                f"({self.home}) does not know; free it or use another API port"
            )
        # No links at start-up: whoever starts the server makes the ones it needs.
        self.config_file.write_text("[]\n")
        argv = [
            # `env` only sets the log level: the server then replaces it (same pid).
            "env",
            f"LOG_LEVEL={SERVER_LOG_LEVEL}",
            binary,
            *("-host", self.host),
            *("-port", str(self.api_port)),
            *("-config", str(self.config_file)),
        ]
        proc.start(argv, cwd=self.home)

    def _wait_for_api(self, proc: ManagedProcess, deadline: float) -> None:
        while not self.answers():
            if not proc.is_running():
                raise self._failure(proc, "toxiproxy exited during start")
            # It keeps running when its API cannot listen; this start's log lines say why.
            if "Server finished with error" in _since_start(tail(proc.log_file, 20)):
                raise self._failure(proc, "toxiproxy could not serve its API")
            if time.monotonic() >= deadline:
                raise self._failure(proc, "timed out waiting for the toxiproxy API")
            time.sleep(0.05)

    @staticmethod
    def _failure(proc: ManagedProcess, what: str) -> ToxiproxyError:
        return ToxiproxyError(f"{what}; last lines of {proc.log_file}:\n{tail(proc.log_file)}")

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop the server (SIGTERM, then SIGKILL); its links and their connections end."""
        with self._locked():
            stop_all([self._process()], timeout)

    def __enter__(self) -> ToxiproxyServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def _error_text(raw: bytes) -> str:
    """The `error` field of an error answer, else its text."""
    text = raw.decode(errors="replace").strip()
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return str(json.loads(text)["error"])
    return text


def _since_start(log: str) -> str:
    """The part of a process log written since its last start (the log is appended to)."""
    return log.rpartition("starting toxiproxy\n")[2]
