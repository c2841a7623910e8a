"""All SQL of the diagnosis and of the named-query library, in one place.

Text is constant. Every value is a ClickHouse server-side parameter (`{name:Type}`); times are unix
nanoseconds (`Int64`). Two windows are compared in one pass: `{b0..b1}` is the baseline, `{c0..c1}` the
current window, and `side` is 0 or 1. Queries return numbers, never DateTime values, so a store and the
collector's API (which renders times as strings) give the same frames. ClickHouse does the heavy work:
Python sees per-side aggregates, per-interval series, a per-batch-size table and at most
`sample_per_side` sampled requests per side.
"""

from __future__ import annotations

import math
import re

from collector.sqlfn import QUANTILE, QUANTILE_IF, bucket

_IN = "(time >= fromUnixTimestamp64Nano({%s:Int64}) AND time < fromUnixTimestamp64Nano({%s:Int64}))"
_CURRENT = _IN % ("c0", "c1")
_BASELINE = _IN % ("b0", "b1")
_SIDES_WHERE = f"({_BASELINE} OR {_CURRENT})"
_SIDE = f"toUInt8({_CURRENT}) AS side"
# A baseline request's latency counts only when the request ran wholly inside the baseline: one in flight
# when the current window began was hit by whatever changed there (the long prefill that stalled it, the
# backlog it joined), and a few such requests set a baseline P99 of ~100 requests by themselves.
_SETTLED = f"(end_time < fromUnixTimestamp64Nano({{b1:Int64}}) OR {_CURRENT})"
_SPAN = _IN % ("t0", "t1")
_BUCKET = "intDiv(toUnixTimestamp64Milli(time) - {t0_ms:Int64}, {iv_ms:Int64}) AS bucket"

# What the window holds: request count and time span, step rows, requests with rpc delay and phases.
BOUNDS = f"""
SELECT count() AS requests,
       toUnixTimestamp64Nano(min(time)) AS first_ns,
       toUnixTimestamp64Nano(max(time)) AS last_ns,
       (SELECT count() FROM steps WHERE {_SPAN}) AS steps
FROM requests
WHERE {_SPAN}
"""

# Per interval, for the change point and the onset of each evidence series.
REQUEST_SERIES = f"""
SELECT {_BUCKET},
       count() AS requests,
       sum(sample_weight) AS arrivals,
       avg(ttft_s) AS ttft_mean,
       {QUANTILE}(0.9)(ttft_s) AS ttft_p90,
       avg(tpot_s) AS tpot_mean,
       {QUANTILE}(0.9)(tpot_s) AS tpot_p90,
       {QUANTILE}(0.9)(tpot_max_s) AS itl_max_p90,
       avg(e2e_s) AS e2e_mean,
       avg(queue_s) AS queue_mean,
       avg(prefill_s) AS prefill_mean,
       avg(kv_transfer_s) AS kv_transfer_mean,
       sum(cached_tokens) / nullIf(sum(input_tokens), 0) AS cached_share,
       avg(input_tokens) AS input_mean,
       avg(log(greatest(toInt64(input_tokens) - toInt64(cached_tokens), 1))) AS uncached_log_mean,
       uniq(prefix_key) / count() AS prefix_keys_per_request,
       avg(rpc_delay_s) AS rpc_delay_mean,
       avg(is_error) AS error_rate,
       sum(output_tokens * sample_weight) AS output_tokens_sum,
       avg(output_tokens) AS output_mean,
       avg(frontend_s) AS frontend_mean,
       {QUANTILE}(0.1)(frontend_s) AS frontend_p10,
       avg(loop_lag_s) AS loop_lag_mean
FROM requests
WHERE {_SPAN}
GROUP BY bucket
ORDER BY bucket
"""

