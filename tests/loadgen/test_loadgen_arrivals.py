"""Arrival processes: right mean rate and dispersion, checked on generated schedules (no wall clock)."""

import numpy as np
import pytest

from loadgen.arrivals import arrival_times


def _gap_stats(t: np.ndarray) -> tuple[float, float]:
    gaps = np.diff(np.concatenate([[0.0], t]))
    return 1.0 / gaps.mean(), gaps.var() / gaps.mean() ** 2  # rate, CV^2


def test_poisson_has_the_requested_rate_and_exponential_gaps():
    t = arrival_times("poisson", 8.0, num_requests=40_000, seed=1)
    rate, cv2 = _gap_stats(t)
    assert rate == pytest.approx(8.0, rel=0.02)
    assert cv2 == pytest.approx(1.0, rel=0.05)
    # counts in 1 s windows of a Poisson process: variance equals mean
    counts = np.bincount(t[t < 4000].astype(int))
    assert counts.var() / counts.mean() == pytest.approx(1.0, rel=0.1)


def test_constant_arrivals_are_evenly_spaced():
    t = arrival_times("constant", 4.0, num_requests=5)
    assert np.allclose(t, [0.25, 0.5, 0.75, 1.0, 1.25])


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_keeps_the_mean_rate_and_has_cv2_one_over_burstiness(burstiness):
    t = arrival_times("gamma", 5.0, num_requests=60_000, burstiness=burstiness, seed=2)
    rate, cv2 = _gap_stats(t)
    assert rate == pytest.approx(5.0, rel=0.03)
    assert cv2 == pytest.approx(1.0 / burstiness, rel=0.08)


def test_duration_bounds_the_schedule_and_the_count_follows_the_rate():
    t = arrival_times("poisson", 10.0, duration_s=500.0, seed=3)
    assert t.max() < 500.0
    assert len(t) == pytest.approx(5000, rel=0.05)
    assert np.all(np.diff(t) >= 0)


def test_the_same_seed_gives_the_same_schedule_and_another_seed_does_not():
    a = arrival_times("gamma", 3.0, num_requests=100, burstiness=0.5, seed=7)
    b = arrival_times("gamma", 3.0, num_requests=100, burstiness=0.5, seed=7)
    c = arrival_times("gamma", 3.0, num_requests=100, burstiness=0.5, seed=8)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_a_rate_change_applies_from_its_second_on():
    t = arrival_times("poisson", 10.0, duration_s=400.0, seed=4, rate_changes=[(200.0, 3.0)])
    before, after = np.sum(t < 200.0), np.sum(t >= 200.0)
    assert before / 200.0 == pytest.approx(10.0, rel=0.05)
    assert after / 200.0 == pytest.approx(30.0, rel=0.05)


def test_a_constant_schedule_changes_spacing_exactly_at_the_shift():
    t = arrival_times("constant", 1.0, duration_s=10.0, rate_changes=[(5.0, 2.0)])
    assert np.allclose(t, [1, 2, 3, 4, 5, 5.5, 6, 6.5, 7, 7.5, 8, 8.5, 9, 9.5])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(process="poisson", rate=0.0, num_requests=3),
        dict(process="uniform", rate=1.0, num_requests=3),
        dict(process="gamma", rate=1.0, num_requests=3, burstiness=0.0),
        dict(process="poisson", rate=1.0),
        dict(process="poisson", rate=1.0, num_requests=3, rate_changes=[(1.0, 0.0)]),
    ],
)
def test_bad_parameters_are_refused(kwargs):
    process, rate = kwargs.pop("process"), kwargs.pop("rate")
    with pytest.raises(ValueError):
        arrival_times(process, rate, **kwargs)
