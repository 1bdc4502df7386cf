"""An OAuth token endpoint on a real socket, for the proxy's OAUTHBEARER tokens: the
client-credentials grant for one client, answered with unsigned tokens naming it (what
the local brokers' test-only validator accepts, `deploy.tls.unsigned_token`)."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs

from deploy.tls import unsigned_token


@dataclass
class Issuer:
    client_id: str
    client_secret: str
    subject: str
    lifetime_s: int = 3600
    url: str = ""
    asked: list[dict[str, list[str]]] = field(default_factory=list)  # each request's form
    refused: int = 0

    def answer(self, authorization: str | None, form: dict[str, list[str]]) -> bytes | None:
        self.asked.append(form)
        basic = f"{self.client_id}:{self.client_secret}"
        if authorization != f"Basic {base64.b64encode(basic.encode()).decode()}":
            self.refused += 1
            return None
        return json.dumps(
            {
                "access_token": unsigned_token(self.subject, self.lifetime_s),
                "token_type": "bearer",
                "expires_in": self.lifetime_s,
            }
        ).encode()


@contextmanager
def token_endpoint(issuer: Issuer) -> Iterator[Issuer]:
    """Serve ``issuer`` at ``issuer.url`` (on 127.0.0.1, a port of the kernel's choosing)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            form = parse_qs(self.rfile.read(length).decode())
            body = issuer.answer(self.headers.get("Authorization"), form)
            self.send_response(401 if body is None else 200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    issuer.url = f"http://127.0.0.1:{server.server_address[1]}/token"
    try:
        yield issuer
    finally:
        server.shutdown()
        server.server_close()