# The step frame (diagnosis/frame.py): one pass over `steps`, each step counted `sample_every` times (1-in-N
# step sampling keeps one step of N: counts, busy time and preemptions are scaled back up), grouped by a key
# (the interval, or the side) and the step's shape, as sums; series, side aggregates and the shape table are
# sums over its groups. The
# group key is packed into one UInt64 (key << 40 | batch_size << 2 | has_prefill << 1 | has_decode): one
# fixed-size hash key is the cheapest GROUP BY, and the frame is the costliest query of a diagnosis. The
# weight dtype is each group's heavy hitter. One row per key with each column an array over its groups
# keeps the row count at the number of intervals (the collector API caps rows).
_STEP_FRAME = """
SELECT intDiv(shape, 1099511627776) AS key,
       groupArray(intDiv(shape % 1099511627776, 4)) AS batch_size,
       groupArray(intDiv(shape, 2) % 2) AS has_prefill,
       groupArray(shape % 2) AS has_decode,
       groupArray(weight_dtype) AS weight_dtype,
       groupArray(steps) AS steps,
       groupArray(duration_sum) AS duration_sum,
       groupArray(gap_sum) AS gap_sum,
       groupArray(bytes_sum) AS bytes_sum,
       groupArray(prefill_max) AS prefill_max,
       groupArray(preemptions) AS preemptions,
       groupArray(kv_usage_sum) AS kv_usage_sum,
       groupArray(kv_usage_n) AS kv_usage_n,
       groupArray(kv_blocks_total_sum) AS kv_blocks_total_sum,
       groupArray(chunked_sum) AS chunked_sum,
       groupArray(max_num_seqs_sum) AS max_num_seqs_sum,
       groupArray(max_num_seqs_max) AS max_num_seqs_max,
       groupArray(budget_sum) AS budget_sum,
       groupArray(budget_max) AS budget_max,
       groupArray(tokens_sum) AS tokens_sum,
       groupArray(waiting_sum) AS waiting_sum,
       groupArray(cpu_sum) AS cpu_sum,
       groupArray(cpu_wall_sum) AS cpu_wall_sum,
       groupArray(cpu_n) AS cpu_n,
       groupArray(load_sum) AS load_sum,
       groupArray(load_n) AS load_n
FROM (
    SELECT toUInt64({key}) * 1099511627776 + batch_size * 4 + (prefill_tokens > 0) * 2 + (decode_tokens > 0)
               AS shape,
           anyHeavy(weight_dtype) AS weight_dtype,
           sum(sample_every) AS steps,
           sum(duration_s * sample_every) AS duration_sum,
           sum(gap_s * sample_every) AS gap_sum,
           sum(bytes_read * sample_every) AS bytes_sum,
           max(prefill_tokens) AS prefill_max,
           sum(preemptions * sample_every) AS preemptions,
           sumIf(kv_blocks_used / kv_blocks_total * sample_every, kv_blocks_total > 0) AS kv_usage_sum,
           sumIf(sample_every, kv_blocks_total > 0) AS kv_usage_n,
           sum(kv_blocks_total * sample_every) AS kv_blocks_total_sum,
           sum(chunked_prefill * sample_every) AS chunked_sum,
           sum(max_num_seqs * sample_every) AS max_num_seqs_sum,
           max(max_num_seqs) AS max_num_seqs_max,
           sum(max_num_batched_tokens * sample_every) AS budget_sum,
           max(max_num_batched_tokens) AS budget_max,
           sum((prefill_tokens + decode_tokens) * sample_every) AS tokens_sum,
           sum(num_waiting * sample_every) AS waiting_sum,
           sum(ifNull(cpu_s, 0) * sample_every) AS cpu_sum,
           sumIf(duration_s * sample_every, isNotNull(cpu_s)) AS cpu_wall_sum,
           sumIf(sample_every, isNotNull(cpu_s)) AS cpu_n,
           sumIf(counters['stepscope.host.load_1m'], mapContains(counters, 'stepscope.host.load_1m'))
               AS load_sum,
           countIf(mapContains(counters, 'stepscope.host.load_1m')) AS load_n
    FROM steps
    WHERE {where}
    GROUP BY shape
)
GROUP BY key
ORDER BY key
"""
STEP_FRAME_BY_INTERVAL = _STEP_FRAME.replace("{key}", _BUCKET.removesuffix(" AS bucket")).replace(
    "{where}", _SPAN
)
STEP_FRAME_BY_SIDE = _STEP_FRAME.replace("{key}", _SIDE.removesuffix(" AS side")).replace(
    "{where}", _SIDES_WHERE
)


# Host and GPU counters joined to the steps (each sampled about once a second, on the next step): means per
# side; the GPU's SM clock as a share of its maximum, its clock-event (throttle) reasons as a bitmask OR.
def _counter(key: str, name: str) -> str:
    return f"avgIf(counters['{key}'], mapContains(counters, '{key}')) AS {name}"


