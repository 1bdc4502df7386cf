"""The maps in memory of one partition (`dedup.sequences.PartitionSequences`), by example:
Pulsar's table on one producer, runs, the recovery token, ``max_sequence_jump``, eviction at
``max_producers`` (in flight, in the batch, a clock stepping back), an acknowledgement after
a reset, the recovered maps, the idle purge, the snapshot's view and chunked messages.
`tests/integration/test_check_in_memory.py` holds the same rules to the Lua scripts' answers
under hypothesis, with a clock that only goes forward."""

from __future__ import annotations

import pytest

from dedup.chunks import ChunkMeta, ChunkProgress
from dedup.sequences import PartitionSequences
from dedup.state import (
    PartitionCheck,
    PartitionVerdict,
    ProducerState,
    RecoveredState,
    RunIdentities,
    Status,
    check_runs,
)

pytestmark = pytest.mark.unit

NEW, DUP, UNKNOWN = Status.NOT_DUP, Status.DUP, Status.UNKNOWN
TOKEN = "tok"


def batch(*identities: tuple[str, int], token: str | None = TOKEN) -> PartitionCheck:
    return PartitionCheck("t", 0, list(identities), token)


def run(producer: str, first: int, last: int) -> PartitionCheck:
    identities = [(producer, s) for s in range(first, last + 1)]
    return PartitionCheck("t", 0, RunIdentities(check_runs(identities)), TOKEN)


def chunks(*records: tuple[str, int, ChunkMeta | None, int]) -> PartitionCheck:
    return PartitionCheck(
        "t",
        0,
        [(p, s) for p, s, _, _ in records],
        TOKEN,
        [None if meta is None else (meta, size) for _, _, meta, size in records],
    )


def loaded(max_producers: int = 10, **seen: int) -> PartitionSequences:
    """Producers recovered at sequence 1, last seen at the given times."""
    producers = {name: (1, ms) for name, ms in seen.items()}
    return PartitionSequences.recovered(TOKEN, producers, max_producers=max_producers)


# --------------------------------------------------------------------------- the table


def test_a_new_record_is_new_a_resend_of_an_acknowledged_one_a_duplicate() -> None:
    table = PartitionSequences(TOKEN)
    # Nothing else in the verdict: no eviction, and sizes only for a batch with chunks.
    assert table.check(batch(("a", 1)), 100) == PartitionVerdict((NEW,), ())
    assert table.producers() == {"a": ProducerState(1, None, 100)}
    table.persisted({"a": 1}, 110)
    assert table.check(batch(("a", 1), ("a", 0)), 120).statuses == (DUP, DUP)
    assert table.check(batch(("a", 2)), 130).statuses == (NEW,)
    assert table.producers() == {"a": ProducerState(2, 1, 130)}


def test_a_record_pushed_but_not_acknowledged_refuses_the_whole_batch() -> None:
    table = loaded(a=100)
    table.check(batch(("a", 2)), 200)  # in flight: pushed 2, persisted 1
    before = table.producers()
    verdict = table.check(batch(("b", 1), ("a", 3), ("a", 2)), 300)
    assert verdict.statuses == (NEW, NEW, UNKNOWN)
    assert verdict.refused
    # Neither b's first record nor a's 3 was taken: the retry of the batch must see them new.
    assert table.producers() == before


def test_a_sequence_repeated_inside_one_batch_is_a_duplicate_of_its_first_copy() -> None:
    table = loaded(a=100)
    verdict = table.check(batch(("a", 2), ("a", 2), ("a", 3), ("a", 2)), 200)
    assert verdict.statuses == (NEW, DUP, NEW, DUP)
    assert not verdict.refused
    assert table.producers()["a"] == ProducerState(3, 1, 200)


def test_a_run_above_pushed_is_new_all_through_and_pushed_becomes_its_last() -> None:
    table = loaded(a=100)
    assert table.check(run("a", 2, 6), 200).statuses == (NEW,) * 5
    assert table.producers()["a"].pushed == 6


def test_a_retry_run_is_duplicate_up_to_what_was_acknowledged_and_new_beyond() -> None:
    table = loaded(a=100)
    table.check(run("a", 2, 6), 200)
    table.persisted({"a": 6}, 210)
    assert table.check(run("a", 4, 9), 300).statuses == (DUP,) * 3 + (NEW,) * 3
    assert table.producers()["a"] == ProducerState(9, 6, 300)


