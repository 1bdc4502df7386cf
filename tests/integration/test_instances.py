"""Several proxy instances on one Redis in front of one cluster: one owner per partition,
clients steered to it, fenced takeovers and clean handoffs.

Each test starts its own group of instances (real processes sharing a Redis key prefix and
a snapshot topic), writes through them with real clients, kills, freezes and restarts
them, and reads the topic back from Kafka: every record exactly once, in order.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicCollection, TopicPartition
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewPartitions,
    NewTopic,
    ResourceType,
)

from dedup.client import DedupProducer
from dedup.identity import DEFAULT_PRODUCER_HEADER
from dedup.ownership.members import Member
from dedup.ownership.placement import rendezvous
from deploy.local import EnvInfo, java_tool_command
from tests.support.group import Group
from tests.support.kafka_io import assert_exactly_once_in_order, end_offset, read_all
from tests.support.load import SequencedProducer
from tests.support.ports import INSTANCES
from tests.support.proxy_api import NODE_ID_STRIDE, all_see_each_other, metric_total
from tests.support.raw import metadata_node_ids
from tests.support.restartable import RestartableProxy
from tests.support.topics import delete_and_create_again, new_topic
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration

REDIS_DB = 6  # this file's instances only
TTL_S = 3.0
FAST = {"DEDUP_PROXY_LEASE_TTL_S": str(TTL_S), "DEDUP_PROXY_HEARTBEAT_S": "0.5"}


@pytest.fixture
def group_factory(local_env: EnvInfo, tmp_path: Path) -> Iterator[Any]:
    groups: list[Group] = []

    def make(count: int, per_member: Sequence[Mapping[str, str]] = (), **settings: str) -> Group:
        settings = {**FAST, **settings}  # a test's own settings win
        group = Group(
            local_env, tmp_path, INSTANCES[:count], REDIS_DB, "instances", per_member, **settings
        )
        groups.append(group)
        return group.start()

    yield make
    for group in groups:
        group.stop()


def send_all(bootstrap: str, topic: str, name: str, sequences: range, prefix: str = "") -> None:
    producer = DedupProducer(bootstrap, name)
    for sequence in sequences:
        producer.send(topic, f"{prefix}{sequence}".encode(), sequence_id=sequence, partition=0)
    assert producer.flush(120) == 0


def numbers(bootstrap: str, topic: str, prefix: str) -> list[bytes]:
    return [
        v[len(prefix) :] for v, _ in read_all(bootstrap, topic) if v.startswith(prefix.encode())
    ]


# ----------------------------------------------------------------------------- offsets


def test_a_new_topic_written_through_dedup_starts_at_offset_zero(
    group_factory: Any, local_env: EnvInfo
) -> None:
    """No fence where nothing can need one: offsets are exactly Kafka's."""
    group = group_factory(1)
    topic = new_topic(local_env.bootstrap, partitions=1)
    send_all(group.proxy(0).bootstrap, topic, "first", range(100))
    consumer = Consumer(
        {
            "bootstrap.servers": local_env.bootstrap,
            "group.id": f"offsets-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
        }
    )
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        offsets = []
        deadline = time.monotonic() + 30
        while len(offsets) < 100 and time.monotonic() < deadline:
            message = consumer.poll(1)
            if message is not None and message.error() is None:
                offsets.append(message.offset())
    finally:
        consumer.close()
    assert offsets == list(range(100)), "the first record at offset 0, no marker between"
    assert end_offset(local_env.bootstrap, topic) == 100
    assert group.metric('dedup_lease_events_total{event="acquired_new"}') == 1


# ----------------------------------------------------------------------------- steering


def test_instances_split_the_partitions_and_clients_reach_each_owner(
    group_factory: Any, local_env: EnvInfo
) -> None:
    group = group_factory(2)
    topic = new_topic(local_env.bootstrap, partitions=8)
    producer = DedupProducer(group.proxy(0).bootstrap, "spread")  # bootstrap: inst-0 only
    for sequence in range(4000):
        producer.send(
            topic, str(sequence).encode(), key=str(sequence).encode(), sequence_id=sequence
        )
    assert producer.flush(120) == 0
    values = sorted(v for _, v in by_producer(local_env.bootstrap, topic, 8)["spread"])
    assert values == list(range(4000))
    held = [set(group.ownership(i)["held"]) for i in range(2)]
    assert held[0] and held[1], f"both instances own partitions: {held}"
    assert not held[0] & held[1]
    assert held[0] | held[1] == {f"{topic}/{p}" for p in range(8)}
    assert group.metric('dedup_recoveries_total{result="ok"}') == 8, "one recovery each"
    assert group.metric('dedup_lease_events_total{event="taken_over"}') == 0