_HOST_COUNTERS = ",\n       ".join(
    [
        _counter("stepscope.host.load_1m", "host_load_1m"),
        _counter("stepscope.host.procs_running", "host_procs_running"),
        _counter("stepscope.host.cpu_steal", "host_cpu_steal"),
        _counter("stepscope.host.engine_cpu_share", "host_engine_cpu_share"),
        _counter("stepscope.host.cpus", "host_cpus"),
        _counter("stepscope.gpu.0.processes", "gpu_processes"),
        "avgIf(counters['stepscope.gpu.0.sm_clock_mhz'] / counters['stepscope.gpu.0.sm_clock_max_mhz'], "
        "counters['stepscope.gpu.0.sm_clock_max_mhz'] > 0) AS gpu_sm_clock_ratio",
        "if(countIf(mapContains(counters, 'stepscope.gpu.0.clocks_event_reasons')) > 0, "
        "groupBitOrIf(toUInt64(counters['stepscope.gpu.0.clocks_event_reasons']), "
        "mapContains(counters, 'stepscope.gpu.0.clocks_event_reasons')), NULL) AS gpu_clocks_event_reasons",
    ]
)

# What the frame cannot sum: quantiles, distinct instances and the counters, per side.
STEP_SIDE_QUANTILES = f"""
SELECT {_SIDE},
       uniq(instance) AS instances,
       {QUANTILE_IF}(0.99)(gap_s, decode_tokens > 0) AS work_gap_p99,
       {QUANTILE}(0.5)(kv_blocks_used / nullIf(kv_blocks_total, 0)) AS kv_usage_p50,
       {QUANTILE}(0.9)(kv_blocks_used / nullIf(kv_blocks_total, 0)) AS kv_usage_p90,
       {QUANTILE_IF}(0.99)(prefill_tokens, prefill_tokens > 0 AND decode_tokens > 0) AS mixed_prefill_p99,
       {_HOST_COUNTERS}
FROM steps
WHERE {_SIDES_WHERE}
GROUP BY side
ORDER BY side
"""

# Engine samples scraped from /metrics (collector/engine_names.py, the engine_intervals view): the same
# evidence steps carry, for engines that emit no step spans. One row per scrape and instance; counters are
# increases since the instance's previous scrape. The pool size is the cache config's block count, or
# stepscope's own gauge.
_ENGINE_POOL = "if(num_gpu_blocks > 0, toFloat64(num_gpu_blocks), kv_blocks_total)"
ENGINE_SERIES = f"""
SELECT {_BUCKET},
       count() AS m_samples,
       avg(num_running) AS m_batch_mean,
       avg(num_waiting) AS m_waiting_mean,
       avg(kv_usage) AS m_kv_usage,
       sum(preemptions) AS m_preemptions,
       sum(prefix_hits) / nullIf(sum(prefix_queries), 0) AS m_prefix_hit_share,
       max(max_num_seqs) AS m_max_num_seqs,
       avg({_ENGINE_POOL}) AS m_kv_blocks_total
FROM engine_intervals
WHERE {_SPAN}
GROUP BY bucket
ORDER BY bucket
"""

ENGINE_SIDES = f"""
SELECT {_SIDE},
       count() AS samples,
       uniq(instance) AS instances,
       sum(seconds) AS seconds_scraped,
       avg(num_running) AS batch_mean,
       avg(num_waiting) AS waiting_mean,
       avg(kv_usage) AS kv_usage_mean,
       {QUANTILE}(0.5)(kv_usage) AS kv_usage_p50,
       {QUANTILE}(0.9)(kv_usage) AS kv_usage_p90,
       sum(preemptions) AS preemptions,
       sum(prefix_queries) AS prefix_queries_sum,
       sum(prefix_hits) / nullIf(sum(prefix_queries), 0) AS prefix_hit_share,
       sum(cached_tokens) / nullIf(sum(prompt_tokens), 0) AS cached_token_share,
       avg(prefix_hit_rate) AS prefix_hit_rate,
       sum(prompt_tokens) / nullIf(sum(seconds), 0) AS prompt_tokens_per_s,
       sum(generation_tokens) / nullIf(sum(seconds), 0) AS generation_tokens_per_s,
       sum(step_tokens) / nullIf(sum(engine_steps), 0) AS tokens_per_step,
       sum(engine_steps) AS engine_steps_sum,
       sum(generation_tokens) AS generation_tokens_sum,
       sum(finished) / nullIf(sum(seconds), 0) AS finished_per_s,
       sum(aborted) / nullIf(sum(seconds), 0) AS aborted_per_s,
       avg(max_num_seqs) AS max_num_seqs_mean,
       max(max_num_seqs) AS max_num_seqs_max,
       avg({_ENGINE_POOL}) AS kv_blocks_total_mean
FROM engine_intervals
WHERE {_SIDES_WHERE}
GROUP BY side
ORDER BY side
"""

