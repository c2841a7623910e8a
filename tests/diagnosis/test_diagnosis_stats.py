"""The statistics, time parsing and SQL literal rendering, on hand-made inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from collector.timerange import TimeRange, parse_time
from diagnosis import queries, stats
from diagnosis.config import DiagnosisConfig


def test_mann_whitney_matches_the_textbook_example() -> None:
    # U for x over y = 1 + 2 + ... computed by hand: x = [3, 4, 5], y = [1, 2] -> U = 6 (all pairs), z > 0
    assert stats.mann_whitney_greater([3, 4, 5], [1, 2]) < 0.1
    assert stats.mann_whitney_greater([1, 2], [3, 4, 5]) > 0.9


def test_mann_whitney_is_uniform_ish_on_identical_distributions() -> None:
    rng = np.random.default_rng(0)
    ps = [stats.mann_whitney_greater(rng.lognormal(size=200), rng.lognormal(size=200)) for _ in range(200)]
    assert 0.35 < float(np.mean(ps)) < 0.65
    assert sum(p < 0.01 for p in ps) <= 6


def test_mann_whitney_sees_a_shift_and_handles_ties() -> None:
    rng = np.random.default_rng(1)
    assert stats.mann_whitney_greater(rng.normal(0.3, 1, 500), rng.normal(0, 1, 500)) < 1e-4
    assert stats.mann_whitney_greater([1, 1, 1, 1], [1, 1, 1, 1]) == 1.0
    assert stats.mann_whitney_greater([], [1.0]) == 1.0


def test_exceedance_test_sees_a_fatter_tail_the_median_hides() -> None:
    rng = np.random.default_rng(2)
    base = rng.lognormal(0, 0.3, 2000)
    tail = base.copy()
    tail[:100] *= 4  # 5% of requests four times slower: median unchanged, P99 up
    assert abs(np.median(tail) / np.median(base) - 1) < 0.05
    assert stats.exceedance_greater(tail, base, 0.99) < 1e-6
    assert stats.exceedance_greater(rng.lognormal(0, 0.3, 2000), base, 0.99) > 0.001


def _backlog(
    rng: np.random.Generator, seconds: float, rate: float, level: float
) -> tuple[np.ndarray, np.ndarray]:
    """Request arrival times and TTFTs of a queue whose backlog wanders over seconds (an AR(1) level
    sampled every 0.1 s): neighbouring requests wait alike, as in a saturated engine."""
    times = np.sort(rng.uniform(0, seconds, int(rate * seconds)))
    steps = int(seconds * 10) + 1
    wander = np.zeros(steps)
    for k in range(1, steps):
        wander[k] = 0.97 * wander[k - 1] + rng.normal(0, 0.25)
    return times, level * np.exp(0.3 * wander[(times * 10).astype(int)]) * rng.lognormal(0, 0.2, len(times))


def test_a_wandering_backlog_is_not_a_regression_but_a_shift_still_is() -> None:
    rng = np.random.default_rng(5)
    alpha, block = DiagnosisConfig().alpha, DiagnosisConfig().sample_block_s
    naive = corrected = from_baseline = 0
    for _ in range(40):
        tb, xb = _backlog(rng, 40, 4.5, 1.0)
        tc, xc = _backlog(rng, 40, 4.5, 1.0)
        naive += stats.mann_whitney_greater(xc, xb) < alpha
        corrected += stats.mann_whitney_greater(xc, xb, (tc + 40, tb), block) < alpha
        from_baseline += stats.mann_whitney_greater(xc, xb, (tc + 40, tb), block, from_baseline=True) < alpha
    # Requests of one backlog are not independent: the plain rank test calls chance wander significant
    # in many of these healthy pairs, the autocorrelation-aware one rarely (the inflation estimated from
    # the baseline alone, on fewer blocks, a little more often).
    assert naive >= 5
    assert corrected <= 1
    assert from_baseline <= 2
    tb, xb = _backlog(rng, 40, 4.5, 1.0)
    tc, xc = _backlog(rng, 40, 4.5, 2.0)
    assert stats.mann_whitney_greater(xc, xb, (tc + 40, tb), block) < alpha
    # The same for the tail test, and independent samples keep their power (no inflation).
    assert stats.variance_inflation([(rng.normal(size=400), rng.uniform(0, 40, 400))], block) < 1.6
    assert stats.variance_inflation([(xb, tb), (xc, tc)], block) > 2


def test_the_null_inflation_comes_from_the_baseline_so_a_growing_backlog_is_the_effect() -> None:
    rng = np.random.default_rng(2)
    tb, xb = np.sort(rng.uniform(0, 40, 60)), rng.lognormal(0, 0.3, 60)
    tc = np.sort(rng.uniform(40, 80, 60))
    xc = rng.lognormal(0, 0.3, 60) * np.exp((tc - 40) / 10)  # a queue that grows through the window
    block = DiagnosisConfig().sample_block_s
    # Pooled, the growth inside the current side reads as autocorrelation and widens the test 5-fold;
    # the baseline, independent requests, has none to widen it by.
    assert stats.variance_inflation([(xc, tc), (xb, tb)], block) > 4
    assert stats.null_inflation((xc, tc), (xb, tb), block) < 1.6
    pooled = stats.mann_whitney_greater(xc, xb, (tc, tb), block)
    null = stats.mann_whitney_greater(xc, xb, (tc, tb), block, from_baseline=True)
    assert null < 1e-10 and pooled > 1e-6
    # A baseline of three blocks makes no estimate of its own: both sides pooled.
    short = tb < 15
    both = stats.variance_inflation([(xc, tc), (xb[short], tb[short])], block)
    assert stats.null_inflation((xc, tc), (xb[short], tb[short]), block) == both > 4


def test_change_point_finds_a_step_among_drifting_series() -> None:
    rng = np.random.default_rng(3)
    drift = np.cumsum(rng.normal(0, 0.1, 120))
    noise = rng.normal(0, 1, 120)
    step = np.r_[np.zeros(70), np.ones(50)] + rng.normal(0, 0.1, 120)
    assert abs(stats.change_point([drift, noise, step], 20) - 70) <= 2
    assert stats.change_point([np.ones(120)], 20) is None
    assert stats.change_point([np.ones(10)], 20) is None


def test_change_point_keeps_to_the_allowed_splits() -> None:
    rng = np.random.default_rng(4)
    late = np.r_[np.zeros(100), np.ones(20)] + rng.normal(0, 0.05, 120)  # the sharpest change, near the end
    mid = np.r_[np.zeros(60), np.ones(60)] + rng.normal(0, 0.5, 120)  # a real shift, noisier
    allowed = np.zeros(120, bool)
    allowed[40:81] = True
    assert abs(stats.change_point([late, mid], 10) - 100) <= 2
    assert abs(stats.change_point([late, mid], 10, allowed) - 60) <= 3
    assert stats.change_point([late, mid], 10, np.zeros(120, bool)) is None


def test_testable_splits_leave_enough_requests_on_both_sides() -> None:
    from diagnosis.pipeline import testable_splits

    cfg = DiagnosisConfig()
    ok = testable_splits(np.r_[np.ones(100), np.full(20, np.nan)], cfg)  # 100 requests, none at the end
    assert ok is not None and np.flatnonzero(ok).tolist() == [50]  # 50 (the P99 minimum) each side
    ok = testable_splits(np.ones(80), cfg)  # too few for P99 tests: the medians' 30 a side
    assert ok is not None and np.flatnonzero(ok)[[0, -1]].tolist() == [30, 50]
    assert testable_splits(np.ones(40), cfg) is None  # too few for any test: the split is free


def test_the_window_splits_where_a_setting_changed_not_where_the_symptoms_drift_most() -> None:
    """Chunked prefill switched off at interval 40 of 80; the symptoms (and a dozen series that drift with
    them) move most from interval 50 as the backlog builds. The split is the setting's step, so the first
    affected requests are not counted in the baseline; with no setting moving, the symptoms decide."""
    from diagnosis.facts import Series
    from diagnosis.pipeline import split_window

    rng = np.random.default_rng(5)
    n, cfg = 80, DiagnosisConfig()
    symptoms = ("ttft_p90", "tpot_p90", "itl_max_p90", "e2e_mean", "queue_mean", "step_mean", "bytes_mean")
    rise = np.r_[np.zeros(50), np.full(30, 0.4)]
    drifting = {name: np.exp(rise + rng.normal(0, 0.15, n)) for name in symptoms}
    for name in ("kv_usage", "batch_mean"):
        drifting[name] = np.r_[np.zeros(50), np.ones(30)] + rng.normal(0, 0.8, n)
    chunked = np.r_[np.ones(40), np.zeros(40)]
    columns = drifting | {"requests": np.full(n, 4.0), "chunked_share": chunked}
    window = TimeRange(1000.0, 1000.0 + n)
    assert split_window(Series(1000.0, 1.0, columns), window, cfg) == 40
    steady = columns | {"chunked_share": np.ones(n)}
    assert abs(split_window(Series(1000.0, 1.0, steady), window, cfg) - 50) <= 2


def test_render_writes_typed_literals_and_refuses_the_rest() -> None:
    sql = "SELECT {a:Int64}, {b:Float64}, {s:String}"
    assert queries.render(sql, {"a": 5, "b": 0.5, "s": "it's\\"}) == "SELECT 5, 0.5, 'it\\'s\\\\'"
    for bad in (
        {"a": "5 OR 1", "b": 1.0, "s": ""},
        {"a": 1, "b": math.nan, "s": ""},
        {"a": 1, "b": 1.0, "s": 3},
    ):
        with pytest.raises(ValueError):
            queries.render(sql, bad)
    with pytest.raises(ValueError, match="no value"):
        queries.render(sql, {"a": 1})
    with pytest.raises(ValueError, match="type"):
        queries.render("{d:DateTime}", {"d": 1})


def test_times_parse_as_iso_unix_or_ago() -> None:
    assert parse_time("1700000000") == 1_700_000_000.0
    assert parse_time("2023-11-14T22:13:20Z") == 1_700_000_000.0
    assert parse_time("2023-11-14T22:13:20") == 1_700_000_000.0  # no zone: UTC
    assert parse_time("15m", now=1000.0) == 100.0
    assert parse_time("2h", now=10_000.0) == 2800.0
    assert parse_time("90s", now=100.0) == 10.0
    for bad in ("yesterday", "", "15 parsecs", "-5m"):
        with pytest.raises(ValueError):
            parse_time(bad)
    with pytest.raises(ValueError):
        TimeRange(10, 5)


def test_config_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        DiagnosisConfig(alpha=2)
    with pytest.raises(ValueError):
        DiagnosisConfig(min_ratio_p99=0.9)


def test_arrival_counts_within_poisson_noise_are_not_a_rise_but_a_doubling_is():
    # 61 then 80 arrivals in two 50 s halves at one open-loop rate: x1.31, within the noise of ~70 a side
    assert stats.rate_greater(80, 50.0, 61, 50.0) > 0.01
    assert stats.rate_greater(140, 50.0, 70, 50.0) < 1e-4  # twice the rate
    assert stats.rate_greater(80, 25.0, 80, 50.0) < 1e-4  # as many in half the time
    assert stats.rate_greater(0, 50.0, 0, 50.0) == 1.0
