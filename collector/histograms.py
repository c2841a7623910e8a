"""Percentiles from scraped Prometheus histograms (engine_samples `<name>_bucket` rows), as Prometheus's
`histogram_quantile` computes them: the increase of each cumulative bucket over a window, then linear
interpolation inside the bucket that holds the rank.

    rows = reader.query(histograms.BUCKET_INCREASES, histograms.params("ttft_s", t0, t1)).rows
    histogram_quantile(0.99, [(float(le), n) for le, n in rows])

A percentile from buckets is an estimate (exact only at bucket bounds); results carry `source: "metrics"`
wherever they are shown, so nobody mistakes them for percentiles of request spans.
"""

from __future__ import annotations

import math
from typing import Any

HISTOGRAMS = ("ttft_s", "itl_s", "e2e_s", "queue_s", "prefill_s", "decode_s")
LOOKBACK_S = 300  # the sample before the window a counter's increase starts from is at most this old

# The increase of every bucket series over [t0, t1), summed per bound. A series' increase between two
# scrapes is the difference of its values, or its value after a reset (the counter went down). The
# first sample of each series in the lookback only anchors the next one.
BUCKET_INCREASES = """
SELECT le, sum(increase) AS count
FROM (
    SELECT time, labels['le'] AS le,
           row_number() OVER w AS n,
           if(value < lagInFrame(value) OVER w, value, value - lagInFrame(value) OVER w) AS increase
    FROM engine_samples
    WHERE metric = {bucket_metric:String}
      AND time >= fromUnixTimestamp64Nano({lookback_ns:Int64}) AND time < fromUnixTimestamp64Nano({t1:Int64})
      AND ({instance:String} = '' OR instance = {instance:String})
      AND ({service:String} = '' OR service = {service:String})
    WINDOW w AS (PARTITION BY service, instance, toString(labels) ORDER BY time
                 ROWS BETWEEN 1 PRECEDING AND CURRENT ROW)
)
WHERE n > 1 AND time >= fromUnixTimestamp64Nano({t0:Int64})
GROUP BY le
"""


def params(metric: str, t0: float, t1: float, *, service: str = "", instance: str = "") -> dict[str, Any]:
    """Query parameters of BUCKET_INCREASES for histogram `metric` (a stepscope name) over [t0, t1)."""
    if metric not in HISTOGRAMS:
        raise ValueError(f"unknown histogram {metric!r}: choose from {', '.join(HISTOGRAMS)}")
    return {
        "bucket_metric": metric + "_bucket",
        "lookback_ns": int((t0 - LOOKBACK_S) * 1e9),
        "t0": int(t0 * 1e9),
        "t1": int(t1 * 1e9),
        "service": service,
        "instance": instance,
    }


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """The `q` quantile (0..1) of cumulative buckets [(upper bound, count)], +Inf included, as Prometheus
    computes it: NaN without observations; the largest finite bound when the rank falls in +Inf."""
    if not 0 <= q <= 1:
        raise ValueError(f"quantile {q} is not in [0, 1]")
    points = sorted((float(le), float(n)) for le, n in buckets)
    if not points or points[-1][0] != math.inf:
        return math.nan
    counts = [n for _, n in points]
    for i in range(1, len(counts)):  # cumulative counts never fall; scrapes of a moving histogram may
        counts[i] = max(counts[i], counts[i - 1])
    total = counts[-1]
    if total <= 0:
        return math.nan
    rank = q * total
    i = next(i for i, n in enumerate(counts) if n >= rank)
    if i == len(points) - 1:
        return points[-2][0] if len(points) > 1 else math.nan
    upper, n_upper = points[i][0], counts[i]
    lower, n_lower = (points[i - 1][0], counts[i - 1]) if i > 0 else (min(0.0, upper), 0.0)
    if n_upper == n_lower:
        return upper
    return lower + (upper - lower) * (rank - n_lower) / (n_upper - n_lower)


def percentiles(
    reader: Any, metric: str, t0: float, t1: float, qs: tuple[float, ...] = (0.5, 0.99), **filters: str
) -> dict[str, float]:
    """{"p50": ..., "p99": ..., "count": observations} of histogram `metric` over [t0, t1), from the
    store through `reader` (anything with `query(sql, params)`)."""
    rows = reader.query(BUCKET_INCREASES, params(metric, t0, t1, **filters)).rows
    buckets = [(float(le), float(n)) for le, n in rows if le]
    out = {f"p{round(q * 100):d}": histogram_quantile(q, buckets) for q in qs}
    out["count"] = max((n for le, n in buckets if le == math.inf), default=0.0)
    return out