# One row per side: the symptoms' quantiles and the means the decomposition adds up.
REQUEST_SIDES = f"""
SELECT {_SIDE},
       count() AS requests,
       sum(sample_weight) AS arrivals,
       sum(is_error) AS errors,
       sum(is_error * sample_weight) AS errors_weighted,
       toUnixTimestamp64Nano(min(time)) / 1e9 AS first_s,
       toUnixTimestamp64Nano(max(time)) / 1e9 AS last_s,
       count(ttft_s) AS with_ttft,
       count(tpot_s) AS with_tpot,
       count(queue_s) AS with_queue,
       count(prefill_s) AS with_prefill,
       count(rpc_delay_s) AS with_rpc,
       countIf(kv_transfer_s > 0) AS with_kv_transfer,
       {QUANTILE_IF}(0.5)(ttft_s, {_SETTLED}) AS ttft_p50,
       {QUANTILE_IF}(0.99)(ttft_s, {_SETTLED}) AS ttft_p99,
       {QUANTILE_IF}(0.5)(tpot_s, {_SETTLED}) AS tpot_p50,
       {QUANTILE_IF}(0.99)(tpot_s, {_SETTLED}) AS tpot_p99,
       {QUANTILE_IF}(0.5)(e2e_s, {_SETTLED}) AS e2e_p50,
       {QUANTILE_IF}(0.99)(e2e_s, {_SETTLED}) AS e2e_p99,
       {QUANTILE_IF}(0.99)(tpot_max_s, {_SETTLED}) AS itl_max_p99,
       avg(ttft_s) AS ttft_mean,
       avg(tpot_s) AS tpot_mean,
       avg(e2e_s) AS e2e_mean,
       avg(queue_s) AS queue_mean,
       avg(prefill_s) AS prefill_mean,
       avg(kv_transfer_s) AS kv_transfer_mean,
       avg(decode_s) AS decode_mean,
       avg(rpc_delay_s) AS rpc_delay_mean,
       {QUANTILE}(0.99)(rpc_delay_max_s) AS rpc_delay_max_p99,
       avg(input_tokens) AS input_mean,
       {QUANTILE}(0.5)(input_tokens) AS input_p50,
       {QUANTILE}(0.9)(input_tokens) AS input_p90,
       {QUANTILE}(0.99)(input_tokens) AS input_p99,
       avg(input_tokens - cached_tokens) AS uncached_mean,
       avg(output_tokens) AS output_mean,
       sum(output_tokens * sample_weight) AS output_tokens_sum,
       count(frontend_s) AS with_frontend,
       avg(frontend_s) AS frontend_mean,
       avg(loop_lag_s) AS loop_lag_mean,
       sum(cached_tokens) / nullIf(sum(input_tokens), 0) AS cached_share,
       uniq(prefix_key) / nullIf(countIf(prefix_key != ''), 0) AS prefix_keys_per_request,
       avg(preemptions) AS preemptions_per_request,
       sumIf(kv_transfer_s, kv_transfer_s > 0)
           / nullIf(sumIf(input_tokens - cached_tokens, kv_transfer_s > 0), 0) AS kv_transfer_s_per_token
FROM requests
WHERE {_SIDES_WHERE}
GROUP BY side
ORDER BY side
"""

# Requests sampled per side by a hash of the span id (the same sample on every run): a hash cut first
# keeps the sort small, then LIMIT BY caps each side.
REQUEST_SAMPLE = f"""
SELECT {_SIDE}, ttft_s, tpot_s, e2e_s, tpot_max_s, queue_s, prefill_s, kv_transfer_s, input_tokens, is_error,
       toUnixTimestamp64Milli(time) / 1000.0 AS t
FROM requests
WHERE {_SIDES_WHERE} AND {_SETTLED}
  AND cityHash64(span_id) <= if({_CURRENT}, {{cut_c:UInt64}}, {{cut_b:UInt64}})
ORDER BY side, cityHash64(span_id)
LIMIT {{n:UInt32}} BY side
"""

