"""What a Metadata answer says of one partition (`proxy.runtime.cluster`): its leader,
unknown, or no such partition (Kafka's UNKNOWN_TOPIC_OR_PARTITION)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from kio.schema.errors import ErrorCode

from proxy.runtime.cluster import NoSuchPartition, leader_in_answer


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
