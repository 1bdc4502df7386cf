"""`dedup.topic_ids` against fake broker links: which answer means what, and which brokers
are asked. The real Kafka's answers: tests/integration/test_topic_ids.py."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from kio.schema.errors import ErrorCode

from dedup.topic_ids import (
    METADATA_LANE,
    TopicIds,
    UnknownTopic,
    recovery_token,
    topic_id_of,
)
from proxy.kafka.topology import Endpoint

A, B = Endpoint("a", 9092), Endpoint("b", 9092)
TOPIC_ID = uuid.UUID("5c1a4f3e-9d2b-4c1e-8f00-0123456789ab")


def answer(name: str = "orders", error: int = 0, topic_id: uuid.UUID | None = TOPIC_ID) -> Any:
    return SimpleNamespace(
        topics=[SimpleNamespace(name=name, error_code=ErrorCode(error), topic_id=topic_id)]
    )


@dataclass
class FakeLinks:
    answers: dict[Endpoint, Any]  # an exception is raised
    asked: list[tuple[Endpoint, int, Any]] = field(default_factory=list)

    async def connect(self, endpoint: Endpoint, lane: int) -> FakeLinks.Link:
        return FakeLinks.Link(self, endpoint, lane)

    @dataclass
    class Link:
        links: FakeLinks
        endpoint: Endpoint
        lane: int

        async def request(self, payload: Any) -> Any:
            self.links.asked.append((self.endpoint, self.lane, payload))
            found = self.links.answers[self.endpoint]
            if isinstance(found, Exception):
                raise found
            return found


def ids_of(links: FakeLinks) -> TopicIds:
    return TopicIds(links.connect, lambda: [A, B])


def test_the_id_is_asked_of_the_broker_named_on_a_lane_of_its_own() -> None:
    links = FakeLinks({A: OSError("not asked"), B: answer()})
    assert asyncio.run(ids_of(links).of("orders", B)) == str(TOPIC_ID)
    [(endpoint, lane, request)] = links.asked
    assert (endpoint, lane) == (B, METADATA_LANE)
    assert [str(t.name) for t in request.topics] == ["orders"]
    assert request.allow_auto_topic_creation is False, "asking must not create the topic"


def test_a_broker_named_that_does_not_answer_is_followed_by_the_others() -> None:
    links = FakeLinks({A: answer(), B: ConnectionRefusedError("gone")})
    assert asyncio.run(ids_of(links).of("orders", B)) == str(TOPIC_ID)
    assert [endpoint for endpoint, _, _ in links.asked] == [B, A]


def test_without_a_broker_the_known_ones_are_asked_in_turn() -> None:
    links = FakeLinks({A: TimeoutError(), B: answer()})
    assert asyncio.run(ids_of(links).of("orders")) == str(TOPIC_ID)
    assert [endpoint for endpoint, _, _ in links.asked] == [A, B]


def test_no_broker_answering_raises_the_last_error() -> None:
    links = FakeLinks({A: TimeoutError(), B: ConnectionRefusedError("down")})
    with pytest.raises(ConnectionRefusedError, match="down"):
        asyncio.run(ids_of(links).of("orders"))


THREE_TOPICS = SimpleNamespace(
    topics=[
        SimpleNamespace(name="orders", error_code=ErrorCode(0), topic_id=TOPIC_ID),
        SimpleNamespace(
            name="gone", error_code=ErrorCode.unknown_topic_or_partition, topic_id=None
        ),
        SimpleNamespace(
            name="secret", error_code=ErrorCode.topic_authorization_failed, topic_id=None
        ),
    ]
)


def test_each_topic_in_one_request() -> None:
    links = FakeLinks({A: THREE_TOPICS})
    found = asyncio.run(ids_of(links).answers(["orders", "gone", "secret"]))
    assert set(found) == {"orders", "gone", "secret"}
    [(_, _, request)] = links.asked
    assert [str(t.name) for t in request.topics] == ["orders", "gone", "secret"]


def test_each_topic_answered_with_its_own_error() -> None:
    """What recovery reads: a topic's error fails only that topic's partitions."""
    found = asyncio.run(ids_of(FakeLinks({A: THREE_TOPICS})).answers(["orders", "gone", "secret"]))
    assert found["orders"] == str(TOPIC_ID)
    assert isinstance(found["gone"], UnknownTopic)
    assert isinstance(found["secret"], OSError) and not isinstance(found["secret"], UnknownTopic)


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (answer(topic_id=uuid.UUID(int=0)), None),  # a cluster without topic ids
        (answer(topic_id=None), None),
        (answer(error=ErrorCode.unknown_topic_or_partition), UnknownTopic),
        (answer(error=ErrorCode.topic_authorization_failed), OSError),
        (answer(name="other"), OSError),
    ],
)
def test_what_each_answer_means(reply: Any, expected: type[Exception] | None) -> None:
    links = FakeLinks({A: reply})
    if expected is None:
        assert asyncio.run(ids_of(links).of("orders", A)) is None
    else:
        with pytest.raises(expected):
            asyncio.run(ids_of(links).of("orders", A))


def test_a_recovery_token_names_the_topic_id_last() -> None:
    """Instance ids may hold dots: the id is read from the right."""
    token = recovery_token("inst.a-1.7", str(TOPIC_ID))
    assert token.startswith("inst.a-1.7.") and token != recovery_token("inst.a-1.7", None)
    assert topic_id_of(token) == str(TOPIC_ID)
    assert topic_id_of(recovery_token("inst.a-1.7", None)) is None
    assert topic_id_of("inst-1.7.0123456789abcdef0123456789abcdef") is None, "an older token"