# --- fleets (diagnosis/fleet.py) -------------------------------------------------------------------
# Per instance and side: load, the symptoms' means, cache reuse and distinct prefixes.
INSTANCE_SIDES = f"""
SELECT instance, {_SIDE},
       count() AS requests,
       sum(is_error) AS errors,
       avg(ttft_s) AS ttft_mean,
       avg(tpot_s) AS tpot_mean,
       avg(e2e_s) AS e2e_mean,
       avg(queue_s) AS queue_mean,
       sum(cached_tokens) / nullIf(sum(input_tokens), 0) AS cached_share,
       uniqIf(prefix_key, prefix_key != '') AS prefix_keys,
       avg(input_tokens) AS input_mean,
       toUnixTimestamp64Nano(max(time)) AS last_ns
FROM requests
WHERE {_SIDES_WHERE}
GROUP BY instance, side
ORDER BY instance, side
"""

# Per instance inside one span: its requests and the times of its first and last (did one stop serving?).
INSTANCE_SPAN = f"""
SELECT instance,
       count() AS requests,
       toUnixTimestamp64Nano(min(time)) AS first_ns,
       toUnixTimestamp64Nano(max(time)) AS last_ns
FROM requests
WHERE {_SPAN}
GROUP BY instance
ORDER BY instance
"""

# Per side: on how many instances each shared prompt prefix (a first-block key seen twice or more) landed,
# on average. Routed by prefix, a prefix stays on one replica (more when the load bound spills it); scattered,
# it lands on every replica: each one sees more distinct prefixes at unchanged prompts.
SHARED_PREFIX_SPREAD = f"""
SELECT side, avg(instances) AS instances_per_prefix, count() AS shared_prefixes
FROM (
    SELECT {_SIDE}, prefix_key, uniqExact(instance) AS instances, count() AS n
    FROM requests
    WHERE {_SIDES_WHERE} AND prefix_key != ''
    GROUP BY side, prefix_key
    HAVING n >= 2
)
GROUP BY side
ORDER BY side
"""

# Of the requests whose prompt prefix had come before (anywhere in the fleet, in either window), the share
# that landed on the instance the prefix went to last: near 1 while a router keeps prefixes where their
# blocks are cached, about 1/instances once it scatters them. Unlike the instances a prefix lands on, it
# does not grow with a window's length.
PREFIX_AFFINITY = f"""
SELECT side, avg(instance = previous) AS affinity, count() AS repeats
FROM (
    SELECT {_SIDE}, instance,
           lagInFrame(instance) OVER (PARTITION BY prefix_key ORDER BY time
                                      ROWS BETWEEN 1 PRECEDING AND CURRENT ROW) AS previous,
           row_number() OVER (PARTITION BY prefix_key ORDER BY time) AS k
    FROM requests
    WHERE {_SIDES_WHERE} AND prefix_key != ''
)
WHERE k > 1
GROUP BY side
ORDER BY side
"""

# Decode-only step time by batch size in the current window, the given instances against the others:
# the same batch size on healthy peers in the same window is the comparison that needs no baseline.
PEER_STEPS = f"""
SELECT has({{subset:Array(String)}}, instance) AS in_subset, batch_size,
       count() AS steps, avg(duration_s) AS duration_mean
FROM steps
WHERE {_CURRENT} AND decode_tokens > 0 AND prefill_tokens = 0
GROUP BY in_subset, batch_size
ORDER BY in_subset, batch_size
"""

# One instance's requests and its peers' over both sides, a sample of at most `n` rows (the peer test of an
# instance diagnosed alone: diagnosis/fleet.py `peer_regressions`).
PEER_LATENCY = f"""
SELECT {_SIDE}, instance = {{instance:String}} AS own, toUnixTimestamp64Milli(time) / 1000.0 AS t,
       ttft_s, tpot_s
FROM requests
WHERE {_SIDES_WHERE}
ORDER BY cityHash64(span_id)
LIMIT {{n:UInt32}}
"""

# The service / instance filter of `--service` / `--instance`: each read of `requests` or `steps` becomes a
# read of its filtered rows (an empty list keeps every row).
SCOPED_TABLE = (
    "(SELECT * FROM {table} WHERE (empty({scope_services:Array(String)}) "
    "OR service IN {scope_services:Array(String)}) AND (empty({scope_instances:Array(String)}) "
    "OR instance IN {scope_instances:Array(String)})) AS {table}"
)

