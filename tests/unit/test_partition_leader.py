"""What a Metadata answer says of one partition (`proxy.runtime.cluster`): its leader,
unknown, or no such partition (Kafka's UNKNOWN_TOPIC_OR_PARTITION); and lookups sharing
requests: those of one topic while its request is under way, and those of many topics
asked in one turn of the event loop."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from kio.schema.errors import ErrorCode

from proxy.kafka.topology import Endpoint, Topology
from proxy.runtime import cluster as cluster_module
from proxy.runtime.cluster import NoSuchPartition, UpstreamCluster, leader_in_answer


def answer(error: ErrorCode = ErrorCode.none, partitions: Any = ((0, 0),), name: str = "t") -> Any:
    """A Metadata answer naming topic ``name``: (index, error) per partition, led by 2."""
    return SimpleNamespace(
        topics=[
            SimpleNamespace(
                name=name,
                error_code=error,
                partitions=[
                    SimpleNamespace(
                        partition_index=i, error_code=ErrorCode(e), leader_id=2, leader_epoch=5
                    )
                    for i, e in partitions
                ],
            )
        ]
    )


def test_a_partition_with_a_leader() -> None:
    assert leader_in_answer(answer(partitions=((0, 0), (1, 0))), "t", 1) == (2, 5)


@pytest.mark.parametrize(
    ("reply", "partition"),
    [
        (answer(ErrorCode.unknown_topic_or_partition, ()), 0),  # no such topic
        (answer(partitions=((0, 0),)), 3),  # the topic has fewer partitions
    ],
)
def test_no_such_partition(reply: Any, partition: int) -> None:
    with pytest.raises(NoSuchPartition):
        leader_in_answer(reply, "t", partition)


@pytest.mark.parametrize(
    "reply",
    [
        answer(ErrorCode.leader_not_available, ()),  # being created
        answer(ErrorCode.topic_authorization_failed, ()),  # not ours to see
        answer(partitions=((0, int(ErrorCode.leader_not_available)),)),  # no leader now
        answer(name="other"),  # the answer does not name it
    ],
)
def test_unknown_is_not_absent(reply: Any) -> None:
    assert leader_in_answer(reply, "t", 0) is None


async def settled() -> None:
    """Let every task started so far run until it waits (a lookup, then its request)."""
    for _ in range(5):
        await asyncio.sleep(0)


class CountingCluster(UpstreamCluster):
    """The lookup's sharing alone: each Metadata request counted, answered when told."""

    def __init__(self) -> None:
        super().__init__(Topology([Endpoint("kafka", 9092)], "proxy", broker_port_base=40000), 1.0)
        self.asked: list[list[str]] = []  # the topics of each request
        self.answers: list[asyncio.Future[Any]] = []

    @property
    def answer(self) -> asyncio.Future[Any] | None:
        """The answer to the latest request."""
        return self.answers[-1] if self.answers else None

    async def _ask_topics(self, topics: list[str]) -> Any:
        self.asked.append(list(topics))
        self.answers.append(asyncio.get_running_loop().create_future())
        return await self.answers[-1]


async def test_lookups_of_one_topic_under_way_together_share_one_request() -> None:
    cluster = CountingCluster()
    lookups = [asyncio.ensure_future(cluster.partition_leader("t", p)) for p in range(3)]
    given_up = asyncio.ensure_future(cluster.partition_leader("t", 0))
    await settled()
    assert cluster.asked == [["t"]]
    given_up.cancel()  # one lookup given up does not end the others'
    await settled()
    assert cluster.answer is not None
    cluster.answer.set_result(answer(partitions=((0, 0), (1, 0))))
    assert await asyncio.gather(*lookups[:2]) == [(2, 5), (2, 5)]
    with pytest.raises(NoSuchPartition):
        await lookups[2]
    later = asyncio.ensure_future(cluster.partition_leader("t", 1))
    await settled()
    assert cluster.asked == [["t"], ["t"]], "asked again once the answer is in"
    cluster.answer.set_result(None)
    assert await later is None


async def test_a_failed_request_fails_each_lookup_of_it_and_is_not_kept() -> None:
    cluster = CountingCluster()
    lookups = [asyncio.ensure_future(cluster.partition_leader("t", p)) for p in range(2)]
    await settled()
    assert cluster.answer is not None
    cluster.answer.set_exception(ValueError("undecodable answer"))
    for lookup in lookups:
        with pytest.raises(ValueError, match="undecodable"):
            await lookup
    again = asyncio.ensure_future(cluster.partition_leader("t", 0))
    await settled()
    cluster.answer.set_result(answer())
    assert await again == (2, 5) and cluster.asked == [["t"], ["t"]]


def many(*topics: str) -> Any:
    """A Metadata answer naming each of ``topics``, partition 0 led by 2."""
    return SimpleNamespace(topics=[answer(name=topic).topics[0] for topic in topics])


async def test_lookups_of_many_topics_in_one_turn_share_one_request() -> None:
    cluster = CountingCluster()
    lookups = [asyncio.ensure_future(cluster.partition_leader(t, 0)) for t in ("a", "b", "a", "c")]
    await settled()
    assert cluster.asked == [["a", "b", "c"]], "one request, each topic named once"
    later = asyncio.ensure_future(cluster.partition_leader("d", 0))
    joining = asyncio.ensure_future(cluster.partition_leader("b", 0))
    await settled()
    assert cluster.asked == [["a", "b", "c"], ["d"]], "b's request is under way: shared"
    cluster.answers[0].set_result(many("a", "b"))  # c: not named, so not known
    assert await asyncio.gather(*lookups, joining) == [(2, 5), (2, 5), (2, 5), None, (2, 5)]
    cluster.answers[1].set_exception(OSError("no broker"))
    with pytest.raises(OSError, match="no broker"):
        await later
    again = asyncio.ensure_future(cluster.partition_leader("a", 0))
    await settled()
    assert cluster.asked[-1] == ["a"], "asked again once its answer is in"
    cluster.answers[-1].set_result(many("a"))
    assert await again == (2, 5)


async def test_a_request_names_at_most_topics_per_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_module, "TOPICS_PER_LOOKUP", 2)
    cluster = CountingCluster()
    topics = ["a", "b", "c", "d", "e"]
    lookups = [asyncio.ensure_future(cluster.partition_leader(t, 0)) for t in topics]
    await settled()
    assert cluster.asked == [["a", "b"], ["c", "d"], ["e"]]
    for answered, named in zip(cluster.answers, cluster.asked, strict=True):
        answered.set_result(many(*named))
    assert await asyncio.gather(*lookups) == [(2, 5)] * len(topics)
