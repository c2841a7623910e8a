-- engine_samples: what other engines (vLLM, SGLang, stepscope's own) report on their Prometheus /metrics
-- page, under stepscope names (collector/engine_names.py). Rows come from the collector's scraper
-- (origin 'scrape') and from OTLP metrics carrying the same names, as an OpenTelemetry Collector's
-- Prometheus receiver sends them (origin 'otlp', through the three views below).
-- engine_intervals: one row per scrape of an instance, next to `steps`: gauges as read, counters as their
-- increase since the instance's previous scrape (a counter reset counts from zero), the cache configuration
-- from its info metric.

CREATE TABLE IF NOT EXISTS engine_samples (
    time DateTime64(9) CODEC(Delta(8), ZSTD(1)),
    service LowCardinality(String),
    instance LowCardinality(String),
    metric LowCardinality(String),
    value Float64,
    labels Map(LowCardinality(String), String),
    source_metric LowCardinality(String),
    origin LowCardinality(String)
) ENGINE = MergeTree
PARTITION BY toDate(time)
ORDER BY (service, instance, metric, time)
{ttl_engine_samples}
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1{dedup};

CREATE MATERIALIZED VIEW IF NOT EXISTS engine_samples_gauge_mv TO engine_samples AS
SELECT TimeUnix AS time, ServiceName AS service, ResourceAttributes['service.instance.id'] AS instance,
       transform(MetricName, {engine_scalar_names}, '') AS metric, Value AS value,
       CAST(Attributes, 'Map(LowCardinality(String), String)') AS labels, MetricName AS source_metric,
       'otlp' AS origin
FROM otel_metrics_gauge
WHERE metric != '';

CREATE MATERIALIZED VIEW IF NOT EXISTS engine_samples_sum_mv TO engine_samples AS
SELECT TimeUnix AS time, ServiceName AS service, ResourceAttributes['service.instance.id'] AS instance,
       transform(MetricName, {engine_scalar_names}, '') AS metric, Value AS value,
       CAST(Attributes, 'Map(LowCardinality(String), String)') AS labels, MetricName AS source_metric,
       'otlp' AS origin
FROM otel_metrics_sum
WHERE metric != '' AND AggregationTemporality != 1;

-- A histogram point becomes Prometheus's series: _sum, _count, and one cumulative _bucket per bound (le).
CREATE MATERIALIZED VIEW IF NOT EXISTS engine_samples_histogram_mv TO engine_samples AS
SELECT time, service, instance, concat(base, suffix) AS metric, v AS value,
       if(suffix = '_bucket', mapUpdate(attrs, map('le', le)), attrs) AS labels,
       source_metric, 'otlp' AS origin
FROM (
    SELECT TimeUnix AS time, ServiceName AS service, ResourceAttributes['service.instance.id'] AS instance,
           transform(MetricName, {engine_histogram_names}, '') AS base,
           CAST(Attributes, 'Map(LowCardinality(String), String)') AS attrs, MetricName AS source_metric,
           arrayConcat(['_sum', '_count'], arrayResize(['_bucket'], length(BucketCounts), '_bucket')) AS suffixes,
           arrayConcat([Sum, toFloat64(Count)], arrayMap(x -> toFloat64(x), arrayCumSum(BucketCounts))) AS values,
           arrayConcat(['', ''], arrayMap(b -> if(isInfinite(b), '+Inf', toString(b)),
                                          arrayPushBack(ExplicitBounds, inf))) AS les
    FROM otel_metrics_histogram
    WHERE base != '' AND AggregationTemporality != 1
)
ARRAY JOIN suffixes AS suffix, values AS v, les AS le;

CREATE VIEW IF NOT EXISTS engine_intervals AS
SELECT time, service, instance,
       if(row_number() OVER w = 1, NULL, dateDiff('millisecond', lagInFrame(time) OVER w, time) / 1e3) AS seconds,
       num_running, num_waiting, kv_usage, kv_blocks_used, kv_blocks_total, max_num_seqs, gen_throughput,
       prefix_hit_rate, block_size, num_gpu_blocks, cache_dtype, prefix_caching,
       if(row_number() OVER w = 1, NULL,
          if(preemptions_c < lagInFrame(preemptions_c) OVER w, preemptions_c,
             preemptions_c - lagInFrame(preemptions_c) OVER w)) AS preemptions,
       if(row_number() OVER w = 1, NULL,
          if(prefix_queries_c < lagInFrame(prefix_queries_c) OVER w, prefix_queries_c,
             prefix_queries_c - lagInFrame(prefix_queries_c) OVER w)) AS prefix_queries,
       if(row_number() OVER w = 1, NULL,
          if(prefix_hits_c < lagInFrame(prefix_hits_c) OVER w, prefix_hits_c,
             prefix_hits_c - lagInFrame(prefix_hits_c) OVER w)) AS prefix_hits,
       if(row_number() OVER w = 1, NULL,
          if(cached_tokens_c < lagInFrame(cached_tokens_c) OVER w, cached_tokens_c,
             cached_tokens_c - lagInFrame(cached_tokens_c) OVER w)) AS cached_tokens,
       if(row_number() OVER w = 1, NULL,
          if(prompt_tokens_c < lagInFrame(prompt_tokens_c) OVER w, prompt_tokens_c,
             prompt_tokens_c - lagInFrame(prompt_tokens_c) OVER w)) AS prompt_tokens,
       if(row_number() OVER w = 1, NULL,
          if(generation_tokens_c < lagInFrame(generation_tokens_c) OVER w, generation_tokens_c,
             generation_tokens_c - lagInFrame(generation_tokens_c) OVER w)) AS generation_tokens,
       if(row_number() OVER w = 1, NULL,
          if(finished_c < lagInFrame(finished_c) OVER w, finished_c,
             finished_c - lagInFrame(finished_c) OVER w)) AS finished,
       if(row_number() OVER w = 1, NULL,
          if(aborted_c < lagInFrame(aborted_c) OVER w, aborted_c,
             aborted_c - lagInFrame(aborted_c) OVER w)) AS aborted,
       if(row_number() OVER w = 1, NULL,
          if(step_tokens_c < lagInFrame(step_tokens_c) OVER w, step_tokens_c,
             step_tokens_c - lagInFrame(step_tokens_c) OVER w)) AS step_tokens,
       if(row_number() OVER w = 1, NULL,
          if(engine_steps_c < lagInFrame(engine_steps_c) OVER w, engine_steps_c,
             engine_steps_c - lagInFrame(engine_steps_c) OVER w)) AS engine_steps
FROM (
    SELECT service, instance, time,
           sumIfOrNull(value, metric = 'num_running') AS num_running,
           sumIfOrNull(value, metric = 'num_waiting') AS num_waiting,
           avgIfOrNull(value, metric = 'kv_usage') AS kv_usage,
           sumIfOrNull(value, metric = 'kv_blocks_used') AS kv_blocks_used,
           sumIfOrNull(value, metric = 'kv_blocks_total') AS kv_blocks_total,
           maxIfOrNull(value, metric = 'max_num_seqs') AS max_num_seqs,
           sumIfOrNull(value, metric = 'gen_throughput') AS gen_throughput,
           avgIfOrNull(value, metric = 'prefix_hit_rate') AS prefix_hit_rate,
           toUInt32OrZero(anyIf(labels['block_size'], metric = 'cache_config')) AS block_size,
           toUInt64OrZero(anyIf(labels['num_gpu_blocks'], metric = 'cache_config')) AS num_gpu_blocks,
           anyIf(labels['cache_dtype'], metric = 'cache_config') AS cache_dtype,
           lower(anyIf(labels['enable_prefix_caching'], metric = 'cache_config')) IN ('true', '1') AS prefix_caching,
           sumIf(value, metric = 'preemptions_total') AS preemptions_c,
           sumIf(value, metric = 'prefix_queries_total') AS prefix_queries_c,
           sumIf(value, metric = 'prefix_hits_total') AS prefix_hits_c,
           sumIf(value, metric = 'cached_tokens_total') AS cached_tokens_c,
           sumIf(value, metric = 'prompt_tokens_total') AS prompt_tokens_c,
           sumIf(value, metric = 'generation_tokens_total') AS generation_tokens_c,
           sumIf(value, (metric = 'requests_finished_total' AND labels['finished_reason'] != 'abort')
                        OR metric = 'requests_total') AS finished_c,
           sumIf(value, (metric = 'requests_finished_total' AND labels['finished_reason'] = 'abort')
                        OR metric = 'requests_aborted_total') AS aborted_c,
           sumIf(value, metric = 'iteration_tokens_sum') AS step_tokens_c,
           sumIf(value, metric = 'iteration_tokens_count') AS engine_steps_c
    FROM engine_samples
    GROUP BY service, instance, time
    HAVING countIf(metric NOT IN ('up', 'scrape_samples')) > 0
)
WINDOW w AS (PARTITION BY service, instance ORDER BY time ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW);