# -------------------------------------------------------------------------- admin requests


def test_admin_requests_naming_a_broker_by_its_node_id_reach_the_broker(
    group_factory: Any, local_env: EnvInfo
) -> None:
    """With several instances, clients see node `slot * node_id_stride + broker`. An admin
    request that names a broker by such an id (its configs, a replica assignment) reaches
    Kafka under the broker's own id, and the answer names the node again. librdkafka sends
    a broker's configs request to that node, as Kafka's Java admin client does."""
    group = group_factory(2)
    (broker,) = local_env.brokers
    nodes = _group_nodes(group, broker)
    admin = AdminClient({"bootstrap.servers": group.proxy(0).bootstrap})
    for node in nodes:
        resource = ConfigResource(ResourceType.BROKER, str(node))
        configs = admin.describe_configs([resource])[resource].result(timeout=30)
        assert configs["node.id"].value == str(broker), f"node {node} describes broker {broker}"
        change = ConfigResource(
            ResourceType.BROKER,
            str(node),
            incremental_configs=[
                ConfigEntry(
                    "log.cleaner.backoff.ms", "15001", incremental_operation=AlterConfigOpType.SET
                )
            ],
        )
        admin.incremental_alter_configs([change], validate_only=True)[change].result(timeout=30)
    topic = f"assigned-{uuid.uuid4().hex[:8]}"
    created = admin.create_topics([NewTopic(topic, 1, replica_assignment=[[nodes[1]]])])
    created[topic].result(timeout=30)
    direct = AdminClient({"bootstrap.servers": local_env.bootstrap})
    described = direct.describe_topics(TopicCollection([topic]))[topic].result(timeout=30)
    assert [r.id for r in described.partitions[0].replicas] == [broker]
    partitions = admin.create_partitions([NewPartitions(topic, 2, [[nodes[1]]])])
    partitions[topic].result(timeout=30)
    described = direct.describe_topics(TopicCollection([topic]))[topic].result(timeout=30)
    assert [[r.id for r in p.replicas] for p in described.partitions] == [[broker], [broker]]


def test_kafkas_own_tools_name_brokers_by_node_id_through_a_group(
    group_factory: Any, local_env: EnvInfo, tmp_path: Path
) -> None:
    """`kafka-configs` and `kafka-reassign-partitions` (Kafka's Java tools) through an
    instance of a group, naming the broker by a node id the group gave it."""
    group = group_factory(2)
    (broker,) = local_env.brokers
    node = _group_nodes(group, broker)[-1]
    bootstrap = group.proxy(1).bootstrap
    described = _java_tool(
        "kafka.admin.ConfigCommand",
        *("--bootstrap-server", bootstrap, "--describe", "--all"),
        *("--entity-type", "brokers", "--entity-name", str(node)),
    )
    assert f"node.id={broker} " in described, described
    topic = new_topic(local_env.bootstrap)
    plan = tmp_path / "reassignment.json"
    plan.write_text(
        json.dumps(
            {"version": 1, "partitions": [{"topic": topic, "partition": 0, "replicas": [node]}]}
        )
    )
    reassign = "org.apache.kafka.tools.reassign.ReassignPartitionsCommand"
    _java_tool(
        reassign,
        "--bootstrap-server",
        bootstrap,
        "--execute",
        "--reassignment-json-file",
        str(plan),
    )
    verified = _java_tool(
        reassign, "--bootstrap-server", bootstrap, "--verify", "--reassignment-json-file", str(plan)
    )
    assert f"Reassignment of partition {topic}-0 is completed" in verified, verified


def _wait_joined(group: Group) -> None:
    wait_until(
        lambda: all_see_each_other([group.proxy(i).admin_url for i in range(2)]),
        timeout_s=30,
        what="both instances see each other",
    )


