"""How long a partition is unwritable when its owner goes: a crash (SIGKILL) and a graceful
stop (SIGTERM) of the owner, side by side, in one group of three proxy instances.

On a local environment of its own (one broker and Redis; see benchmarks/README.md) three
instances share a Redis key prefix and a snapshot topic. A producer (`DedupProducer`,
explicit identities) writes continuously through all three to a topic of ``PARTITIONS``
partitions. Then, in turn, the owner of partition 0 (the instance whose
``GET /v1/ownership`` holds it) is SIGKILLed, or SIGTERMed, and restarted half a second
after it is gone, as a supervisor would. Per event:

- **handoff**: from the signal to the first record of partition 0 acknowledged again (the
  first acknowledgement of a record sent after the signal, or after the killed process
  was reaped: records in flight at the signal come back in order before it, so this
  overstates by at most one batch). A stopping owner may still answer records that
  arrive before it stops admitting the partition, so for SIGTERM it can be near 0;
- **stall**: the longest time partition 0 went without an acknowledgement, from the last
  one before the signal to the first one ``STALL_WINDOW_S`` or more after the "handoff"
  acknowledgement: the pause writers see, whichever instance answered (a graceful stop can
  move the partition twice: away, and back when the instance rejoins);
- **recovery**: from the signal to the moment an instance holds the partition's lease and
  has finished a recovery since (``dedup_recoveries_total{result="ok"}`` grown, nothing
  left recovering), from the instances' metrics polled every ``POLL_S``: approximate (the
  recovery it sees may be of another partition of the batch), and absent for a graceful
  handoff that needed none before the first write.

A crash handoff waits for the dead owner's lease to expire (``lease_ttl_s``, default 6 s;
``--lease-ttl-s``), so the two kinds differ by about that.

    DEDUP_LOCAL_HOME=/tmp/bench-handoff DEDUP_LOCAL_KAFKA_PORT=31492 \\
        DEDUP_LOCAL_REDIS_PORT=31479 \\
        .venv/bin/python -m benchmarks.handoff --out /tmp/bench-handoff-out [--kills 10] \\
        [--lease-ttl-s 3]
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from confluent_kafka import KafkaError, Message

from dedup.client import DedupProducer
from deploy.launcher import ProxyProcess
from deploy.local import EnvInfo, LocalEnvironment
from deploy.topics import create_topic

INSTANCES: Final = 3
PARTITIONS: Final = 6
WATCHED: Final = 0  # the partition whose owner is killed
RATE: Final = 2000  # records/s over all partitions
POLL_S: Final = 0.05
STALL_WINDOW_S: Final = 3.0
# (listen, admin, broker base) per instance: below the ephemeral range, away from the tests
# (tests/support/ports.py) and from the chaos group (31100.., 31200..).
PORTS: Final = [(31300 + 40 * i, 31310 + 40 * i, 31301 + 40 * i) for i in range(INSTANCES)]
RECOVERIES_OK: Final = 'dedup_recoveries_total{result="ok"}'
RECOVERING: Final = "dedup_partitions_recovering"
KINDS: Final = ("kill", "term")


@dataclass(frozen=True)
class HandoffRow:
    kind: str  # kill (SIGKILL) or term (SIGTERM)
    round: int
    lease_ttl_s: float
    old_owner: int
    new_owner: int
    handoff_s: float
    stall_s: float
    recovery_s: float | None


class Group:
    """Three instances sharing a key prefix and a snapshot topic."""

    def __init__(self, info: EnvInfo, logs: Path, settings: dict[str, str]) -> None:
        tag = uuid.uuid4().hex[:6]
        self.info = info
        self.logs = logs
        self.shared = {
            "DEDUP_PROXY_REDIS": info.redis,
            "DEDUP_PROXY_REDIS_KEY_PREFIX": f"bench-handoff-{tag}",
            "DEDUP_PROXY_SNAPSHOT_TOPIC": f"__dedup_snapshots_handoff_{tag}",
            **settings,
        }
        self.ids = [f"handoff-{i}-{tag}" for i in range(INSTANCES)]
        self.starts = [0] * INSTANCES
        self.processes: list[ProxyProcess | None] = [None] * INSTANCES

    def start(self, i: int) -> ProxyProcess:
        listen, admin, base = PORTS[i]
        self.starts[i] += 1
        process = ProxyProcess(
            upstream=self.info.bootstrap,
            listen_port=listen,
            admin_port=admin,
            extra_args=["--broker-port-base", str(base), "--log-format", "json"],
            env={**self.shared, "DEDUP_PROXY_INSTANCE_ID": self.ids[i]},
            log_path=self.logs / f"inst{i}-{self.starts[i]}.log",
        ).start(timeout_s=120)
        self.processes[i] = process
        return process

    @property
    def bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{listen}" for listen, _, _ in PORTS)

    def holders(self, topic: str, partition: int) -> list[int]:
        name = f"{topic}/{partition}"
        return [
            i
            for i in range(INSTANCES)
            if name in (_get_json(i, "/v1/ownership") or {}).get("held", [])
        ]

    def stop_all(self) -> None:
        for process in self.processes:
            if process is not None:
                process.kill()


def _get_json(i: int, path: str) -> Any:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{PORTS[i][1]}{path}", timeout=2) as r:
            return json.load(r)
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _metric(i: int, series: str) -> float | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{PORTS[i][1]}/metrics", timeout=2) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError):
        return None
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(series) and (series.endswith("}") or line[len(series)] in " {")
    )


class Load:
    """A producer writing ``RATE`` records/s round-robin over the partitions, in a thread of
    its own, noting when each partition's records are acknowledged."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.topic = topic
        self.producer = DedupProducer(
            bootstrap, f"handoff-{uuid.uuid4().hex[:6]}", **{"message.timeout.ms": 300_000}
        )
        self.lock = threading.Lock()
        self.last_ack = [0.0] * PARTITIONS
        self.watch_from: float | None = None  # records sent from then on count
        self.first_ack: float | None = None
        self.acks: list[float] = []  # of the watched partition, from the last before watch()
        self.acked = 0
        self.failed = 0
        self.running = True
        self.thread = threading.Thread(target=self._run, name="handoff-load", daemon=True)

    def start(self) -> Load:
        self.thread.start()
        return self

    def watch(self, since: float) -> None:
        with self.lock:
            self.watch_from, self.first_ack = since, None
            self.acks = [self.last_ack[WATCHED]]

    def stall(self, until: float) -> float:
        with self.lock:
            times = [t for t in self.acks if t <= until]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)

    def _delivered(self, partition: int, sent: float, err: KafkaError | None) -> None:
        now = time.monotonic()
        with self.lock:
            if err is not None:
                self.failed += 1
                return
            self.acked += 1
            self.last_ack[partition] = now
            if partition == WATCHED and self.watch_from is not None:
                self.acks.append(now)
            if (
                partition == WATCHED
                and self.watch_from is not None
                and sent >= self.watch_from
                and self.first_ack is None
            ):
                self.first_ack = now

    def _run(self) -> None:
        sequence = 0
        started = time.monotonic()
        while self.running:
            due = int((time.monotonic() - started) * RATE)
            while sequence < due:
                partition = sequence % PARTITIONS
                sent = time.monotonic()

                def delivered(
                    err: KafkaError | None, _m: Message, p: int = partition, s: float = sent
                ) -> None:
                    self._delivered(p, s, err)

                self.producer.send(
                    self.topic,
                    str(sequence).encode(),
                    sequence_id=sequence,
                    partition=partition,
                    on_delivery=delivered,
                )
                sequence += 1
            self.producer.poll(0.005)

    def stop(self) -> int:
        self.running = False
        self.thread.join(30)
        return self.producer.flush(120)


