"""Topic ids asked of a real Kafka (`dedup.topic_ids`): the id Kafka's own admin client
reports, a new one once the topic is deleted and created again, none for a missing topic."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from confluent_kafka import TopicCollection
from confluent_kafka.admin import AdminClient

from dedup.links import UpstreamLinks
from dedup.topic_ids import TopicIds, UnknownTopic
from deploy.local import EnvInfo
from proxy.kafka.topology import Endpoint
from tests.support.topics import delete_and_create_again, new_topic

pytestmark = pytest.mark.integration


def kafka_says(bootstrap: str, topic: str) -> str:
    """The topic's id as Kafka's admin client (librdkafka's DescribeTopics) reports it, as
    the text of a UUID (librdkafka prints it in Kafka's base64 form)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    found = admin.describe_topics(TopicCollection([topic]))[topic].result(30).topic_id
    high = found.get_most_significant_bits() & (2**64 - 1)  # signed longs, as in Java
    low = found.get_least_significant_bits() & (2**64 - 1)
    return str(uuid.UUID(int=high << 64 | low))


async def ask(bootstrap: str, topic: str, *, of_broker: bool) -> str | None:
    host, port = bootstrap.rsplit(":", 1)
    broker = Endpoint(host, int(port))
    links = UpstreamLinks(10.0)
    try:
        return await TopicIds(links.get, lambda: [broker]).of(topic, broker if of_broker else None)
    finally:
        await links.close()


def test_the_id_is_kafkas_and_changes_when_the_topic_is_created_again(
    local_env: EnvInfo,
) -> None:
    topic = new_topic(local_env.bootstrap)
    first = asyncio.run(ask(local_env.bootstrap, topic, of_broker=True))
    assert first is not None and first != "00000000-0000-0000-0000-000000000000"
    assert first == kafka_says(local_env.bootstrap, topic)
    assert asyncio.run(ask(local_env.bootstrap, topic, of_broker=False)) == first
    delete_and_create_again(local_env.bootstrap, topic)
    second = asyncio.run(ask(local_env.bootstrap, topic, of_broker=True))
    assert second is not None and second != first
    assert second == kafka_says(local_env.bootstrap, topic)


def test_a_missing_topic_is_unknown(local_env: EnvInfo) -> None:
    with pytest.raises(UnknownTopic, match="does not exist"):
        asyncio.run(ask(local_env.bootstrap, "no-such-topic-anywhere", of_broker=True))


def test_several_topics_in_one_request_a_missing_one_unknown(local_env: EnvInfo) -> None:
    first, second = new_topic(local_env.bootstrap), new_topic(local_env.bootstrap)
    host, port = local_env.bootstrap.rsplit(":", 1)
    broker = Endpoint(host, int(port))

    async def ask_each() -> dict[str, str | Exception | None]:
        links = UpstreamLinks(10.0)
        try:
            return await TopicIds(links.get, lambda: [broker]).answers(
                [first, "no-such-topic-anywhere", second]
            )
        finally:
            await links.close()

    found = asyncio.run(ask_each())
    missing = found.pop("no-such-topic-anywhere")
    assert isinstance(missing, UnknownTopic), missing
    assert found == {
        first: kafka_says(local_env.bootstrap, first),
        second: kafka_says(local_env.bootstrap, second),
    }