def _group_nodes(group: Group, broker: int) -> list[int]:
    """The node ids the group gives the broker, one per instance (never the broker's own),
    asked once both instances know each other (before, one instance names the brokers'
    own ids)."""
    _wait_joined(group)
    admin = AdminClient({"bootstrap.servers": group.proxy(0).bootstrap})
    nodes: list[int] = []

    def both_members_listed() -> bool:
        nodes[:] = sorted(n.id for n in admin.describe_cluster().result(timeout=30).nodes)
        return len(nodes) == 2

    wait_until(both_members_listed, timeout_s=30, what=lambda: f"two nodes listed: {nodes}")
    assert {n % NODE_ID_STRIDE for n in nodes} == {broker}, "a node per instance for the broker"
    assert broker not in nodes, "no node has the broker's own id"
    return nodes


def test_a_restarted_instance_answers_clients_only_once_it_knows_its_group(
    group_factory: Any,
) -> None:
    """An instance killed and started again as the same instance waits for its earlier
    incarnation's membership to expire (up to a lease) before it joins. Until then it
    does not know its group: it would name the brokers by their own ids, as one instance
    alone does, and a client asking it then drops every node of the group (librdkafka
    forgets the brokers a Metadata answer leaves out) to learn them again later. So it
    opens its listeners once it has joined: every Metadata answer it gives names the
    group's nodes."""
    # A lease long enough that the restarted instance is up well before its earlier
    # incarnation's entry expires (a Python start takes seconds on a busy box).
    group = group_factory(2, DEDUP_PROXY_LEASE_TTL_S="12")
    _wait_joined(group)
    port = group.members[1].ports.listen
    group.members[1].kill()
    # Asked from a thread of its own while this one starts the instance: a process started
    # from a thread is sent SIGTERM when that thread ends (the launcher's parent-death
    # signal follows the thread).
    answers: list[list[int] | None] = []
    errors: list[BaseException] = []
    started = threading.Event()

    def ask() -> None:
        while not started.is_set():
            try:
                answers.append(metadata_node_ids(port))
            except BaseException as exc:
                errors.append(exc)
                return
            time.sleep(0.02)

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    try:
        group.members[1].start()
    finally:
        started.set()
        asking.join(30)
    assert errors == [], errors
    answers.append(metadata_node_ids(port))
    named = [ids for ids in answers if ids is not None]
    assert named, "the instance answered once started"
    own_ids = [ids for ids in named if min(ids) < NODE_ID_STRIDE]
    assert own_ids == [], f"{len(own_ids)} answers named the brokers' own ids"