def test_a_retry_run_over_an_unacknowledged_write_is_unknown_there_and_refused() -> None:
    table = loaded(a=100)
    table.check(run("a", 2, 4), 200)  # pushed 4, persisted 1
    before = table.producers()
    verdict = table.check(run("a", 0, 6), 300)
    assert verdict.statuses == (DUP, DUP, UNKNOWN, UNKNOWN, UNKNOWN, NEW, NEW)
    assert table.producers() == before


# --------------------------------------------------------------------------- the rules


def test_a_check_under_another_token_is_lost_and_one_without_a_token_passes() -> None:
    table = loaded(a=100)
    before = table.producers()
    verdict = table.check(batch(("a", 2), token="an-older-recovery"), 200)
    assert verdict.lost and verdict.statuses == () and verdict.refused
    assert table.producers() == before
    assert table.check(batch(("a", 2), token=None), 300).statuses == (NEW,)


def test_a_known_producer_jumping_over_the_bound_is_refused_a_new_one_starts_anywhere() -> None:
    table = PartitionSequences.recovered(TOKEN, {"a": (10, 100)}, max_jump=5)
    before = table.producers()
    verdict = table.check(batch(("b", 1_000_000), ("a", 16)), 200)
    assert (verdict.jump, verdict.gap, verdict.bad_index, verdict.statuses) == (True, False, 1, ())
    assert verdict.bad is not None and "max_sequence_jump" in verdict.bad
    assert table.producers() == before  # b, though new and fine, was not taken either
    # Exactly the bound is allowed; a new producer may start anywhere.
    assert table.check(batch(("b", 1_000_000), ("a", 15)), 300).statuses == (NEW, NEW)


# --------------------------------------------------------------------------- eviction


def test_eviction_takes_the_least_recently_seen_and_names_them() -> None:
    table = loaded(2, a=100, b=200)
    assert table.check(batch(("c", 1)), 300).evicted == ("a",)
    assert sorted(table.producers()) == ["b", "c"]


def test_eviction_steps_over_writes_in_flight_even_if_the_table_stays_over_its_bound() -> None:
    table = loaded(2, a=100)
    table.check(batch(("a", 2)), 100)  # a in flight, and still the least recently seen
    table.check(batch(("b", 1)), 200)
    table.persisted({"b": 1}, 200)
    assert table.check(batch(("c", 1)), 300).evicted == ("b",)
    # a and c are in flight, d in the batch: no one may go.
    assert table.check(batch(("d", 1)), 400).evicted == ()
    assert sorted(table.producers()) == ["a", "c", "d"]


def test_the_producers_of_the_batch_are_never_evicted() -> None:
    table = loaded(1, a=100, b=200, c=300)
    verdict = table.check(batch(("b", 1), ("c", 1)), 400)
    assert verdict.evicted == ("a",)
    assert sorted(table.producers()) == ["b", "c"]  # over the bound of 1


def test_a_check_earlier_than_a_producers_last_seen_leaves_it_the_least_recent() -> None:
    table = loaded(2, a=100, b=200)
    table.check(batch(("a", 1)), 50)  # the clock stepped back
    assert table.producers()["a"].last_seen_ms == 100
    assert table.check(batch(("c", 1)), 300).evicted == ("a",)


def test_a_check_between_two_producers_last_seen_times_keeps_them_in_time_order() -> None:
    table = loaded(2, a=100, b=200)
    table.check(batch(("a", 1)), 150)  # after a's last seen, before b's: a step back
    assert table.producers()["a"].last_seen_ms == 150
    assert table.check(batch(("c", 1)), 300).evicted == ("a",)


def test_after_a_step_back_of_the_clock_the_oldest_is_still_evicted_first() -> None:
    table = loaded(3, a=100, b=200, c=300)
    table.check(batch(("a", 1)), 150)  # a is now seen after b and c, but at an older time
    assert table.check(batch(("d", 1)), 400).evicted == ("a",)


def test_producers_seen_at_the_same_time_are_evicted_in_name_order() -> None:
    table = loaded(3)
    table.check(batch(("c", 1), ("a", 1), ("b", 1)), 100)  # met c, a, b: seen together
    table.persisted({"c": 1, "a": 1, "b": 1}, 100)  # written: none in flight
    assert table.check(batch(("d", 1)), 200).evicted == ("a",)


