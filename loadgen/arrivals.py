"""Arrival processes: seeded schedules of request send times, in seconds from the start of a run.

Three processes, all with mean rate `rate` requests per second:

- `constant`: one request every `1/rate` seconds.
- `poisson`: exponential gaps (coefficient of variation 1).
- `gamma`: gamma gaps with shape `burstiness` and scale `1/(rate*burstiness)`, exactly as vLLM's
  `benchmark_serving.py` defines it. The mean gap stays `1/rate`; the squared coefficient of variation
  of the gaps is `1/burstiness`. `burstiness=1` is Poisson, below 1 is burstier, above 1 is smoother.

A rate that changes during the run (a `rate_factor` from some second on) is applied by a time change:
gaps are drawn for a unit-rate process in "operational time" and mapped back through the inverse of the
cumulative rate. For Poisson that is exact (a non-homogeneous Poisson process); for the others it keeps
the shape of the gaps and scales them by the rate in force.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ARRIVALS = ("poisson", "constant", "gamma")


def unit_gaps(process: str, n: int, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """`n` gaps with mean 1 for the named process."""
    if process == "constant":
        return np.ones(n)
    if process == "poisson":
        return rng.exponential(1.0, n)
    if process == "gamma":
        if burstiness <= 0:
            raise ValueError(f"burstiness must be > 0, got {burstiness}")
        return rng.gamma(shape=burstiness, scale=1.0 / burstiness, size=n)
    raise ValueError(f"unknown arrival process {process!r}; choose one of {', '.join(ARRIVALS)}")


def _cumulative_rate(
    rate: float, changes: Sequence[tuple[float, float]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Breakpoints (seconds, operational time) and slopes of the piecewise-linear cumulative rate Λ(t)."""
    knots_t = [0.0]
    rates = [rate]
    for start_s, factor in sorted(changes):
        if start_s <= 0:
            rates[0] = rate * factor
            continue
        knots_t.append(start_s)
        rates.append(rate * factor)
    knots_u = [0.0]
    for i in range(1, len(knots_t)):
        knots_u.append(knots_u[-1] + rates[i - 1] * (knots_t[i] - knots_t[i - 1]))
    return np.array(knots_t), np.array(knots_u), np.array(rates)


def _invert(u: np.ndarray, knots_t: np.ndarray, knots_u: np.ndarray, rates: np.ndarray) -> np.ndarray:
    """t = Λ^-1(u) for the piecewise-linear Λ with the given breakpoints and slopes."""
    seg = np.searchsorted(knots_u, u, side="right") - 1
    return knots_t[seg] + (u - knots_u[seg]) / rates[seg]


def arrival_times(
    process: str,
    rate: float,
    *,
    num_requests: int | None = None,
    duration_s: float | None = None,
    burstiness: float = 1.0,
    seed: int = 0,
    rate_changes: Sequence[tuple[float, float]] = (),
) -> np.ndarray:
    """Sorted send offsets in seconds (the first one gap after 0), up to `num_requests` or `duration_s`.

    `rate_changes` is a list of `(start_s, factor)`: from `start_s` on the rate is `rate * factor`
    (the latest start in force wins; factors do not compound).
    """
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if num_requests is None and duration_s is None:
        raise ValueError("give num_requests or duration_s")
    if any(f <= 0 for _, f in rate_changes):
        raise ValueError("rate factors must be > 0")
    rng = np.random.default_rng(seed)
    knots_t, knots_u, rates = _cumulative_rate(rate, rate_changes)
    chunk = num_requests if num_requests is not None else int(rate * max(rates) * duration_s * 1.5) + 16
    u = np.cumsum(unit_gaps(process, chunk, burstiness, rng))
    t = _invert(u, knots_t, knots_u, rates)
    while duration_s is not None and num_requests is None and t[-1] < duration_s:
        more = u[-1] + np.cumsum(unit_gaps(process, chunk, burstiness, rng))
        u = np.concatenate([u, more])
        t = _invert(u, knots_t, knots_u, rates)
    if duration_s is not None:
        t = t[t < duration_s]
    return t
