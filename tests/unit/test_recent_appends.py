"""The offsets kept to answer a re-sent batch as Kafka does (`dedup.recent_appends`)."""

from prometheus_client import REGISTRY

from dedup.recent_appends import BATCHES_PER_PRODUCER, Append, RecentAppends

P0, P1 = ("orders", 0), ("orders", 1)
HELD = "inst-0.1"  # the recovery token of this hold of the partitions


def kept_gauge() -> float | None:
    return REGISTRY.get_sample_value("dedup_recent_append_producers")


def append(first: int, count: int = 1, token: str = HELD) -> Append:
    return Append(first, count, base_offset=100 + first, log_append_time_ms=-1, token=token)


def apart(first: int, count: int = 1) -> Append:
    """An append with other records before it in the log: it continues no earlier one."""
    return Append(first, count, base_offset=100 + 10 * first, log_append_time_ms=-1, token=HELD)


def test_a_batch_is_found_within_one_of_the_latest_five_runs() -> None:
    recent = RecentAppends(10)
    for first in range(0, 2 * (BATCHES_PER_PRODUCER + 1), 2):
        recent.record(P0, "p", apart(first, 2))
    assert recent.find(P0, "p", 0, 2, HELD) is None, "older than the producer's latest 5"
    assert recent.find(P0, "p", 2, 2, HELD) == apart(2, 2)
    # A part of one: its sequences are at consecutive offsets from the append's.
    assert recent.find(P0, "p", 3, 1, HELD) == Append(3, 1, 121, -1, HELD)
    assert recent.find(P0, "p", 3, 2, HELD) is None, "across two with records between"
    assert recent.find(P0, "p", 10, 3, HELD) is None, "beyond the last"
    assert recent.find(P1, "p", 2, 2, HELD) is None and recent.find(P0, "q", 2, 2, HELD) is None


def test_appends_that_follow_each_other_in_the_log_are_one_run() -> None:
    """A producer nothing else writes between: its batches are one run of sequences at
    consecutive offsets, found however many batches back (a blind re-send after its
    restart), until 5 runs more come after it."""
    recent = RecentAppends(10)
    for first in range(0, 200, 2):  # 100 batches at offsets 100-299
        recent.record(P0, "p", append(first, 2))
    assert recent.find(P0, "p", 0, 2, HELD) == append(0, 2), "the first of 100 batches"
    assert recent.find(P0, "p", 1, 198, HELD) == append(1, 198)
    assert recent.find(P0, "p", 199, 2, HELD) is None, "beyond the last"
    # Another log append time: Kafka appended it apart, so not one batch's time.
    recent.record(P0, "p", Append(200, 1, 300, log_append_time_ms=7, token=HELD))
    assert recent.find(P0, "p", 199, 2, HELD) is None
    for first in range(201, 204):  # three runs more, each after other records
        recent.record(P0, "p", apart(first))
    assert recent.find(P0, "p", 0, 2, HELD) == append(0, 2), "the run is one of the latest 5"
    recent.record(P0, "p", apart(204))
    assert recent.find(P0, "p", 0, 2, HELD) is None, "older than the latest 5 runs"


def test_sequences_written_again_are_found_only_where_they_were_written_last() -> None:
    """A producer whose state was purged (idle) starts its sequences again: its new writes
    are the originals of a re-send now, and what it wrote before says nothing of them."""
    recent = RecentAppends(10)
    recent.record(P0, "p", Append(0, 2, base_offset=10, log_append_time_ms=-1, token=HELD))
    recent.record(P0, "p", Append(0, 3, base_offset=50, log_append_time_ms=-1, token=HELD))
    again = recent.find(P0, "p", 0, 2, HELD)
    assert again is not None and again.base_offset == 50, "sequences 0 and 1 are at 50 now"
    found = recent.find(P0, "p", 0, 3, HELD)
    assert found is not None and found.base_offset == 50
    recent.record(P0, "p", Append(3, 1, base_offset=53, log_append_time_ms=-1, token=HELD))
    assert recent.find(P0, "p", 0, 3, HELD) == found, "a write above the last keeps the others"


def test_an_append_is_found_only_under_the_hold_it_was_written_in() -> None:
    """The partition changed hands (a new lease, a new token) or its topic was created
    again: another may have written the producer's sequences since."""
    recent = RecentAppends(10)
    recent.record(P0, "p", append(0, 2))
    assert recent.find(P0, "p", 0, 2, "inst-0.2") is None
    recent.record(P0, "p", append(2, 2, token="inst-0.2"))
    assert recent.find(P0, "p", 2, 2, "inst-0.2") == append(2, 2, token="inst-0.2")
    assert recent.find(P0, "p", 0, 2, HELD) is None, "a hold's appends go with the next's"


def test_the_least_recently_written_producer_goes_first() -> None:
    recent = RecentAppends(2)
    recent.record(P0, "p", append(0))
    recent.record(P0, "q", append(0))
    recent.record(P0, "p", append(1))  # p written again: q is now the oldest
    recent.record(P1, "p", append(0))
    assert len(recent) == kept_gauge() == 2
    assert recent.find(P0, "q", 0, 1, HELD) is None
    assert recent.find(P0, "p", 0, 1, HELD) == append(0) and recent.find(
        P1, "p", 0, 1, HELD
    ) == append(0)


