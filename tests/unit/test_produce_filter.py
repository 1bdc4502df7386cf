"""How the dedup filter decodes a Produce request: a large one in a worker thread by the
hand decoder, the same entity kio makes; a small one, or one the hand decoder leaves to
kio, by kio on the event loop."""

from __future__ import annotations

import asyncio
import datetime
import io
import threading
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kio.schema.errors import ErrorCode
from kio.serial import entity_writer

from dedup.batches import records_declared
from dedup.engine import PartitionAnswer
from dedup.ownership.nodes import Node
from dedup.ownership.owner import Redirect
from dedup.produce_filter import (
    DECODE_OFF_LOOP_BYTES,
    DedupProduceFilter,
    _decoded,
    numbered_below_zero,
    numbers_reports_from_base,
    produce_answer,
    produce_response,
)
from proxy.kafka.api_keys import ApiKey
from proxy.kafka.schemas import DECODABLE_VERSIONS, decode_request_body, decode_response_body
from proxy.kafka.topology import Endpoint
from proxy.kafka.upstream_client import encode_request
from proxy.kafka.wire import FrameError, parse_request_header
from proxy.runtime.chain import (
    ClientIdentity,
    ClientSoftware,
    EncodedResponse,
    LocalAnswer,
    RequestFrame,
    Respond,
    encode_response,
)
from tests.support.permissions import READ, KafkaAnswering
from tests.support.raw import explicit_batch, produce_request_to
from tests.support.threads import record_to_thread

pytestmark = pytest.mark.unit

BROKER = Endpoint("127.0.0.1", 9092)


def frame_of(records: bytes, tail: bytes = b"", topics: Sequence[str] = ("t",)) -> RequestFrame:
    request = produce_request_to({topic: {0: records} for topic in topics})
    payload = encode_request(request, 7)[4:]
    if tail:  # replace the body's empty tagged fields
        payload = payload[:-1] + tail
    return RequestFrame(parse_request_header(payload), payload)


def kio_decode(frame: RequestFrame) -> Any:
    header = frame.header
    return decode_request_body(0, header.api_version, frame.payload, header.body_offset)


