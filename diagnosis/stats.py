"""Statistics of the diagnosis, in numpy only: a rank test, a tail-exceedance test, a change point.

- `mann_whitney_greater(current, baseline)`: one-sided Mann–Whitney U (is `current` stochastically larger?),
  normal approximation with tie and continuity corrections (exact enough at the sample sizes we accept).
- `exceedance_greater(current, baseline, q)`: do more of `current` exceed the baseline's q-quantile than of
  `baseline` itself? A one-sided two-proportion z-test: the test that fits a P99 regression, which a rank
  test on the whole distribution can miss.
- `change_point(series)`: the single split that best separates a mean shift in one or several standardised
  series (the first step of binary segmentation), with a robust noise scale.
"""

from __future__ import annotations

import math

import numpy as np

MIN_BLOCK_DF = 4  # blocks less one under which the batch-means estimate is not made


def _norm_sf(z: float) -> float:
    """P(Z > z) for a standard normal."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def _finite(x: np.ndarray | list[float]) -> np.ndarray:
    a = np.asarray(x, dtype=float)
    return a[np.isfinite(a)]


def _batch_means(sides: list[tuple[np.ndarray, np.ndarray]], block_s: float) -> tuple[float, int, float, int]:
    """(between-block sum of squares, its degrees of freedom, within sum of squares, its degrees of
    freedom) of `sides` ((values, times) each) in blocks of `block_s` seconds, each side around its own
    mean."""
    between, df, within, n = 0.0, 0, 0.0, 0
    for values, times in sides:
        v, t = np.asarray(values, dtype=float), np.asarray(times, dtype=float)
        if len(v) != len(t) or block_s <= 0:
            continue
        ok = np.isfinite(v) & np.isfinite(t)
        v, t = v[ok], t[ok]
        if len(v) < 2:
            continue
        _, idx, counts = np.unique(np.floor((t - t.min()) / block_s), return_inverse=True, return_counts=True)
        if len(counts) < 2:
            continue
        mean = v.mean()
        between += float((counts * (np.bincount(idx, weights=v) / counts - mean) ** 2).sum())
        df += len(counts) - 1
        within += float(((v - mean) ** 2).sum())
        n += len(v) - 1
    return between, df, within, n


def _inflation(between: float, df: int, within: float, n: int) -> float | None:
    if df < MIN_BLOCK_DF or within <= 0:
        return None
    return max(1.0, (between / df) / (within / n))


def variance_inflation(sides: list[tuple[np.ndarray, np.ndarray]], block_s: float) -> float:
    """By how much the variance of a side's mean exceeds the independent-samples one when nearby samples
    move together (requests of one queue see the same backlog). `sides`: (values, times) of each side;
    the batch-means estimate over blocks of `block_s` seconds, pooled over the sides around each side's
    own mean (a shift between the sides is not autocorrelation). At least 1; 1 with fewer than 4 blocks'
    worth of degrees of freedom (no estimate)."""
    return _inflation(*_batch_means(sides, block_s)) or 1.0


def null_inflation(
    current: tuple[np.ndarray, np.ndarray], baseline: tuple[np.ndarray, np.ndarray], block_s: float
) -> float:
    """`variance_inflation` as the null hypothesis has it: estimated from the baseline alone, the process
    the current side is tested against (a backlog that grows inside the current side, or a shift that
    lands a little after the split, is the effect under test, not noise: pooled with it, an overload's
    TTFT x131 read p = 0.01). From both sides pooled when the baseline spans too few blocks for an
    estimate of its own."""
    own = _inflation(*_batch_means([baseline], block_s))
    return own if own is not None else variance_inflation([current, baseline], block_s)


def mann_whitney_greater(
    current: np.ndarray | list[float],
    baseline: np.ndarray | list[float],
    times: tuple[np.ndarray, np.ndarray] | None = None,
    block_s: float = 0.0,
    from_baseline: bool = False,
) -> float:
    """One-sided p-value that `current` tends to be larger than `baseline` (1.0 when either is empty).
    With `times` (each side's sample times) and `block_s`, the variance is widened by the samples'
    autocorrelation (`variance_inflation` of each side's ranks; with `from_baseline`, `null_inflation`)."""
    x, y = _finite(current), _finite(baseline)
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        return 1.0
    both = np.concatenate([x, y])
    order = np.argsort(both, kind="mergesort")
    ranks = np.empty(len(both))
    sorted_vals = both[order]
    # average ranks over ties
    _, first, counts = np.unique(sorted_vals, return_index=True, return_counts=True)
    avg = first + (counts + 1) / 2.0
    ranks[order] = np.repeat(avg, counts)
    u1 = ranks[:n1].sum() - n1 * (n1 + 1) / 2.0
    n = n1 + n2
    tie_term = float((counts**3 - counts).sum()) / (n * (n - 1)) if n > 1 else 0.0
    var = n1 * n2 / 12.0 * ((n + 1) - tie_term)
    if var <= 0:
        return 1.0
    if times is not None and block_s > 0:
        tx, ty = _finite_times(current, times[0]), _finite_times(baseline, times[1])
        current_side, baseline_side = (ranks[:n1], tx), (ranks[n1:], ty)
        if from_baseline:
            var *= null_inflation(current_side, baseline_side, block_s)
        else:
            var *= variance_inflation([current_side, baseline_side], block_s)
    z = (u1 - n1 * n2 / 2.0 - 0.5) / math.sqrt(var)
    return _norm_sf(z)


def _finite_times(values: np.ndarray | list[float], times: np.ndarray) -> np.ndarray:
    """The times of the finite entries of `values` (all NaN when the two do not pair up)."""
    v, t = np.asarray(values, dtype=float), np.asarray(times, dtype=float)
    ok = np.isfinite(v)
    return t[ok] if len(t) == len(v) else np.full(int(ok.sum()), np.nan)


def two_proportion_greater(
    k_current: int, n_current: int, k_baseline: int, n_baseline: int, inflation: float = 1.0
) -> float:
    """One-sided p-value that the current proportion is larger (pooled z-test, its variance times
    `inflation`; 1.0 when undefined)."""
    if n_current <= 0 or n_baseline <= 0:
        return 1.0
    p1, p2 = k_current / n_current, k_baseline / n_baseline
    pooled = (k_current + k_baseline) / (n_current + n_baseline)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n_current + 1 / n_baseline) * inflation)
    if se == 0:
        return 1.0 if p1 <= p2 else 0.0
    return _norm_sf((p1 - p2) / se)