# --- the named-query library (`stepscope query`) --------------------------------------------------------
_WINDOW = _IN % ("w0", "w1")

SLOWEST = f"""
SELECT toUnixTimestamp64Milli(time) / 1e3 AS time_s, trace_id, request_id, service, instance,
       round({{metric:Identifier}}, 4) AS value, round(ttft_s, 4) AS ttft_s, round(tpot_s, 4) AS tpot_s,
       round(e2e_s, 4) AS e2e_s, round(queue_s, 4) AS queue_s, round(prefill_s, 4) AS prefill_s,
       input_tokens, output_tokens, cached_tokens, preemptions, finish_reason, is_error
FROM requests
WHERE {_WINDOW} AND isNotNull({{metric:Identifier}})
ORDER BY {{metric:Identifier}} DESC
LIMIT {{limit:UInt32}}
"""

COMPARE = f"""
SELECT if({_IN % ("b_from", "b_to")}, 'b', 'a') AS window,
       count() AS requests,
       round(avg(is_error), 4) AS error_rate,
       round({QUANTILE}(0.5)(ttft_s), 4) AS ttft_p50, round({QUANTILE}(0.99)(ttft_s), 4) AS ttft_p99,
       round({QUANTILE}(0.5)(tpot_s), 4) AS tpot_p50, round({QUANTILE}(0.99)(tpot_s), 4) AS tpot_p99,
       round({QUANTILE}(0.99)(e2e_s), 4) AS e2e_p99,
       round(avg(queue_s), 4) AS queue_mean, round(avg(prefill_s), 4) AS prefill_mean,
       round(avg(decode_s), 4) AS decode_mean,
       round(avg(input_tokens), 1) AS input_mean, round(avg(output_tokens), 1) AS output_mean,
       round(sum(cached_tokens) / nullIf(sum(input_tokens), 0), 3) AS cached_share
FROM requests
WHERE {_IN % ("a_from", "a_to")} OR {_IN % ("b_from", "b_to")}
GROUP BY window
ORDER BY window
"""

WATERFALL = """
SELECT toUnixTimestamp64Nano(Timestamp) AS start_ns, Duration AS duration_ns, SpanId AS span_id,
       ParentSpanId AS parent_span_id, SpanName AS name, ServiceName AS service, StatusCode AS status
FROM otel_traces
WHERE TraceId = lower({trace_id:String})
ORDER BY Timestamp
LIMIT 2000
"""

CACHE_HIT_RATE = f"""
SELECT toUnixTimestamp({bucket()}) AS bucket_s,
       count() AS requests,
       round(sum(cached_tokens) / nullIf(sum(input_tokens), 0), 3) AS cached_share,
       uniqExact(prefix_key) AS prefix_keys,
       round(avg(input_tokens), 1) AS input_mean,
       round(avg(ttft_s), 4) AS ttft_mean
FROM requests
WHERE {_WINDOW}
GROUP BY bucket_s
ORDER BY bucket_s
"""

# Each scrape stores `up` (the error in its label) and `scrape_samples` (collector/scrape.py).
SCRAPE_HEALTH = f"""
SELECT service, instance,
       toUnixTimestamp64Milli(maxIf(time, metric = 'up')) / 1e3 AS last_scrape_s,
       argMaxIf(value, time, metric = 'up') AS up,
       argMaxIf(value, time, metric = 'scrape_samples') AS samples,
       countIf(metric = 'up') AS scrapes,
       countIf(metric = 'up' AND value = 0) AS failures,
       argMaxIf(labels['error'], time, metric = 'up' AND value = 0) AS last_error
FROM engine_samples
WHERE metric IN ('up', 'scrape_samples') AND {_WINDOW}
GROUP BY service, instance
ORDER BY service, instance
"""

STEP_TIME_BY_BATCH = f"""
SELECT batch_size, count() AS steps,
       round({QUANTILE}(0.5)(duration_s) * 1e3, 2) AS step_ms_p50,
       round({QUANTILE}(0.99)(duration_s) * 1e3, 2) AS step_ms_p99,
       round(avg(gap_s) * 1e3, 3) AS gap_ms_mean,
       round(avg(prefill_tokens), 1) AS prefill_tokens_mean,
       round(avg(decode_tokens), 1) AS decode_tokens_mean,
       sum(preemptions) AS preemptions
FROM steps
WHERE {_WINDOW}
GROUP BY batch_size
ORDER BY batch_size
"""

