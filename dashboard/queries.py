"""The dashboard's SQL, by name, run through the collector's `POST /api/sql` (read-only there).

Text is constant; every value is a ClickHouse query parameter (`{name:Type}`). The time range is always
`{since:Float64}`/`{until:Float64}` in epoch seconds and the bucket width `{interval_s:UInt32}`. Every query
of `requests` and `steps` also keeps only the sidebar's services and instances, `{services:Array(String)}`
and `{instances:Array(String)}` (empty: all; `dashboard.scope.Scope.params`).
"""

from __future__ import annotations

from collector.sqlfn import QUANTILE, bucket

# the sidebar's fleet filter, on every query of `requests` and `steps` (the tables with these columns)
SCOPE = (
    "(empty({services:Array(String)}) OR service IN {services:Array(String)}) "
    "AND (empty({instances:Array(String)}) OR instance IN {instances:Array(String)})"
)
_TIME = (
    "time >= fromUnixTimestamp64Nano(toInt64({since:Float64} * 1e9)) "
    "AND time < fromUnixTimestamp64Nano(toInt64({until:Float64} * 1e9))"
)
_RANGE = f"{_TIME} AND {SCOPE}"
_BUCKET = bucket()
# a request meets the SLO when it completed without error within both targets (loadgen's definition;
# a one-token request has no TPOT and passes that half)
_MEETS_SLO = (
    "(NOT is_error AND ttft_s <= {slo_ttft_s:Float64} AND (tpot_s IS NULL OR tpot_s <= {slo_tpot_s:Float64}))"
)

# the whole store: is there anything, and from when to when
DATA_SPAN = "SELECT count() AS requests, min(time) AS first, max(time) AS last FROM requests"

# the sidebar's filter options: every (service, instance) pair the store holds
SCOPE_OPTIONS = "SELECT DISTINCT service, instance FROM requests ORDER BY service, instance"

# Overview tiles over the range
SUMMARY = f"""
SELECT count() AS requests,
       {QUANTILE}(0.5)(ttft_s) AS p50_ttft_s, {QUANTILE}(0.99)(ttft_s) AS p99_ttft_s,
       {QUANTILE}(0.5)(tpot_s) AS p50_tpot_s, {QUANTILE}(0.99)(tpot_s) AS p99_tpot_s,
       countIf({_MEETS_SLO}) AS meeting_slo, countIf(is_error) AS errors,
       sum(output_tokens) AS output_tokens,
       min(time) AS first, max(end_time) AS last
FROM requests WHERE {_RANGE}
"""

# Overview: P50/P99 TTFT and TPOT per bucket
LATENCY_SERIES = f"""
SELECT {_BUCKET} AS bucket, count() AS requests,
       {QUANTILE}(0.5)(ttft_s) AS p50_ttft_s, {QUANTILE}(0.99)(ttft_s) AS p99_ttft_s,
       {QUANTILE}(0.5)(tpot_s) AS p50_tpot_s, {QUANTILE}(0.99)(tpot_s) AS p99_tpot_s
FROM requests WHERE {_RANGE} GROUP BY bucket ORDER BY bucket
"""

# Overview: completions, goodput and errors per bucket (by the time a request started)
THROUGHPUT_SERIES = f"""
SELECT {_BUCKET} AS bucket,
       count() / {{interval_s:UInt32}} AS requests_per_s,
       countIf({_MEETS_SLO}) / {{interval_s:UInt32}} AS goodput_per_s,
       countIf(is_error) / {{interval_s:UInt32}} AS errors_per_s,
       sum(output_tokens) / {{interval_s:UInt32}} AS output_tokens_per_s
FROM requests WHERE {_RANGE} GROUP BY bucket ORDER BY bucket
"""

# Requests page: slowest first, searchable by trace id, request id or finish reason
SLOWEST_REQUESTS = f"""
SELECT time, trace_id, request_id, service, instance, model, e2e_s, ttft_s, tpot_s, queue_s, prefill_s,
       kv_transfer_s, decode_s, input_tokens, output_tokens, cached_tokens, preemptions, finish_reason,
       is_error, status_message
FROM requests
WHERE {_RANGE}
  AND ({{search:String}} = ''
       OR positionCaseInsensitive(trace_id, {{search:String}}) > 0
       OR positionCaseInsensitive(request_id, {{search:String}}) > 0
       OR finish_reason = {{search:String}})
  AND e2e_s >= {{min_e2e_s:Float64}}
ORDER BY e2e_s DESC
LIMIT {{limit:UInt32}}
"""

# Requests page: the engine steps one request shared, through the step -> request links
LINKED_STEPS = """
SELECT Timestamp AS time, Duration / 1e9 AS duration_s,
       toUInt64OrZero(SpanAttributes['stepscope.step.id']) AS step_id,
       toUInt32OrZero(SpanAttributes['stepscope.step.batch_size']) AS batch_size,
       toUInt32OrZero(SpanAttributes['stepscope.step.prefill_tokens']) AS prefill_tokens,
       toUInt32OrZero(SpanAttributes['stepscope.step.decode_tokens']) AS decode_tokens,
       toUInt32OrZero(Links.Attributes[indexOf(Links.TraceId, {trace_id:String})]['stepscope.link.tokens'])
           AS tokens_for_request,
       Links.Attributes[indexOf(Links.TraceId, {trace_id:String})]['stepscope.link.is_prefill'] = 'true'
           AS is_prefill
FROM otel_traces
WHERE SpanName = 'engine.step' AND has(Links.TraceId, {trace_id:String})
  AND Timestamp >= fromUnixTimestamp64Nano(toInt64({since:Float64} * 1e9))
  AND Timestamp < fromUnixTimestamp64Nano(toInt64({until:Float64} * 1e9))
ORDER BY Timestamp
LIMIT 5000
"""