def test_a_partition_forgotten_keeps_nothing_and_the_others_stay() -> None:
    recent = RecentAppends(10)
    for producer in ("p", "q"):
        recent.record(P0, producer, append(0))
    recent.record(P1, "p", append(0))
    recent.forget(P0)
    recent.forget(("gone", 0))  # never written: nothing to do
    assert len(recent) == kept_gauge() == 1
    assert recent.find(P0, "p", 0, 1, HELD) is None
    assert recent.find(P1, "p", 0, 1, HELD) == append(0)
    recent.record(P0, "p", append(3))  # written again after all
    assert recent.find(P0, "p", 3, 1, HELD) == append(3)


def test_none_kept_when_the_bound_is_zero() -> None:
    recent = RecentAppends(0)
    recent.record(P0, "p", append(0))
    assert len(recent) == 0 and recent.find(P0, "p", 0, 1, HELD) is None


def test_a_recoverys_runs_are_kept_under_its_token_and_replace_the_earlier_holds() -> None:
    """What the recovery read in the log's tail: each producer's latest run, its first
    sequence at its first offset. The appends of the hold before go; later writes join."""
    recent = RecentAppends(10)
    recent.record(P0, "p", append(0, 2))
    taken_again = "inst-0.2"
    recent.seed(
        P0, {"p": [(0, 30, 470, 1200), (30, 10, 530, 1234)], "q": [(7, 1, 540, 1234)]}, taken_again
    )
    assert recent.find(P0, "p", 0, 2, HELD) is None, "the earlier hold's appends are gone"
    assert recent.find(P0, "p", 38, 2, taken_again) == Append(38, 2, 538, 1234, taken_again)
    assert recent.find(P0, "p", 2, 3, taken_again) == Append(2, 3, 472, 1200, taken_again)
    assert recent.find(P0, "q", 7, 1, taken_again) == Append(7, 1, 540, 1234, taken_again)
    assert recent.find(P0, "p", 39, 2, taken_again) is None, "past the run"
    assert recent.find(P0, "p", 29, 2, taken_again) is None, "across two runs"
    recent.record(P0, "p", Append(40, 3, 541, 1300, taken_again))
    assert recent.find(P0, "p", 0, 30, taken_again) == Append(0, 30, 470, 1200, taken_again)
    assert recent.find(P0, "p", 41, 1, taken_again) == Append(41, 1, 542, 1300, taken_again)


def test_a_recovery_seeds_the_newest_runs_last_so_the_bound_keeps_them() -> None:
    recent = RecentAppends(2)
    recent.seed(
        P0,
        {"new": [(0, 1, 90, -1)], "old": [(0, 1, 10, -1)], "mid": [(0, 1, 5, -1), (1, 1, 50, -1)]},
        HELD,
    )
    assert len(recent) == 2
    assert recent.find(P0, "old", 0, 1, HELD) is None
    assert recent.find(P0, "mid", 0, 1, HELD) is not None, "by its latest run, at 50"
    assert recent.find(P0, "new", 0, 1, HELD) is not None


def test_a_snapshot_takes_the_appends_of_its_hold_below_its_offset() -> None:
    recent = RecentAppends(10)
    recent.record(P0, "p", apart(0, 2))  # offsets 100, 101
    recent.record(P0, "p", apart(2, 3))  # 120..122
    recent.record(P0, "q", append(0, 1, token="inst-1.1"))  # an earlier hold's
    recent.record(P1, "p", append(0, 1))
    assert recent.latest(P0, HELD, 123) == {"p": (apart(0, 2), apart(2, 3))}
    assert recent.latest(P0, HELD, 122) == {"p": (apart(0, 2), Append(2, 2, 120, -1, HELD))}, (
        "of a run that goes on past the offset, the part below"
    )
    assert recent.latest(P0, HELD, 120) == {"p": (apart(0, 2),)}
    assert recent.latest(P0, HELD, 100) == {}
    assert recent.latest(("other", 0), HELD, 1000) == {}


def test_sequences_across_appends_are_found_only_where_the_log_runs_on() -> None:
    recent = RecentAppends(10)
    recent.record(P0, "p", Append(0, 2, base_offset=10, log_append_time_ms=-1, token=HELD))
    recent.record(P0, "p", Append(2, 2, base_offset=12, log_append_time_ms=-1, token=HELD))
    recent.record(P0, "p", Append(4, 2, base_offset=20, log_append_time_ms=-1, token=HELD))
    recent.record(P0, "p", Append(6, 2, base_offset=22, log_append_time_ms=5, token=HELD))
    assert recent.find(P0, "p", 1, 3, HELD) == Append(1, 3, 11, -1, HELD)
    assert recent.find(P0, "p", 0, 4, HELD) == Append(0, 4, 10, -1, HELD)
    assert recent.find(P0, "p", 3, 2, HELD) is None, "another producer's records between"
    assert recent.find(P0, "p", 5, 2, HELD) is None, "another log append time: not one batch's"
    assert recent.find(P0, "p", 7, 2, HELD) is None, "beyond the last"