def rate_greater(k_current: float, t_current: float, k_baseline: float, t_baseline: float) -> float:
    """One-sided p-value that the current Poisson rate (k events in t seconds) is larger: the conditional
    binomial test (given all k events, the current side's share against its share of the time), by the
    normal approximation with a continuity correction; 1.0 when undefined."""
    n = k_current + k_baseline
    if n <= 0 or t_current <= 0 or t_baseline <= 0:
        return 1.0
    p = t_current / (t_current + t_baseline)
    se = math.sqrt(n * p * (1 - p))
    return _norm_sf((k_current - 0.5 - n * p) / se) if se > 0 else 1.0


def exceedance_greater(
    current: np.ndarray | list[float],
    baseline: np.ndarray | list[float],
    q: float,
    times: tuple[np.ndarray, np.ndarray] | None = None,
    block_s: float = 0.0,
) -> float:
    """One-sided p-value that more of `current` than of `baseline` lies above the baseline's q-quantile;
    with `times` and `block_s`, widened by the exceedances' autocorrelation as in `mann_whitney_greater`."""
    x, y = _finite(current), _finite(baseline)
    if len(x) == 0 or len(y) == 0:
        return 1.0
    threshold = float(np.quantile(y, q))
    ex, ey = x > threshold, y > threshold
    inflation = 1.0
    if times is not None and block_s > 0:
        tx, ty = _finite_times(current, times[0]), _finite_times(baseline, times[1])
        inflation = variance_inflation([(ex, tx), (ey, ty)], block_s)
    return two_proportion_greater(int(ex.sum()), len(x), int(ey.sum()), len(y), inflation)


def shift_statistic(x: np.ndarray, min_size: int) -> np.ndarray:
    """For each split k (left = x[:k]), the share of the series' variance that a mean shift at k explains
    (between-segment over total sum of squares, in [0, 1]); NaN where a side would be shorter than
    `min_size` or the series is constant. Non-finite points must be removed beforehand.

    A share rather than a t-like statistic, because these series are autocorrelated (load drifts over
    seconds): a clean configuration step explains nearly all of its series, drift explains little of
    its own, whatever the absolute noise level."""
    m = len(x)
    out = np.full(m, np.nan)
    total_ss = float(((x - x.mean()) ** 2).sum())
    if m < 2 * min_size or total_ss <= 0:
        return out
    csum = np.cumsum(x)
    total = csum[-1]
    k = np.arange(min_size, m - min_size + 1)
    left = csum[k - 1] / k
    right = (total - csum[k - 1]) / (m - k)
    out[k] = k * (m - k) / m * (right - left) ** 2 / total_ss
    return out


def shift_shares(raw: np.ndarray, min_size: int) -> np.ndarray | None:
    """`shift_statistic` of a series with NaN (filled with its median), or None when it has too few
    finite points or never moves."""
    x = np.asarray(raw, dtype=float)
    finite = np.isfinite(x)
    if finite.sum() < 2 * min_size:
        return None
    stat = shift_statistic(np.where(finite, x, np.median(x[finite])), min_size)
    return None if np.all(np.isnan(stat)) else stat


def change_point(series: list[np.ndarray], min_size: int, allowed: np.ndarray | None = None) -> int | None:
    """Index of the first interval after the best single split of a mean shift shared by `series` (equal
    lengths, NaN allowed: filled with the series median), or None when no split is possible. Each series
    votes with the share of its variance the split explains, so a series that steps cleanly at the onset
    (a configuration change, a collapsed hit rate) outweighs several that merely drift. `allowed` (a
    boolean mask over split indices) restricts where the split may fall."""
    total: np.ndarray | None = None
    for raw in series:
        stat = shift_shares(raw, min_size)
        if stat is None:
            continue
        total = stat if total is None else np.nansum(np.vstack([total, stat]), axis=0)
    if total is not None and allowed is not None:
        total = np.where(np.asarray(allowed, dtype=bool), total, np.nan)
    if total is None or np.all(np.isnan(total)):
        return None
    return int(np.nanargmax(total))


def quantile(x: np.ndarray | list[float], q: float) -> float:
    """The q-quantile of the finite values (NaN when none)."""
    a = _finite(x)
    return float(np.quantile(a, q)) if len(a) else math.nan


def ratio(current: float, baseline: float) -> float:
    """current / baseline; inf when the baseline is 0 and current is not; NaN when either is NaN."""
    if math.isnan(current) or math.isnan(baseline):
        return math.nan
    if baseline == 0:
        return 1.0 if current == 0 else math.inf
    return current / baseline