def test_a_large_request_is_decoded_in_a_worker_thread_as_kio_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ran_in = record_to_thread(monkeypatch)
    frame = frame_of(bytes(range(256)) * (DECODE_OFF_LOOP_BYTES // 256))
    decoded = asyncio.run(_decoded(frame))
    assert len(ran_in) == 1 and ran_in[0] != threading.get_ident()
    assert decoded == kio_decode(frame)
    assert frame.decode() is decoded, "kept on the frame"


def test_a_small_request_is_decoded_by_kio_on_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    ran_in = record_to_thread(monkeypatch)
    frame = frame_of(b"abc")
    assert asyncio.run(_decoded(frame)) == kio_decode(frame)
    assert ran_in == []


def test_a_large_request_the_hand_decoder_leaves_is_kios_to_refuse() -> None:
    frame = frame_of(bytes(DECODE_OFF_LOOP_BYTES), tail=b"\x01\x05\x01\x00")  # a tagged field
    with pytest.raises(FrameError, match="malformed produce request"):
        asyncio.run(_decoded(frame))


class _HeldEngine:
    """An engine whose every request is written when the test says (or fails with `error`)."""

    base_offset = 5  # what every write is answered

    def __init__(self, error: Exception | None = None) -> None:
        self.release = asyncio.Event()
        self.written = 0
        self.error = error
        self.connections: list[object | None] = []  # each admitted request's
        self.admitted: list[list[str]] = []  # each admitted request's topics
        self.refusal: dict[Any, PartitionAnswer] | None = None  # for a transactional request

    async def dedup_anywhere(self) -> bool:
        return True

    async def refuse_foreign_names_in_transaction(
        self, request: Any, principal: str | None
    ) -> dict[Any, PartitionAnswer] | None:
        return self.refusal

    async def admit(
        self, request: Any, principal: str | None = None, connection: object | None = None
    ) -> object:
        self.connections.append(connection)
        self.admitted.append([str(topic.name) for topic in request.topic_data])
        return object()

    async def produce(self, request: Any, admission: Any, broker: Any) -> dict[Any, Any]:
        await self.release.wait()
        if self.error is not None:
            raise self.error
        self.written += 1
        return {
            (str(topic.name), int(part.index)): PartitionAnswer(base_offset=self.base_offset)
            for topic in request.topic_data
            for part in topic.partition_data
        }


async def _responded(
    engine: _HeldEngine,
    records: bytes = b"records",
    software: ClientSoftware | None = None,
    numbering_from_base: Sequence[str] = (),
    kafka: Any = None,
    topics: Sequence[str] = ("t",),
) -> tuple[DedupProduceFilter, Respond]:
    """The filter over `engine`, and its decision on one Produce request (a `Respond`);
    ``kafka`` answers whether the client may write (`KafkaAnswering`: it may)."""
    produce_filter = DedupProduceFilter(cast(Any, engine), numbering_from_base)
    context = _context(kafka or KafkaAnswering(), software or ClientSoftware())
    decision = await produce_filter.on_request(frame_of(records, topics=topics), cast(Any, context))
    assert isinstance(decision, Respond)
    return produce_filter, decision


def _context(kafka: Any, software: ClientSoftware) -> Any:
    """A client connection's `FilterContext`, as the filter reads it; ``kafka`` answers
    whether the client may write."""
    return SimpleNamespace(
        identity=ClientIdentity(),
        upstream=BROKER,
        connection=CONNECTION,
        software=software,
        ask_as_client=kafka,
    )


CONNECTION = object()  # stands for the client connection of `_responded`'s request


def test_the_engine_is_told_the_connection_a_request_came_on() -> None:
    """Refusals about one request alone hold back only its connection's requests behind it
    (`dedup.partitions.Reach`): the engine must know which connection that is."""

    async def scenario() -> list[object | None]:
        engine = _HeldEngine()
        produce_filter, _ = await _responded(engine)
        engine.release.set()
        await produce_filter.drain()
        return engine.connections

    assert asyncio.run(scenario()) == [CONNECTION]


def test_the_answer_is_the_produce_response_of_the_write() -> None:
    async def scenario() -> Any:
        engine = _HeldEngine()
        _, decision = await _responded(engine)
        engine.release.set()
        return await decision.answer

    response = as_read(asyncio.run(scenario()), 9)  # `frame_of` writes Produce v9
    (topic,) = response.responses
    (partition,) = topic.partition_responses
    assert (str(topic.name), int(partition.index), int(partition.base_offset)) == ("t", 0, 5)


def test_a_refused_transactional_request_is_answered_at_once_and_never_admitted() -> None:
    async def scenario() -> Any:
        engine = _HeldEngine()
        engine.refusal = {
            ("t", 0): PartitionAnswer(ErrorCode.topic_authorization_failed, error_message="no")
        }
        _, decision = await _responded(engine)
        assert decision.answer.done()  # nothing written, nothing waited for
        assert engine.connections == []  # not admitted: no place in the line
        return decision.answer.result()

    response = as_read(asyncio.run(scenario()), 9)
    (topic,) = response.responses
    (partition,) = topic.partition_responses
    assert (int(partition.error_code), partition.error_message) == (29, "no")


@pytest.mark.parametrize(
    ("kafka", "code", "message"),
    [
        (KafkaAnswering(granted={"t": READ}), 29, "Kafka does not let this client write"),
        (KafkaAnswering(errors={"t": ErrorCode.topic_authorization_failed}), 29, "write"),
        (None, None, None),  # Kafka does not answer in time
    ],
    ids=["read-only", "not-even-describe", "no-answer"],
)
def test_a_client_kafka_does_not_let_write_is_refused_and_never_admitted(
    kafka: Any, code: int | None, message: str | None
) -> None:
    """The proxy writes under its own principal, so it asks Kafka, as the client, whether
    the client may write the topic (`dedup.write_permissions`); where it may not, Kafka's
    answer is given and nothing written. No answer: refused, retriable."""

    async def timing_out(request: Any, timeout_s: float) -> Any:
        raise TimeoutError

    async def scenario() -> Any:
        engine = _HeldEngine()
        _, decision = await _responded(engine, kafka=kafka or timing_out)
        assert decision.answer.done()
        assert engine.connections == []  # not admitted: no place in the line
        return decision.answer.result()

    response = as_read(asyncio.run(scenario()), 9)
    (topic,) = response.responses
    (partition,) = topic.partition_responses
    if code is None:
        assert int(partition.error_code) == ErrorCode.not_enough_replicas
        assert "whether the client may write is unknown" in partition.error_message
    else:
        assert int(partition.error_code) == code
        assert message in partition.error_message


def test_the_topics_a_client_may_write_are_written_and_the_others_refused_as_kafka_does() -> None:
    """A request naming a topic the client may write and one it may not: Kafka writes the
    first and refuses the second; so does the proxy. Only the writable topic reaches the
    engine."""

    async def scenario() -> tuple[Any, list[list[str]]]:
        engine = _HeldEngine()
        kafka = KafkaAnswering(granted={"read-only": READ})
        _, decision = await _responded(engine, kafka=kafka, topics=("t", "read-only"))
        engine.release.set()
        return await decision.answer, engine.admitted

    answer, admitted = asyncio.run(scenario())
    assert admitted == [["t"]]
    response = as_read(answer, 9)
    answered = {
        str(topic.name): (int(p.error_code), int(p.base_offset))
        for topic in response.responses
        for p in topic.partition_responses
    }
    assert answered == {"t": (0, 5), "read-only": (29, -1)}


@pytest.mark.parametrize(("ttl_s", "asked"), [(30.0, 1), (0.0, 2)])
def test_kafkas_answer_is_kept_as_long_as_the_setting_says(ttl_s: float, asked: int) -> None:
    """`write_permission_ttl_s` reaches the question: two requests on one connection ask
    Kafka once within it, and each asks with 0."""

    async def scenario() -> int:
        kafka = KafkaAnswering()
        produce_filter = DedupProduceFilter(cast(Any, _HeldEngine()), write_permission_ttl_s=ttl_s)
        context = _context(kafka, ClientSoftware())
        for _ in range(2):
            await produce_filter.on_request(frame_of(b"records"), context)
        return len(kafka.asked)

    assert asyncio.run(scenario()) == asked


def test_a_connection_that_stops_waiting_leaves_the_write_running() -> None:
    async def scenario() -> int:
        engine = _HeldEngine()
        produce_filter, decision = await _responded(engine)
        decision.answer.cancel()  # the client's connection went away
        await asyncio.sleep(0)
        engine.release.set()
        await produce_filter.drain()
        return engine.written

    assert asyncio.run(scenario()) == 1


def test_a_failed_write_fails_the_answer_with_its_error() -> None:
    async def scenario() -> None:
        engine = _HeldEngine(error=RuntimeError("boom"))
        _, decision = await _responded(engine)
        engine.release.set()
        with pytest.raises(RuntimeError, match="boom"):
            await decision.answer

    asyncio.run(scenario())


# ----------------------------------------------------------------------------- the answer's bytes

# Every version a client may send through the proxy (`DECODABLE_VERSIONS`: up to v12).
PRODUCE_VERSIONS = range(
    DECODABLE_VERSIONS[ApiKey.PRODUCE].min, DECODABLE_VERSIONS[ApiKey.PRODUCE].max + 1
)


def as_read(answer: LocalAnswer, version: int) -> Any:
    """A local answer as the client reads it: the kio entity of its bytes."""
    if isinstance(answer, EncodedResponse):
        return decode_response_body(ApiKey.PRODUCE, version, answer.body, 0)
    return answer


def kio_frame_of(correlation_id: int, response: Any) -> bytes:
    """The response as kio's own writer writes it, header and body."""
    buffer = io.BytesIO()
    entity_writer(type(response))(buffer, response)
    tagged = b"\x00" if type(response).__header_schema__.__flexible__ else b""
    return correlation_id.to_bytes(4, "big") + tagged + buffer.getvalue()


def request_naming(parts: Sequence[tuple[str, int]]) -> Any:
    """What the answer reads of a Produce request: its topics and partitions, in order (a
    topic or partition may be named twice)."""
    return SimpleNamespace(
        topic_data=[
            SimpleNamespace(name=topic, partition_data=[SimpleNamespace(index=partition)])
            for topic, partition in parts
        ]
    )


_answers = st.builds(
    PartitionAnswer,
    error_code=st.sampled_from([int(code) for code in ErrorCode]),
    base_offset=st.integers(-1, 2**63 - 1),
    log_append_time_ms=st.one_of(st.just(-1), st.integers(0, 4_102_444_800_000)),
    log_start_offset=st.integers(-1, 2**63 - 1),
    error_message=st.one_of(st.none(), st.text(max_size=12)),
)


@given(
    version=st.sampled_from(PRODUCE_VERSIONS),
    parts=st.lists(
        st.tuples(st.sampled_from(["orders", "t", "ü-topic"]), st.integers(0, 3)),
        min_size=1,
        max_size=6,
    ),
    answers=st.lists(_answers, min_size=16, max_size=16),
)
def test_the_answer_is_written_as_kio_writes_its_produce_response(
    version: int, parts: list[tuple[str, int]], answers: list[PartitionAnswer]
) -> None:
    """The proxy's answer to a Produce, written without a kio entity, is byte for byte what
    kio writes for the ProduceResponse of the same answers, in every version: one entry per
    topic and partition however often the request named them, in the request's order."""
    by_partition = {key: answers[n] for n, key in enumerate(sorted(set(parts)))}
    request = request_naming(parts)
    answer = produce_answer(version, by_partition, request)
    expected = kio_frame_of(7, produce_response(version, by_partition, request))
    assert encode_response(7, answer) == expected


def test_a_redirect_is_answered_with_the_kip_951_fields_kio_writes() -> None:
    owner = Redirect("b", Node(2001, Endpoint("b-host", 9193)), 5)
    answers = {("t", 0): PartitionAnswer(ErrorCode.not_leader_or_follower, redirect=owner)}
    answer = produce_answer(10, answers, request_naming([("t", 0)]))
    assert not isinstance(answer, EncodedResponse)
    (part,) = as_read(answer, 10).responses[0].partition_responses
    assert int(part.current_leader.leader_id) == 2001


@pytest.mark.parametrize("version", [3, 9, 12])
def test_the_log_append_time_kafka_answered_reaches_the_client(version: int) -> None:
    """A topic of `message.timestamp.type=LogAppendTime`: Kafka answers the time it
    appended the records, and the client's record metadata carries it; -1 otherwise."""
    appended = 1_764_000_000_123
    answers = {
        ("t", 0): PartitionAnswer(base_offset=10, log_append_time_ms=appended),
        ("t", 1): PartitionAnswer(base_offset=11),
    }
    for answer in (
        produce_answer(version, answers, request_naming([("t", 0), ("t", 1)])),
        produce_response(version, answers, request_naming([("t", 0), ("t", 1)])),
    ):
        first, second = as_read(answer, version).responses[0].partition_responses
        assert first.log_append_time == datetime.datetime.fromtimestamp(
            appended / 1000, tz=datetime.UTC
        )
        assert second.log_append_time is None  # -1 on the wire


def test_only_clients_built_on_librdkafka_number_their_reports_from_the_base_offset() -> None:
    # As each names itself (read in their sources): Go's and .NET's give librdkafka's
    # bare version as theirs, JavaScript's its own and librdkafka's.
    numbering = [
        ClientSoftware("librdkafka", "2.6.1"),
        ClientSoftware("confluent-kafka-python", "2.6.1-rdkafka-2.6.1"),
        ClientSoftware("confluent-kafka-go", "2.6.1"),
        ClientSoftware("confluent-kafka-dotnet", "2.6.1"),
        ClientSoftware("confluent-kafka-javascript", "1.2.0-librdkafka-2.6.1"),
        ClientSoftware("node-rdkafka", "3.2.1"),
    ]
    not_numbering = [
        ClientSoftware("apache-kafka-java", "3.9.0"),
        ClientSoftware("kafka-python", "3.0.12"),
        ClientSoftware("confluent-kafka-rest", "7.8.0"),  # not a name the proxy knows
        ClientSoftware(),  # said nothing (ApiVersions before v3)
    ]
    assert [numbers_reports_from_base(s) for s in numbering] == [True] * len(numbering)
    assert [numbers_reports_from_base(s) for s in not_numbering] == [False] * 4
    # An operator's list adds names (a librdkafka wrapper under a name of its own).
    assert numbers_reports_from_base(ClientSoftware("ClickHouse", "24.8"), {"ClickHouse"})
    assert not numbers_reports_from_base(ClientSoftware("ClickHouse", "24.8"), {"clickhouse"})


@pytest.mark.parametrize(
    ("listed", "base_offset"), [((), -1), (["wrapper"], -3)], ids=["unlisted", "listed"]
)
def test_the_filter_answers_a_listed_client_below_zero(
    listed: Sequence[str], base_offset: int
) -> None:
    """`clients_numbering_from_base` reaches the answer: a batch of 3 records answered
    without an offset is -3 for a client the setting names, -1 for one it does not."""

    async def scenario() -> Any:
        engine = _HeldEngine()
        engine.base_offset = -1
        batch = explicit_batch([("p", 0), ("p", 1), ("p", 2)])
        _, decision = await _responded(
            engine, batch, ClientSoftware("wrapper", "1.0"), numbering_from_base=listed
        )
        engine.release.set()
        return await decision.answer

    response = as_read(asyncio.run(scenario()), 9)
    (topic,) = response.responses
    (partition,) = topic.partition_responses
    assert int(partition.base_offset) == base_offset


def test_a_batch_answered_without_an_offset_is_numbered_below_zero_for_such_clients() -> None:
    """librdkafka reports a batch's records at base, base + 1, ...: from minus the record
    count, every one of them names a negative offset, none; from -1, all but the first
    would name other records' offsets. Answers with an offset, errors and single records
    are left as they are."""
    three, one = explicit_batch([("p", 0), ("p", 1), ("p", 2)]), explicit_batch([("p", 3)])
    request = produce_request_to(
        {"t": {0: three, 1: three, 2: one, 3: three + one}, "u": {0: three}}
    )
    answers = {
        ("t", 0): PartitionAnswer(base_offset=-1, log_start_offset=4),
        ("t", 1): PartitionAnswer(base_offset=7),
        ("t", 2): PartitionAnswer(base_offset=-1),
        ("t", 3): PartitionAnswer(base_offset=-1),
        ("u", 0): PartitionAnswer(error_code=int(ErrorCode.not_enough_replicas)),
    }
    assert numbered_below_zero(answers, request) == {
        ("t", 0): PartitionAnswer(base_offset=-3, log_start_offset=4),
        ("t", 1): PartitionAnswer(base_offset=7),
        ("t", 2): PartitionAnswer(base_offset=-1),
        ("t", 3): PartitionAnswer(base_offset=-4),  # two batches: 3 records and 1
        ("u", 0): PartitionAnswer(error_code=int(ErrorCode.not_enough_replicas)),
    }
    assert answers[("t", 0)].base_offset == -1, "the engine's answers are not changed"


@given(st.lists(st.integers(1, 30), max_size=5), st.data())
def test_the_records_batches_declare_are_counted_from_their_headers(
    sizes: list[int], data: st.DataObject
) -> None:
    batches = [explicit_batch([("p", i) for i in range(size)]) for size in sizes]
    raw = b"".join(batches)
    assert records_declared(raw) == sum(sizes)
    if raw:  # cut anywhere but at a batch's end: not whole batches
        ends = {sum(len(b) for b in batches[: i + 1]) for i in range(len(batches))}
        cut = data.draw(st.integers(1, len(raw) - 1).filter(lambda at: at not in ends))
        assert records_declared(raw[:cut]) is None
        old_magic = bytearray(raw)
        old_magic[16] = 1
        assert records_declared(bytes(old_magic)) is None
