"""The SQL functions every query shares: one percentile and one time bucket.

The diagnosis, the alerts, the dashboard and the query API all compute percentiles with `quantileExact`
(an element of the data, never an approximation), so the P99 an alert fires on is the P99 the diagnosis
and the dashboard report for the same window. Use them in f-strings:

    f"SELECT {QUANTILE}(0.99)(ttft_s), {bucket()} AS t FROM requests ... GROUP BY t"
"""

from __future__ import annotations

QUANTILE = "quantileExact"  # QUANTILE(level)(expr)
QUANTILE_IF = "quantileExactIf"  # QUANTILE_IF(level)(expr, condition)
QUANTILES = "quantilesExact"  # QUANTILES(level, level, ...)(expr) -> an array


def bucket(column: str = "time", width: str = "interval_s") -> str:
    """The start of `column`'s bucket, `width` naming a UInt32 query parameter in seconds."""
    return f"toStartOfInterval({column}, toIntervalSecond({{{width}:UInt32}}))"