# Engine page: the step loop per bucket
ENGINE_SERIES = f"""
SELECT {_BUCKET} AS bucket, count() AS steps,
       avg(batch_size) AS batch_size, avg(num_waiting) AS waiting,
       avg(prefill_tokens + decode_tokens) AS tokens_per_step,
       sum(prefill_tokens) / {{interval_s:UInt32}} AS prefill_tokens_per_s,
       sum(decode_tokens) / {{interval_s:UInt32}} AS decode_tokens_per_s,
       {QUANTILE}(0.5)(duration_s) * 1000 AS p50_step_ms,
       {QUANTILE}(0.99)(duration_s) * 1000 AS p99_step_ms,
       avg(gap_s) * 1000 AS gap_ms,
       avgIf(kv_blocks_used / kv_blocks_total, kv_blocks_total > 0) AS kv_usage,
       sum(preemptions) AS preemptions
FROM steps WHERE {_RANGE} GROUP BY bucket ORDER BY bucket
"""

# Engine page: step time against batch size (the memory-bound -> compute-bound bend)
STEP_TIME_BY_BATCH = f"""
SELECT batch_size, if(prefill_tokens > 0, 'with prefill', 'decode only') AS kind, count() AS steps,
       {QUANTILE}(0.5)(duration_s) * 1000 AS p50_step_ms,
       {QUANTILE}(0.9)(duration_s) * 1000 AS p90_step_ms,
       avg(prefill_tokens + decode_tokens) AS tokens_per_step
FROM steps WHERE {_RANGE} AND batch_size > 0
GROUP BY batch_size, kind ORDER BY batch_size, kind
"""

# GPU page: every counter under stepscope.gpu. / stepscope.host. per bucket
COUNTER_SERIES = f"""
SELECT {_BUCKET} AS bucket, counter, avg(value) AS value
FROM steps ARRAY JOIN mapKeys(counters) AS counter, mapValues(counters) AS value
WHERE {_RANGE}
GROUP BY bucket, counter ORDER BY bucket, counter
"""

# Capacity page: the capacity curve from traffic. Per bucket of completions: throughput, and the mean
# number in flight by Little's law (L = completions per second x mean E2E).
TRAFFIC_CAPACITY = f"""
SELECT {bucket("end_time")} AS bucket,
       count() AS completed,
       count() / {{interval_s:UInt32}} AS requests_per_s,
       countIf({_MEETS_SLO}) / {{interval_s:UInt32}} AS goodput_per_s,
       sum(output_tokens) / {{interval_s:UInt32}} AS output_tokens_per_s,
       count() / {{interval_s:UInt32}} * avg(e2e_s) AS in_flight,
       {QUANTILE}(0.99)(ttft_s) * 1000 AS p99_ttft_ms
FROM requests
WHERE end_time >= fromUnixTimestamp64Nano(toInt64({{since:Float64}} * 1e9))
  AND end_time < fromUnixTimestamp64Nano(toInt64({{until:Float64}} * 1e9)) AND {SCOPE}
GROUP BY bucket HAVING completed > 0 ORDER BY bucket
"""

# Overview: each alert rule's latest state, from the alerting issue's table (absent until the collector
# runs with --alert-rules)
ALERTS = """
SELECT rule, argMax(state, time) AS state, argMax(severity, time) AS severity,
       argMax(summary, time) AS summary, max(time) AS since
FROM alerts GROUP BY rule ORDER BY rule
"""

# Findings page: does a baseline hold any requests
COUNT_IN_RANGE = f"SELECT count() AS requests FROM requests WHERE {_RANGE}"

# Instances page: per instance over the range (requests' symptoms and cache reuse; steps' load and time)
INSTANCE_SUMMARY = f"""
SELECT instance, count() AS requests,
       quantileExact(0.99)(ttft_s) * 1000 AS p99_ttft_ms, quantileExact(0.99)(tpot_s) * 1000 AS p99_tpot_ms,
       sum(cached_tokens) / nullIf(sum(input_tokens), 0) AS cached_share, avg(queue_s) * 1000 AS queue_ms
FROM requests WHERE {_RANGE} GROUP BY instance ORDER BY instance
"""

# Instances page: per bucket and instance
INSTANCE_SERIES = f"""
SELECT {_BUCKET} AS bucket, instance,
       quantileExact(0.99)(ttft_s) * 1000 AS p99_ttft_ms, quantileExact(0.99)(tpot_s) * 1000 AS p99_tpot_ms,
       count() / {{interval_s:UInt32}} AS requests_per_s,
       sum(cached_tokens) / nullIf(sum(input_tokens), 0) AS cached_share
FROM requests WHERE {_RANGE} GROUP BY bucket, instance ORDER BY bucket, instance
"""
INSTANCE_STEP_SERIES = f"""
SELECT {_BUCKET} AS bucket, instance, avg(duration_s) * 1000 AS step_ms,
       avg(batch_size + num_waiting) AS load
FROM steps WHERE {_RANGE} GROUP BY bucket, instance ORDER BY bucket, instance
"""