def _wait(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout_s} s: {what}")
        time.sleep(POLL_S)


def _settle(group: Group, load: Load, topic: str) -> int:
    """Until partition 0 has one holder, the same for 2 s, and is acknowledged meanwhile."""
    stable_since, holder = time.monotonic(), -1
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        holders = group.holders(topic, WATCHED)
        now = time.monotonic()
        if len(holders) != 1 or holders[0] != holder:
            holder, stable_since = (holders[0] if len(holders) == 1 else -1), now
        elif now - stable_since > 2 and now - load.last_ack[WATCHED] < 0.5:
            return holder
        time.sleep(0.2)
    raise TimeoutError(f"{topic}/{WATCHED} has no steady owner")


def _recovered_at(
    group: Group, topic: str, old: int, done: threading.Event, found: list[float]
) -> Callable[[float], None]:
    """Takes the baselines now; the function returned starts a thread that polls the
    instances from ``since`` until one holds the partition and finished a recovery since
    (the old owner counts only as its restarted process, whose counters start at 0)."""
    old_pid = (_get_json(old, "/healthz") or {}).get("pid")
    baseline = {i: (_metric(i, RECOVERIES_OK) or 0.0) for i in range(INSTANCES) if i != old}
    baseline[old] = 0.0

    def poll(since: float) -> None:
        while not done.is_set() and time.monotonic() - since < 120:
            for i in group.holders(topic, WATCHED):
                if i == old and (_get_json(old, "/healthz") or {}).get("pid") == old_pid:
                    continue
                ok, recovering = _metric(i, RECOVERIES_OK), _metric(i, RECOVERING)
                if ok is not None and ok > baseline[i] and not recovering:
                    found.append(time.monotonic())
                    return
            time.sleep(POLL_S)

    def start(since: float) -> None:
        threading.Thread(target=poll, args=(since,), name="handoff-recovery", daemon=True).start()

    return start


