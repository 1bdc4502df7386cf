"""Whether Kafka lets a client write topics (`dedup.write_permissions`): asked as the client,
remembered for a while per connection, answered from the topics' authorized operations, on
stand-in answers as kio decodes them (against a Kafka that enforces ACLs:
tests/integration/test_secured_env.py)."""

from __future__ import annotations

from typing import Any

import pytest
from kio.schema.errors import ErrorCode

from dedup.write_permissions import (
    MAX_REMEMBERED,
    NOT_TOLD,
    REMEMBERED_S,
    PermissionUnknown,
    unwritable,
)
from proxy.kafka.topology import Topology
from proxy.runtime.chain import ClientIdentity, FilterContext
from tests.support.permissions import DESCRIBE, READ, WRITE, KafkaAnswering

pytestmark = pytest.mark.unit


def context_asking(kafka: Any) -> FilterContext:
    topology = Topology([], "127.0.0.1", 29092)
    return FilterContext(topology, identity=ClientIdentity(), ask_as_client=kafka)


async def test_topics_without_write_among_their_operations_are_refused() -> None:
    kafka = KafkaAnswering(
        granted={"read-only": READ | DESCRIBE, "writable": WRITE | DESCRIBE, "old": NOT_TOLD},
        errors={"hidden": ErrorCode.topic_authorization_failed},
    )
    context = context_asking(kafka)
    topics = {"read-only", "writable", "old", "hidden", "everything"}
    assert await unwritable(context, topics) == {"read-only", "hidden"}
    assert sorted(kafka.asked[0]) == sorted(topics), "one request for all of them"
    # A topic Kafka does not know is the produce path's to answer, not refused here.
    missing = KafkaAnswering(errors={"gone": ErrorCode.unknown_topic_or_partition})
    assert await unwritable(context_asking(missing), {"gone"}) == set()


async def test_an_answer_is_remembered_per_connection_for_a_while() -> None:
    kafka = KafkaAnswering(granted={"t": READ})
    context = context_asking(kafka)
    assert await unwritable(context, {"t"}) == {"t"}
    assert await unwritable(context, {"t"}) == {"t"}
    assert kafka.asked == [["t"]], "asked once"
    kafka.granted["t"] = WRITE  # the ACL granted meanwhile
    writable, until = context.identity.may_write["t"]
    context.identity.may_write["t"] = (writable, until - REMEMBERED_S)  # its time is up
    assert await unwritable(context, {"t", "u"}) == set()
    assert [sorted(asked) for asked in kafka.asked] == [["t"], ["t", "u"]]
    other = context_asking(kafka)  # another connection asks for itself
    assert await unwritable(other, {"t"}) == set()
    assert len(kafka.asked) == 3


@pytest.mark.parametrize(
    "failure",
    [TimeoutError(), ConnectionResetError("closed"), None],
    ids=["timeout", "closed", "no-connection"],
)
async def test_no_answer_leaves_it_unknown(failure: Exception | None) -> None:
    async def failing(request: Any, timeout_s: float) -> Any:
        assert failure is not None
        raise failure

    context = context_asking(failing if failure is not None else None)
    with pytest.raises(PermissionUnknown):
        await unwritable(context, {"t"})
    assert context.identity.may_write == {}, "nothing remembered"


async def test_what_is_remembered_per_connection_is_bounded() -> None:
    """A client naming ever new topics (Kafka refuses any name to a client that may not
    describe it) grows nothing without bound: past `MAX_REMEMBERED` answers, those whose
    time is up go, then all; each request's own topics are always answered."""
    kafka = KafkaAnswering(granted=dict.fromkeys((f"t{n}" for n in range(5000)), READ))
    context = context_asking(kafka)
    for start in range(0, 5000, 100):
        names = {f"t{n}" for n in range(start, start + 100)}
        assert await unwritable(context, names) == names
        assert len(context.identity.may_write) <= MAX_REMEMBERED
    assert len(kafka.asked) == 50
    kept = set(context.identity.may_write)
    assert await unwritable(context, kept) == kept
    assert len(kafka.asked) == 50, "what is kept is not asked again"


async def test_a_request_whose_new_topics_make_room_keeps_the_answers_it_had() -> None:
    """A request naming a topic remembered and one to ask, when the connection's memory is
    full of answers whose time is not up: making room forgets them all, the remembered
    topic's too, and that topic is still answered (it raised KeyError before)."""
    kafka = KafkaAnswering(granted=dict.fromkeys((f"t{n}" for n in range(MAX_REMEMBERED)), READ))
    context = context_asking(kafka)
    assert await unwritable(context, {f"t{n}" for n in range(MAX_REMEMBERED)})
    assert len(context.identity.may_write) == MAX_REMEMBERED
    assert await unwritable(context, {"t0", "new"}) == {"t0"}
    assert kafka.asked[-1] == ["new"], "the remembered one is not asked again"


async def test_remembered_for_no_time_is_asked_at_every_request() -> None:
    """`write_permission_ttl_s = 0`: Kafka's answer counts for one request, as Kafka checks
    every request, so an ACL taken away refuses the very next write."""
    kafka = KafkaAnswering(granted={"t": WRITE})
    context = context_asking(kafka)
    assert await unwritable(context, {"t"}, remembered_s=0) == set()
    kafka.granted["t"] = READ  # the ACL taken away
    assert await unwritable(context, {"t"}, remembered_s=0) == {"t"}
    assert kafka.asked == [["t"], ["t"]]
