-- requests: one row per `llm_request` span, computed by ClickHouse from otel_traces as spans arrive.
-- Reads stepscope's attributes and vLLM's alike (names in instrumentation/attributes.py). Latencies are
-- seconds; a latency the span did not carry is NULL (quantiles skip it), never a made-up zero, except the
-- optional phases (kv_transfer_s) whose absence means "did not happen".

CREATE TABLE IF NOT EXISTS requests (
    time DateTime64(9) CODEC(Delta(8), ZSTD(1)),
    end_time DateTime64(9) CODEC(Delta(8), ZSTD(1)),
    trace_id String CODEC(ZSTD(1)),
    span_id String CODEC(ZSTD(1)),
    service LowCardinality(String),
    instance LowCardinality(String),
    role LowCardinality(String),
    model LowCardinality(String),
    request_id String CODEC(ZSTD(1)),
    ttft_s Nullable(Float64),
    tpot_s Nullable(Float64),
    tpot_max_s Nullable(Float64),
    e2e_s Float64,
    queue_s Nullable(Float64),
    prefill_s Nullable(Float64),
    kv_transfer_s Float64,
    decode_s Nullable(Float64),
    input_tokens UInt32,
    output_tokens UInt32,
    cached_tokens UInt32,
    max_tokens UInt32,
    prefix_key String CODEC(ZSTD(1)),
    finish_reason LowCardinality(String),
    preemptions UInt32,
    itl_count UInt32,
    is_error UInt8,
    status_message String CODEC(ZSTD(1)),
    INDEX idx_trace_id trace_id TYPE bloom_filter(0.001) GRANULARITY 1
) ENGINE = MergeTree
PARTITION BY toDate(time)
ORDER BY (service, time)
{ttl_requests}
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1{dedup};

CREATE MATERIALIZED VIEW IF NOT EXISTS requests_mv TO requests AS
SELECT
    Timestamp AS time,
    addNanoseconds(Timestamp, Duration) AS end_time,
    TraceId AS trace_id,
    SpanId AS span_id,
    ServiceName AS service,
    ResourceAttributes['service.instance.id'] AS instance,
    ResourceAttributes['stepscope.role'] AS role,
    multiIf(ResourceAttributes['stepscope.model'] != '', ResourceAttributes['stepscope.model'],
            SpanAttributes['gen_ai.request.model'] != '', SpanAttributes['gen_ai.request.model'],
            ResourceAttributes['gen_ai.request.model']) AS model,
    SpanAttributes['gen_ai.request.id'] AS request_id,
    toFloat64OrNull(SpanAttributes['gen_ai.latency.time_to_first_token']) AS ttft_s,
    toUInt32OrZero(coalesce(nullIf(SpanAttributes['gen_ai.usage.output_tokens'], ''),
                            SpanAttributes['gen_ai.usage.completion_tokens'])) AS output_tokens,
    toFloat64OrNull(SpanAttributes['gen_ai.latency.time_in_model_decode']) AS decode_s,
    coalesce(toFloat64OrNull(SpanAttributes['stepscope.tpot.mean_s']),
             if(output_tokens > 1, decode_s / (output_tokens - 1), NULL)) AS tpot_s,
    toFloat64OrNull(SpanAttributes['stepscope.tpot.max_s']) AS tpot_max_s,
    coalesce(toFloat64OrNull(SpanAttributes['gen_ai.latency.e2e']), Duration / 1e9) AS e2e_s,
    toFloat64OrNull(SpanAttributes['gen_ai.latency.time_in_queue']) AS queue_s,
    toFloat64OrNull(SpanAttributes['gen_ai.latency.time_in_model_prefill']) AS prefill_s,
    toFloat64OrZero(SpanAttributes['stepscope.latency.kv_transfer_s']) AS kv_transfer_s,
    toUInt32OrZero(coalesce(nullIf(SpanAttributes['gen_ai.usage.input_tokens'], ''),
                            SpanAttributes['gen_ai.usage.prompt_tokens'])) AS input_tokens,
    toUInt32OrZero(SpanAttributes['gen_ai.usage.cache_read.input_tokens']) AS cached_tokens,
    toUInt32OrZero(SpanAttributes['gen_ai.request.max_tokens']) AS max_tokens,
    SpanAttributes['stepscope.prefix_cache.key'] AS prefix_key,
    -- an array attribute arrives as JSON ('["stop"]'); a plain string as itself
    if(startsWith(SpanAttributes['gen_ai.response.finish_reasons'], '['),
       JSONExtractString(SpanAttributes['gen_ai.response.finish_reasons'], 1),
       SpanAttributes['gen_ai.response.finish_reasons']) AS finish_reason,
    toUInt32OrZero(SpanAttributes['stepscope.preemptions']) AS preemptions,
    toUInt32OrZero(SpanAttributes['stepscope.itl.count']) AS itl_count,
    StatusCode = 'STATUS_CODE_ERROR' AS is_error,
    StatusMessage AS status_message
FROM otel_traces
WHERE SpanName = 'llm_request';