def one_handoff(
    group: Group, load: Load, topic: str, kind: str, round_: int, ttl_s: float
) -> HandoffRow:
    old = _settle(group, load, topic)
    process = group.processes[old]
    assert process is not None
    done = threading.Event()
    recovery: list[float] = []
    # The baselines first: what counts starts at the signal, with nothing in between.
    poller = _recovered_at(group, topic, old, done, recovery)
    signalled = time.monotonic()
    load.watch(signalled)
    poller(signalled)
    if kind == "kill":
        process.kill()
        # Only records sent once it is gone count: one sent in the moment before could
        # still be answered by it.
        load.watch(time.monotonic())
    else:
        process.stop(timeout_s=60)  # drains, hands over, leaves
    time.sleep(0.5)
    group.start(old)  # on this thread: the process dies with the thread that started it
    _wait(lambda: load.first_ack is not None, 120, f"{topic}/{WATCHED} written again")
    assert load.first_ack is not None
    handoff = load.first_ack - signalled
    if kind == "kill":
        _wait(lambda: bool(recovery), 60, f"{topic}/{WATCHED} recovered")
    else:
        time.sleep(1)  # a graceful handoff's recovery is quick, if it is seen at all
    # The stall window closes at an acknowledgement, so a pause still open at its end is
    # measured whole.
    until = load.first_ack + STALL_WINDOW_S
    _wait(lambda: load.last_ack[WATCHED] > until, 120, f"{topic}/{WATCHED} written on")
    stall = load.stall(load.last_ack[WATCHED])
    done.set()
    holders = group.holders(topic, WATCHED)
    row = HandoffRow(
        kind,
        round_,
        ttl_s,
        old,
        holders[0] if len(holders) == 1 else -1,
        handoff,
        stall,
        recovery[0] - signalled if recovery else None,
    )
    seen = f"{row.recovery_s:6.2f} s" if row.recovery_s is not None else "     -  "
    print(
        f"{kind:4}  round {round_:2}  inst{old} -> inst{row.new_owner}  "
        f"handoff {handoff:6.2f} s  stall {stall:6.2f} s  recovery {seen}",
        flush=True,
    )
    return row


def percentiles(values: list[float]) -> dict[str, float]:
    import numpy

    return {
        "count": len(values),
        "p50": float(numpy.percentile(values, 50)),
        "p90": float(numpy.percentile(values, 90)),
        "p99": float(numpy.percentile(values, 99)),
        "max": max(values),
    }