def _java_tool(main_class: str, *args: str) -> str:
    done = subprocess.run(
        java_tool_command(main_class, *args), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"{main_class}: {done.stdout}{done.stderr}"
    return done.stdout


# -------------------------------------------------------------------------- a topic created again


def test_no_instance_answers_a_state_read_for_the_topic_before_it_was_created_again(
    group_factory: Any, local_env: EnvInfo
) -> None:
    """A producer resumes from its last sequence id, asked of any instance: the one that
    does not own the partition answers from Redis's copy, which is the old topic's until
    the owner rebuilds it (here the owner's watch is slowed to an hour)."""
    group = group_factory(2, DEDUP_PROXY_TOPIC_ID_CHECK_S="3600")
    topic = new_topic(local_env.bootstrap)
    send_all(group.proxy(0).bootstrap, topic, "p-read", range(10))
    owner = group.holder(topic, 0)
    path = f"/v1/topics/{topic}/partitions/0/producers/p-read"

    def read(i: int) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(group.proxy(i).admin_url + path, timeout=90) as r:
                return r.status, json.load(r)["last_sequence_id"]
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    assert read(1 - owner) == (200, 9)
    delete_and_create_again(local_env.bootstrap, topic)
    status, why = read(1 - owner)
    assert status == 503 and "deleted and created again" in why, why
    assert read(owner) == (200, -1), "the owner rebuilds the partition as it reads it"
    assert read(1 - owner) == (200, -1), "and Redis's copy is the new topic's"


# ----------------------------------------------------------------------------- failover


def test_a_frozen_owner_is_fenced_and_a_failover_with_resends_stays_exactly_once(
    group_factory: Any, local_env: EnvInfo
) -> None:
    """The owner is frozen (SIGSTOP) with writes in flight, the producer moves to the other
    instance and re-sends a window of acknowledged sequences; the zombie wakes up with its
    old writes; it is killed, restarted, and a second window goes through it. Meanwhile a
    second producer writes through the other instance throughout."""
    group = group_factory(2)
    topic = new_topic(local_env.bootstrap, partitions=1)
    send_all(group.proxy(0).bootstrap, topic, "warm", range(1), prefix="w-")
    owner = group.holder(topic, 0)
    other = 1 - owner
    total = 20_000

    steady = threading.Thread(
        target=send_all,
        args=(group.proxy(other).bootstrap, topic, "steady", range(5000), "s-"),
    )
    steady.start()
    acked: list[int] = []
    first = DedupProducer(group.proxy(owner).bootstrap, "mover", **{"linger.ms": 5})

    def delivered(err: Any, message: Any) -> None:
        if err is None:
            acked.append(int(message.value()[2:]))

    for sequence in range(total):
        first.send(
            topic,
            f"m-{sequence}".encode(),
            sequence_id=sequence,
            partition=0,
            on_delivery=delivered,
        )
        if sequence % 500 == 0:
            first.poll(0)
        if sequence == total // 2:
            time.sleep(0.5)
            os.kill(group.proxy(owner).pid, signal.SIGSTOP)  # writes in flight, frozen
            break
    first.purge()  # the producer gives up on its instance, as a restarted one would
    first.poll(1)
    resend_from = max(0, max(acked, default=0) - 3000)
    time.sleep(TTL_S + 1)
    send_all(group.proxy(other).bootstrap, topic, "mover", range(resend_from, total), "m-")
    os.kill(group.proxy(owner).pid, signal.SIGCONT)  # the zombie's writes go out now
    time.sleep(2)
    group.members[owner].kill()
    group.members[owner].start()
    send_all(group.proxy(owner).bootstrap, topic, "mover", range(total // 3, total), "m-")
    steady.join(120)
    assert_exactly_once_in_order(numbers(local_env.bootstrap, topic, "m-"), total)
    assert_exactly_once_in_order(numbers(local_env.bootstrap, topic, "s-"), 5000)
    assert group.metric('dedup_lease_events_total{event="taken_over"}') >= 1


def test_a_second_live_process_with_the_same_instance_id_is_refused(
    group_factory: Any, local_env: EnvInfo, tmp_path: Path
) -> None:
    group = group_factory(1)
    twin = RestartableProxy(
        local_env, tmp_path, INSTANCES[1], REDIS_DB, "instances", **group.members[0].settings
    )
    with pytest.raises(RuntimeError, match="exited with code 2"):
        twin.start()
    assert any("in use by another live proxy process" in line for line in twin.log_lines(""))
    assert group.proxy(0).health() is not None, "the first one runs on"


# ----------------------------------------------------------------------------- restarts


def by_producer(bootstrap: str, topic: str, partitions: int) -> dict[str, list[tuple[int, int]]]:
    """Per producer name (its identity header): (partition, value) in log order."""
    found: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for partition in range(partitions):
        for value, headers in read_all(bootstrap, topic, partition):
            found[headers[DEFAULT_PRODUCER_HEADER].decode()].append((partition, int(value)))
    return found


def assert_each_once_in_order(written: list[tuple[int, int]], total: int) -> None:
    """0..total-1 once each, and in order within each partition."""
    assert sorted(v for _, v in written) == list(range(total)), "each exactly once"
    for partition in {p for p, _ in written}:
        values = [v for p, v in written if p == partition]
        assert values == sorted(values), f"partition {partition} out of order"


def test_a_rolling_restart_under_load_hands_partitions_over_cleanly(
    group_factory: Any, local_env: EnvInfo
) -> None:
    group = group_factory(3)
    topic = new_topic(local_env.bootstrap, partitions=6)
    loads = [
        SequencedProducer(
            group.proxy(i).bootstrap, topic, f"roll-{i}", 15_000, per_second=3000, keyed=True
        ).start()
        for i in range(3)
    ]
    for i in range(3):
        time.sleep(1.5)
        group.members[i].stop()  # SIGTERM: drain, hand over, leave
        group.members[i].start()
    for load in loads:
        assert load.finish(180) == 0
    written = by_producer(local_env.bootstrap, topic, 6)
    assert sorted(written) == [f"roll-{i}" for i in range(3)]
    for name in written:
        assert_each_once_in_order(written[name], 15_000)
    assert group.metric('dedup_lease_events_total{event="taken_over"}') == 0, "no fence needed"


def test_a_group_mixing_check_states_moves_partitions_both_ways_exactly_once(
    group_factory: Any, local_env: EnvInfo
) -> None:
    """`check_state` is each instance's own setting, so a rolling change from one to the
    other runs a group with both. Under load, partitions move between the instance checking
    in memory (inst-0) and the one checking in Redis (inst-1) every way there is: a fenced
    takeover from a killed instance (writes left in flight, re-sent by the clients) in both
    directions, and a clean handoff from a stopped one in both directions."""
    modes = ({"DEDUP_PROXY_CHECK_STATE": "memory"}, {"DEDUP_PROXY_CHECK_STATE": "redis"})
    group = group_factory(2, modes)
    partitions = 4
    topic = topic_split_between(local_env.bootstrap, group.ids, partitions)
    total = 45_000
    loads = [
        SequencedProducer(
            group.proxy(i).bootstrap, topic, f"mixed-{i}", total, per_second=1500, keyed=True
        ).start()
        for i in range(2)
    ]
    names = {f"{topic}/{p}" for p in range(partitions)}

    def held(i: int) -> set[str]:
        return names & set(group.ownership(i)["held"])

    def takeovers(i: int) -> float:
        return metric_total(group.proxy(i), 'dedup_lease_events_total{event="taken_over"}')

    def moves_all(source: int, kill: bool) -> None:
        """`source`'s partitions all go to the other instance; then `source` starts again."""
        other = 1 - source
        wait_until(lambda: held(source), 20, f"inst-{source} holds a partition")
        before = takeovers(other)
        if kill:
            group.members[source].kill()
            wait_until(
                lambda: takeovers(other) > before,
                30,
                lambda: f"inst-{other} takes over (it holds {sorted(held(other))})",
            )
        else:
            group.members[source].stop()  # SIGTERM: drain, hand over, leave
        wait_until(lambda: held(other) == names, 30, f"inst-{other} holds every partition")
        if not kill:
            assert takeovers(other) == before, "handed over: no fence needed"
        group.members[source].start()

    time.sleep(1.5)
    moves_all(0, kill=True)  # memory -> redis, fenced
    moves_all(1, kill=False)  # redis -> memory, handed over
    moves_all(0, kill=False)  # memory -> redis, handed over
    moves_all(1, kill=True)  # redis -> memory, fenced
    for load in loads:
        assert load.finish(180) == 0, "every record delivered"
    written = by_producer(local_env.bootstrap, topic, partitions)
    assert sorted(written) == ["mixed-0", "mixed-1"]
    for name in written:
        assert_each_once_in_order(written[name], total)


def topic_split_between(bootstrap: str, instance_ids: Sequence[str], partitions: int) -> str:
    """A new topic of which the balanced placement gives every instance a partition."""
    members = [Member(name, "", slot, "", 0, 0) for slot, name in enumerate(instance_ids)]
    for _ in range(50):
        topic = new_topic(bootstrap, partitions=partitions)
        owners = {rendezvous(f"{topic}/{p}", members) for p in range(partitions)}
        if len(owners) == len(members):
            return topic
    raise AssertionError("no topic name split the partitions between the instances")


def test_instances_killed_in_turn_under_load_lose_and_duplicate_nothing(
    group_factory: Any, local_env: EnvInfo
) -> None:
    """Set DEDUP_TEST_KILL_LOOP_RECORDS (default 30000) for a longer run."""
    records = int(os.environ.get("DEDUP_TEST_KILL_LOOP_RECORDS", "30000"))
    group = group_factory(3)
    topic = new_topic(local_env.bootstrap, partitions=6)
    per = records // 3
    loads = [
        SequencedProducer(
            group.proxy(i).bootstrap, topic, f"kill-{i}", per, per_second=1000, keyed=True
        ).start()
        for i in range(3)
    ]
    rng = random.Random(13)
    kills = 0
    while any(load.running for load in loads):
        time.sleep(2)
        victim = rng.randrange(3)
        group.members[victim].kill()
        group.members[victim].start()
        kills += 1
    for load in loads:
        assert load.finish(180) == 0
    written = by_producer(local_env.bootstrap, topic, 6)
    assert sorted(written) == [f"kill-{i}" for i in range(3)]
    for name in written:
        assert_each_once_in_order(written[name], per)
    assert kills >= 2, "the load outlived at least two kills"
