"""How the stall benchmark sorts the small producer's acknowledgements around the big
request, the figures it reports for them, and the proxy's event-loop lag around it."""

from __future__ import annotations

import pytest

from benchmarks.stall import (
    LOOP_LAG_BUCKET,
    big_records,
    latency_figures,
    loop_lag_bound_ms,
    proxy_limits,
    split_samples,
)

pytestmark = pytest.mark.unit

BIG_START, BIG_END = 10.0, 12.0


def test_calm_is_acknowledged_before_the_big_request_and_after_the_settling_time() -> None:
    samples = [(0.1, 0.2), (1.0, 1.001), (9.9, 9.95), (9.99, 10.2)]
    calm, _ = split_samples(samples, 0.5, BIG_START, BIG_END)
    assert calm == [(1.0, 1.001), (9.9, 9.95)]


def test_during_is_any_record_in_flight_while_the_big_request_was() -> None:
    samples = [(9.9, 9.95), (9.99, 10.2), (11.0, 11.5), (11.9, 12.5), (12.1, 12.2)]
    _, during = split_samples(samples, 0.0, BIG_START, BIG_END)
    assert during == [(9.99, 10.2), (11.0, 11.5), (11.9, 12.5)]


def test_figures_in_milliseconds() -> None:
    samples = [(0.0, 0.001 * n) for n in range(1, 101)]
    count, p50, p99, top = latency_figures(samples)
    assert count == 100
    assert p50 == pytest.approx(50.0)
    assert p99 == pytest.approx(99.0)
    assert top == pytest.approx(100.0)
    assert latency_figures([]) == (0, None, None, None)


LAG_BOUNDS = ("0.001", "0.002", "0.005", "0.01", "+Inf")


def lag_scrape(*counts: float) -> dict[str, float]:
    return {
        f'{LOOP_LAG_BUCKET}{bound}"}}': count
        for bound, count in zip(LAG_BOUNDS, counts, strict=True)
    }


def test_the_loop_lag_is_the_smallest_bucket_holding_every_new_lag() -> None:
    before = lag_scrape(1, 1, 1, 1, 1)
    assert loop_lag_bound_ms(before, lag_scrape(5, 8, 9, 9, 9)) == 5.0
    assert loop_lag_bound_ms(before, lag_scrape(4, 4, 4, 4, 4)) == 1.0


def test_no_new_lag_is_none_and_one_past_every_bound_is_infinite() -> None:
    before = lag_scrape(1, 1, 1, 1, 1)
    assert loop_lag_bound_ms(before, before) is None
    assert loop_lag_bound_ms(before, lag_scrape(1, 1, 1, 1, 2)) == float("inf")
    assert loop_lag_bound_ms({}, {}) is None


def test_a_big_request_above_the_proxys_default_limits_gets_them_raised() -> None:
    assert proxy_limits(32) == {}  # 32,000 records of 1000 B: within the defaults
    raised = proxy_limits(95)
    assert int(raised["DEDUP_PROXY_MAX_BATCH_RECORDS"]) >= big_records(95) == 95_000
    assert int(raised["DEDUP_PROXY_MAX_BATCH_DECOMPRESSED_BYTES"]) > 95 * 1_000_000