def summarize(rows: list[HandoffRow]) -> list[dict[str, object]]:
    summary: list[dict[str, object]] = []
    for kind in KINDS:
        for measure in ("handoff_s", "stall_s", "recovery_s"):
            values = [
                v for r in rows if r.kind == kind for v in [getattr(r, measure)] if v is not None
            ]
            if values:
                summary.append(
                    {"kind": kind, "measure": measure, "lease_ttl_s": rows[0].lease_ttl_s}
                    | percentiles(values)
                )
    return summary


def write_outputs(out: Path, rows: list[HandoffRow]) -> list[dict[str, object]]:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "handoff.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    summary = summarize(rows)
    with (out / "handoff_summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(summary[0]))
        writer.writeheader()
        writer.writerows(summary)
    _plot(out / "handoff.png", rows)
    return summary


def _plot(path: Path, rows: list[HandoffRow]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(7, 4.2))
    labels, data = [], []
    for kind in KINDS:
        for measure in ("handoff_s", "stall_s", "recovery_s"):
            values = [v for r in rows if r.kind == kind for v in [getattr(r, measure)] if v]
            if values:
                labels.append(f"{kind}\n{measure[:-2]}")
                data.append(values)
    axis.boxplot(data)
    for position, values in enumerate(data, start=1):
        axis.plot([position] * len(values), values, "o", alpha=0.4)
    axis.set_xticks(range(1, len(labels) + 1), labels)
    axis.set_ylabel("seconds from the signal")
    axis.set_title(f"Owner handoff, 3 instances (lease_ttl_s {rows[0].lease_ttl_s:g})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for CSV, PNG, logs")
    parser.add_argument("--kills", type=int, default=10, help="handoffs of each kind")
    parser.add_argument("--lease-ttl-s", type=float, help="DEDUP_PROXY_LEASE_TTL_S (default 6)")
    parser.add_argument("--heartbeat-s", type=float, help="DEDUP_PROXY_HEARTBEAT_S (default 1)")
    parser.add_argument("--keep-env", action="store_true", help="leave Kafka and Redis up")
    args = parser.parse_args(argv)
    if "DEDUP_LOCAL_HOME" not in os.environ:
        print("note: DEDUP_LOCAL_HOME is not set: this uses the shared local environment")
    settings: dict[str, str] = {}
    ttl_s = 6.0
    if args.lease_ttl_s is not None:
        ttl_s = args.lease_ttl_s
        settings["DEDUP_PROXY_LEASE_TTL_S"] = str(ttl_s)
        heartbeat = args.heartbeat_s if args.heartbeat_s is not None else ttl_s / 6
        settings["DEDUP_PROXY_HEARTBEAT_S"] = str(heartbeat)
    elif args.heartbeat_s is not None:
        settings["DEDUP_PROXY_HEARTBEAT_S"] = str(args.heartbeat_s)
    args.out.mkdir(parents=True, exist_ok=True)
    environment = LocalEnvironment()
    info = environment.up(brokers=1)
    group = Group(info, args.out, settings)
    rows: list[HandoffRow] = []
    try:
        for i in range(INSTANCES):
            group.start(i)
        topic = create_topic(info.bootstrap, partitions=PARTITIONS)
        load = Load(group.bootstrap, topic).start()
        print(f"{INSTANCES} instances, {topic} ({PARTITIONS} partitions), {RATE} records/s")
        for round_ in range(1, args.kills + 1):
            for kind in KINDS:  # interleaved: a noisy moment hits both kinds
                rows.append(one_handoff(group, load, topic, kind, round_, ttl_s))
        left = load.stop()
        print(f"acknowledged {load.acked:,}, failed {load.failed}, never acknowledged {left}")
    finally:
        group.stop_all()
        if not args.keep_env:
            environment.down()
    summary = write_outputs(args.out, rows)
    for line in summary:
        print(
            f"{line['kind']:4} {line['measure']:10}  n {line['count']:3}  p50 {line['p50']:6.2f}"
            f"  p90 {line['p90']:6.2f}  p99 {line['p99']:6.2f}  max {line['max']:6.2f}  s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