# --- evidence queries attached to findings (rendered with literal numbers by `render`) ----------------
_EVIDENCE_HEAD = (
    f"SELECT {bucket(width='iv')} AS t, {{cols}} FROM {{table}} "
    "WHERE time >= fromUnixTimestamp64Nano({t0:Int64}) AND time < fromUnixTimestamp64Nano({t1:Int64}) "
    "GROUP BY t ORDER BY t"
)
_EVIDENCE_COLUMNS: dict[str, tuple[str, str]] = {
    "routing_imbalance": (
        "requests",
        "count() AS requests, uniq(instance) AS instances, max(queue_s) AS queue_max, "
        "avg(queue_s) AS queue_mean",
    ),
    "cache_affinity_lost": (
        "requests",
        "sum(cached_tokens) / nullIf(sum(input_tokens), 0) AS cached_share, "
        "uniq(instance, prefix_key) AS instance_prefix_keys, uniq(prefix_key) AS prefix_keys",
    ),
    "lost_capacity": (
        "requests",
        "count() AS requests, uniq(instance) AS instances, sum(is_error) AS errors",
    ),
    "prefix_cache_miss": (
        "requests",
        "count() AS requests, sum(cached_tokens) / sum(input_tokens) AS cached_share, "
        "uniqExact(prefix_key) AS prefix_keys, avg(input_tokens) AS input_mean, "
        "avg(prefill_s) AS prefill_mean",
    ),
    "long_prompts": (
        "requests",
        f"count() AS requests, avg(input_tokens) AS input_mean, {QUANTILE}(0.9)(input_tokens) AS input_p90, "
        f"{QUANTILE}(0.99)(input_tokens) AS input_p99, "
        "avg(prefill_s) AS prefill_mean, avg(queue_s) AS queue_mean",
    ),
    "queueing_overload": (
        "requests",
        "count() AS requests, avg(queue_s) AS queue_mean, avg(prefill_s) AS prefill_mean, "
        f"{QUANTILE}(0.99)(ttft_s) AS ttft_p99",
    ),
    "oversized_batch": (
        "steps",
        "avg(batch_size) AS batch_mean, max(max_num_seqs) AS max_num_seqs, avg(duration_s) AS step_mean, "
        "sum(preemptions) AS preemptions",
    ),
    "prefill_interference": (
        "steps",
        "avg(chunked_prefill) AS chunked_share, "
        "maxIf(prefill_tokens, decode_tokens > 0) AS mixed_prefill_max, "
        "max(duration_s) AS step_max",
    ),
    "kv_cache_pressure": (
        "steps",
        "sum(preemptions) AS preemptions, avg(kv_blocks_used / kv_blocks_total) AS kv_usage, "
        "avg(kv_blocks_total) AS kv_blocks_total_mean, avg(num_waiting) AS waiting_mean",
    ),
    "scheduler_stall": (
        "steps",
        f"avgIf(gap_s, decode_tokens > 0) AS work_gap_mean, {QUANTILE_IF}(0.99)(gap_s, decode_tokens > 0) AS "
        "work_gap_p99, avg(duration_s) AS step_mean, count() AS steps",
    ),
    "rpc_overhead": (
        "requests",
        "avg(rpc_delay_s) AS rpc_delay_mean, max(rpc_delay_max_s) AS rpc_delay_max, avg(tpot_s) AS tpot_mean",
    ),
    "weight_quant_off": (
        "steps",
        "anyHeavy(weight_dtype) AS weight_dtype, avg(duration_s / greatest(batch_size, 1)) AS step_per_seq, "
        "avg(bytes_read) AS bytes_read_mean, avg(batch_size) AS batch_mean",
    ),
    "kv_transfer_slow": (
        "requests",
        "avg(kv_transfer_s) AS kv_transfer_mean, avg(ttft_s) AS ttft_mean, "
        "sum(kv_transfer_s) / sum(input_tokens - cached_tokens) AS kv_transfer_s_per_token",
    ),
    "compute_slowdown": (
        "steps",
        "avg(duration_s) AS step_mean, avg(cpu_s) AS step_cpu_mean, sum(cpu_s) / sumIf(duration_s, "
        "isNotNull(cpu_s)) AS cpu_share, avg(batch_size) AS batch_mean, "
        "avgIf(counters['stepscope.host.load_1m'], mapContains(counters, 'stepscope.host.load_1m')) "
        "AS load_1m",
    ),
    "long_outputs": (
        "requests",
        "sum(sample_weight) AS arrivals, avg(output_tokens) AS output_mean, avg(decode_s) AS decode_mean, "
        "avg(e2e_s) AS e2e_mean, avg(input_tokens) AS input_mean",
    ),
    "batch_limit_low": (
        "steps",
        "avg(max_num_seqs) AS max_num_seqs, avg(batch_size) AS batch_mean, avg(num_waiting) AS waiting_mean, "
        "avg(kv_blocks_used / kv_blocks_total) AS kv_usage",
    ),
    "frontend_bottleneck": (
        "requests",
        "sum(sample_weight) AS arrivals, avg(frontend_s) AS frontend_mean, max(loop_lag_s) AS loop_lag_max, "
        "avg(queue_s) AS queue_mean, avg(ttft_s) AS ttft_mean",
    ),
    "unexplained": (
        "requests",
        "sum(sample_weight) AS arrivals, avg(ttft_s) AS ttft_mean, avg(tpot_s) AS tpot_mean, "
        "avg(queue_s) AS queue_mean, avg(prefill_s) AS prefill_mean, avg(input_tokens) AS input_mean, "
        "avg(output_tokens) AS output_mean",
    ),
}
# The same evidence read from scraped engine samples, for findings made without step spans.
_EVIDENCE_METRICS_COLUMNS: dict[str, str] = {
    "kv_cache_pressure": "sum(preemptions) AS preemptions, avg(kv_usage) AS kv_usage, "
    f"avg({_ENGINE_POOL}) AS kv_blocks_total, avg(num_running) AS running_mean, "
    "avg(num_waiting) AS waiting_mean",
    "oversized_batch": "avg(num_running) AS running_mean, max(max_num_seqs) AS max_num_seqs, "
    "sum(preemptions) AS preemptions, sum(generation_tokens) / sum(seconds) AS generation_tokens_per_s",
    "prefix_cache_miss": "sum(prefix_hits) / sum(prefix_queries) AS prefix_hit_share, "
    "sum(prompt_tokens) / sum(seconds) AS prompt_tokens_per_s, avg(prefix_hit_rate) AS prefix_hit_rate",
    "queueing_overload": "avg(num_waiting) AS waiting_mean, avg(num_running) AS running_mean, "
    "max(max_num_seqs) AS max_num_seqs, sum(finished) / sum(seconds) AS finished_per_s",
    "batch_limit_low": "avg(max_num_seqs) AS max_num_seqs, avg(num_running) AS running_mean, "
    "avg(num_waiting) AS waiting_mean, avg(kv_usage) AS kv_usage",
}
EVIDENCE_METRICS: dict[str, str] = {
    cause: _EVIDENCE_HEAD.replace("{cols}", cols).replace("{table}", "engine_intervals")
    for cause, cols in _EVIDENCE_METRICS_COLUMNS.items()
}
EVIDENCE: dict[str, str] = {
    cause: _EVIDENCE_HEAD.replace("{cols}", cols).replace("{table}", table)
    for cause, (table, cols) in _EVIDENCE_COLUMNS.items()
}


