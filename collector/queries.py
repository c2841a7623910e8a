"""The query API's SQL, in one place. Text is constant; every value from a request is a server-side
parameter (`{name:Type}`), and filters are chosen from a fixed table, never spelled by the caller."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from collector.sqlfn import QUANTILES, bucket

# filter name -> (SQL condition, parameter type). Only these can appear in a WHERE clause.
REQUEST_FILTERS: dict[str, tuple[str, str]] = {
    "since": ("time >= fromUnixTimestamp64Nano(toInt64({since:Float64} * 1e9))", "Float64"),
    "until": ("time < fromUnixTimestamp64Nano(toInt64({until:Float64} * 1e9))", "Float64"),
    "service": ("service = {service:String}", "String"),
    "instance": ("instance = {instance:String}", "String"),
    "role": ("role = {role:String}", "String"),
    "model": ("model = {model:String}", "String"),
    "trace_id": ("trace_id = lower({trace_id:String})", "String"),
    "finish_reason": ("finish_reason = {finish_reason:String}", "String"),
    "min_ttft_s": ("ttft_s >= {min_ttft_s:Float64}", "Float64"),
    "min_e2e_s": ("e2e_s >= {min_e2e_s:Float64}", "Float64"),
    "is_error": ("is_error = {is_error:UInt8}", "UInt8"),
}
STEP_FILTERS: dict[str, tuple[str, str]] = {
    key: REQUEST_FILTERS[key]
    for key in ("since", "until", "service", "instance", "role", "model", "trace_id")
} | {"min_batch_size": ("batch_size >= {min_batch_size:UInt32}", "UInt32")}

REQUEST_COLUMNS = (
    "time, end_time, trace_id, span_id, service, instance, role, model, request_id, ttft_s, tpot_s, "
    "tpot_max_s, e2e_s, queue_s, prefill_s, kv_transfer_s, decode_s, input_tokens, output_tokens, "
    "cached_tokens, max_tokens, prefix_key, finish_reason, preemptions, itl_count, is_error, status_message"
)
LATENCY_METRICS = ("ttft_s", "tpot_s", "e2e_s", "queue_s", "prefill_s", "decode_s", "kv_transfer_s")

TRACE_BOUNDS = (
    "SELECT min(Start), max(End), count() FROM otel_traces_trace_id_ts "
    "WHERE TraceId = lower({trace_id:String})"
)
TRACE_SPANS = """
SELECT Timestamp, Duration, TraceId, SpanId, ParentSpanId, SpanName, SpanKind, ServiceName, StatusCode,
       StatusMessage, ResourceAttributes, ScopeName, SpanAttributes, Events.Timestamp, Events.Name,
       Events.Attributes, Links.TraceId, Links.SpanId, Links.Attributes
FROM otel_traces
WHERE TraceId = lower({trace_id:String})
  AND Timestamp >= toDateTime64({start:DateTime}, 9) - INTERVAL 5 MINUTE
  AND Timestamp <= toDateTime64({end:DateTime}, 9) + INTERVAL 5 MINUTE
ORDER BY Timestamp
LIMIT {limit:UInt32}
"""


@dataclass(frozen=True, slots=True)
class Sql:
    """A query and its parameters, ready for `Store.query`."""

    text: str
    parameters: dict[str, Any]


def _where(filters: dict[str, tuple[str, str]], values: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    conditions, params = [], {}
    for name, value in values.items():
        if value is None:
            continue
        if name not in filters:
            raise KeyError(name)
        conditions.append(filters[name][0])
        params[name] = value
    return (" WHERE " + " AND ".join(conditions) if conditions else ""), params


def recent_requests(filters: dict[str, Any], limit: int) -> Sql:
    """The newest `limit` requests matching `filters` (names from REQUEST_FILTERS), newest first."""
    where, params = _where(REQUEST_FILTERS, filters)
    params["limit"] = limit
    return Sql(
        f"SELECT {REQUEST_COLUMNS} FROM requests{where} ORDER BY time DESC LIMIT {{limit:UInt32}}", params
    )


def recent_steps(filters: dict[str, Any], limit: int) -> Sql:
    """The newest `limit` engine steps matching `filters` (names from STEP_FILTERS), newest first."""
    where, params = _where(STEP_FILTERS, filters)
    params["limit"] = limit
    return Sql(f"SELECT * FROM steps{where} ORDER BY time DESC LIMIT {{limit:UInt32}}", params)


def percentiles(
    filters: dict[str, Any],
    interval_s: int,
    metrics: tuple[str, ...] = ("ttft_s", "tpot_s", "e2e_s"),
    limit: int = 10_000,
) -> Sql:
    """P50/P90/P99 of each latency metric per `interval_s` bucket, plus the request count per bucket."""
    for m in metrics:
        if m not in LATENCY_METRICS:
            raise KeyError(m)
    where, params = _where(REQUEST_FILTERS, filters)
    params["interval_s"] = interval_s
    params["limit"] = limit
    aggregates = ", ".join(
        f"{QUANTILES}(0.5, 0.9, 0.99)({m}) AS q_{m}, "
        f"q_{m}[1] AS p50_{m}, q_{m}[2] AS p90_{m}, q_{m}[3] AS p99_{m}"
        for m in metrics
    )
    columns = ", ".join(f"p50_{m}, p90_{m}, p99_{m}" for m in metrics)
    text = (
        f"SELECT bucket, requests, {columns} FROM ("
        f"SELECT {bucket()} AS bucket, "
        "count() AS requests, "
        f"{aggregates} FROM requests{where} GROUP BY bucket) ORDER BY bucket LIMIT {{limit:UInt32}}"
    )
    return Sql(text, params)
