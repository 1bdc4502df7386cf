"""Kafka's own Java clients in tests: the settings file of a client that reaches a TLS or
SASL_SSL listener trusting the local CA, and a VerifiableProducer run read back as events
(with a fault of the test's while it runs, too)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from deploy.local import java_tool_command
from deploy.tls import LocalTls

# JAAS lines for user `client` ({password}: its password) per mechanism; OAUTHBEARER's is
# Kafka's default login handler, which makes an unsigned token naming the subject.
JAAS = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule required "
    'username="client" password="{password}";',
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule required "
    'username="client" password="{password}";',
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule required "
    'username="client" password="{password}";',
    "OAUTHBEARER": "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule "
    'required unsecuredLoginStringClaim_sub="java-client";',
}


def client_properties(
    path: Path, certs: LocalTls, mechanism: str | None = None, extra: str = ""
) -> Path:
    """Write a Java client's settings: TLS trusting the local CA, and with ``mechanism``,
    SASL as user `client`; ``extra``: more lines."""
    lines = [
        f"security.protocol={'SSL' if mechanism is None else 'SASL_SSL'}",
        f"ssl.truststore.location={certs.truststore_file}",
        "ssl.truststore.type=PKCS12",
        f"ssl.truststore.password={certs.keystore_password}",
    ]
    if mechanism is not None:
        jaas = JAAS[mechanism].replace("{password}", certs.sasl_users["client"])
        lines += [f"sasl.mechanism={mechanism}", f"sasl.jaas.config={jaas}"]
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


def verifiable_producer(
    bootstrap: str,
    topic: str,
    messages: int,
    config: Path,
    *args: str,
    hosts_file: Path | None = None,
    timeout_s: float = 240,
) -> list[dict[str, Any]]:
    """Run Kafka's VerifiableProducer (acks=all) to the end; its JSON events. ``args``: more
    of its options (``--throughput``); ``hosts_file``: names resolved from it
    (``-Djdk.net.hosts.file``). A non-zero exit raises, with the tool's stderr."""
    env = dict(os.environ)
    if hosts_file is not None:
        env["JAVA_TOOL_OPTIONS"] = f"-Djdk.net.hosts.file={hosts_file}"
    done = subprocess.run(
        _verifiable_producer_command(bootstrap, topic, messages, config, *args),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
    )
    if done.returncode != 0:
        raise AssertionError(f"VerifiableProducer exited {done.returncode}: {done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def verifiable_producer_during(
    bootstrap: str,
    topic: str,
    messages: int,
    config: Path,
    during: Callable[[Callable[[], int]], None],
    *args: str,
    timeout_s: float = 180,
) -> list[dict[str, Any]]:
    """As `verifiable_producer`, calling ``during(acked)`` while the tool runs (``acked()``:
    the sends acknowledged so far, as its output tells; a fault, for instance), then
    waiting for it to end."""
    events: list[dict[str, Any]] = []
    command = _verifiable_producer_command(bootstrap, topic, messages, config, *args)
    with (
        tempfile.TemporaryFile("w+") as stderr,
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True) as tool,
    ):
        assert tool.stdout is not None
        reader = threading.Thread(
            target=lambda: events.extend(
                json.loads(line) for line in tool.stdout or () if line.startswith("{")
            ),
            daemon=True,
        )
        reader.start()
        try:
            during(lambda: sum(e.get("name") == "producer_send_success" for e in list(events)))
            code = tool.wait(timeout=timeout_s)
        finally:
            if tool.poll() is None:  # the test failed: leave no producer behind
                tool.kill()
        reader.join(30)
        if code != 0:
            stderr.seek(0)
            raise AssertionError(f"VerifiableProducer exited {code}: {stderr.read()[-3000:]}")
    return events


def _verifiable_producer_command(
    bootstrap: str, topic: str, messages: int, config: Path, *args: str
) -> list[str]:
    return java_tool_command(
        "org.apache.kafka.tools.VerifiableProducer",
        *("--bootstrap-server", bootstrap, "--topic", topic),
        *("--max-messages", str(messages), "--acks", "-1", "--producer.config", str(config)),
        *args,
    )


def sent(events: list[dict[str, Any]]) -> tuple[int, list[Any]]:
    """How many sends succeeded, and the failures' exceptions."""
    ok = sum(1 for e in events if e.get("name") == "producer_send_success")
    failed = [e.get("exception", e) for e in events if e.get("name") == "producer_send_error"]
    return ok, failed


def misreported(events: list[dict[str, Any]], in_log: Mapping[bytes, int]) -> list[Any]:
    """The successful sends whose delivery report names another offset than their
    record's in the log (`in_log`: offset by value, values unique), as (value, offset)."""
    acked = [e for e in events if e.get("name") == "producer_send_success"]
    return [(e["value"], e["offset"]) for e in acked if e["offset"] != in_log[e["value"].encode()]]