def render(sql: str, params: dict[str, object]) -> str:
    """SQL with its `{name:Type}` parameters replaced by typed literals, for people to copy and run:
    integers and floats checked as numbers, strings quoted with ClickHouse escaping. A placeholder without
    a value, a value of the wrong type, or an unknown type raises ValueError; SQL text is never taken
    from a value."""

    def literal(m: re.Match[str]) -> str:
        name, kind = m.group(1), m.group(2)
        if name not in params:
            raise ValueError(f"no value for parameter {name!r}")
        value = params[name]
        if kind.startswith(("Int", "UInt")):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"parameter {name!r} must be an integer, got {value!r}")
            return str(value)
        if kind.startswith("Float"):
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"parameter {name!r} must be a finite number, got {value!r}")
            return repr(float(value))
        if kind == "String":
            if not isinstance(value, str):
                raise ValueError(f"parameter {name!r} must be a string, got {value!r}")
            return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
        if kind == "Array(String)":
            if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"parameter {name!r} must be a list of strings, got {value!r}")
            return "[" + ", ".join(literal_string(v) for v in value) + "]"
        raise ValueError(f"cannot render parameter type {kind!r}")

    def literal_string(value: str) -> str:
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"

    return re.sub(r"\{(\w+):(\w+(?:\(String\))?)\}", literal, sql)