# --------------------------------------------------------------------------- after the write


def test_an_acknowledgement_after_a_reset_raises_pushed_back_so_a_resend_is_a_duplicate() -> None:
    table = loaded(a=100)
    table.check(batch(("a", 2)), 200)
    table.reset()  # the write looked failed ...
    assert table.producers()["a"].pushed == 1
    table.persisted({"a": 2}, 300)  # ... but Kafka had it
    assert table.producers()["a"] == ProducerState(2, 2, 300)
    assert table.check(batch(("a", 2)), 400).statuses == (DUP,)


# --------------------------------------------------------------------------- recovery, admin

IN_PROGRESS = ChunkProgress(6, "m6", 0, 2, 10, 4)
OTHER = ChunkProgress(3, "m3", 1, 3, 9, 6)


def test_a_recovered_partition_has_pushed_equal_to_persisted() -> None:
    table = PartitionSequences.recovered(
        TOKEN, {"a": (5, 100)}, {"a": (IN_PROGRESS, 150), "b": (OTHER, 200)}
    )
    assert table.producers() == {
        "a": ProducerState(5, 5, 150, IN_PROGRESS, IN_PROGRESS),
        "b": ProducerState(None, None, 200, OTHER, OTHER),
    }


def test_a_recovered_partition_evicts_by_the_loaded_times_then_by_name() -> None:
    table = loaded(2, c=100, b=50, a=100, d=300)  # given out of order
    assert table.check(batch(("e", 1)), 400).evicted == ("b", "a", "c")


def test_the_idle_purge_takes_exactly_those_seen_before_the_bound() -> None:
    table = loaded(a=100, b=200, c=300)
    assert table.purge_idle(200) == ["a"]  # b, seen at the bound itself, stays
    assert sorted(table.producers()) == ["b", "c"]


def test_forget_says_whether_the_producer_was_there() -> None:
    table = loaded(a=100)
    assert table.forget("a")
    assert not table.forget("a")
    assert table.producers() == {}


def test_the_snapshot_holds_what_was_acknowledged_and_leaves_out_the_rest() -> None:
    table = PartitionSequences.recovered(
        TOKEN, {"a": (5, 100)}, {"a": (IN_PROGRESS, 150), "b": (OTHER, 200)}
    )
    table.check(batch(("a", 7), ("c", 1)), 300)  # pushed only: a at 7, c new
    assert table.persisted_state() == RecoveredState(
        {"a": (5, 300)}, {"a": (IN_PROGRESS, 300), "b": (OTHER, 200)}
    )


# --------------------------------------------------------------------------- chunks


def meta(chunk_id: int, uuid: str = "m") -> ChunkMeta:
    return ChunkMeta(uuid, chunk_id, 4, 10)


def test_chunks_are_new_in_order_with_their_sizes_so_far_one_size_per_record() -> None:
    table = PartitionSequences(TOKEN)
    verdict = table.check(
        chunks(("a", 1, meta(0), 4), ("b", 5, None, 0), ("a", 1, meta(1), 3)), 100
    )
    assert verdict.statuses == (NEW, NEW, NEW)
    assert verdict.sizes == (4, None, 7)
    # The message in progress sits beside the complete sequence, which a has none of yet.
    in_progress = ChunkProgress(1, "m", 1, 4, 10, 7)
    assert table.producers()["a"] == ProducerState(None, None, 100, in_progress)


@pytest.mark.parametrize(
    ("chunk", "gap"),
    [(meta(3), True), (meta(2, uuid="other"), False)],
    ids=["skipping-ahead", "another-uuid"],
)
def test_a_chunk_skipping_ahead_is_a_gap_one_contradicting_its_message_is_bad(
    chunk: ChunkMeta, gap: bool
) -> None:
    table = PartitionSequences(TOKEN)
    table.check(chunks(("a", 1, meta(0), 4), ("a", 1, meta(1), 3)), 100)
    before = table.producers()
    verdict = table.check(chunks(("b", 5, None, 0), ("a", 1, chunk, 3)), 200)
    assert (verdict.bad is not None, verdict.gap, verdict.jump) == (True, gap, False)
    assert (verdict.bad_index, verdict.statuses) == (1, ())
    assert table.producers() == before
