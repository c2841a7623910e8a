-- steps: one row per `engine.step` span, its attributes as typed columns, computed by ClickHouse from
-- otel_traces. GPU and host counters (any attribute under stepscope.gpu. or stepscope.host.) stay in
-- `counters`, as numbers.

CREATE TABLE IF NOT EXISTS steps (
    time DateTime64(9) CODEC(Delta(8), ZSTD(1)),
    duration_s Float64,
    trace_id String CODEC(ZSTD(1)),
    span_id String CODEC(ZSTD(1)),
    service LowCardinality(String),
    instance LowCardinality(String),
    role LowCardinality(String),
    model LowCardinality(String),
    step_id UInt64,
    num_running UInt32,
    num_waiting UInt32,
    batch_size UInt32,
    prefill_tokens UInt32,
    decode_tokens UInt32,
    kv_blocks_used UInt32,
    kv_blocks_free UInt32,
    kv_blocks_total UInt32,
    preemptions UInt32,
    prefix_hit_tokens UInt32,
    weight_dtype LowCardinality(String),
    kv_dtype LowCardinality(String),
    chunked_prefill UInt8,
    max_num_seqs UInt32,
    gap_s Float64,
    bytes_read UInt64,
    num_links UInt32,
    counters Map(LowCardinality(String), Float64)
) ENGINE = MergeTree
PARTITION BY toDate(time)
ORDER BY (service, instance, time)
{ttl_steps}
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1{dedup};

CREATE MATERIALIZED VIEW IF NOT EXISTS steps_mv TO steps AS
SELECT
    Timestamp AS time,
    Duration / 1e9 AS duration_s,
    TraceId AS trace_id,
    SpanId AS span_id,
    ServiceName AS service,
    ResourceAttributes['service.instance.id'] AS instance,
    ResourceAttributes['stepscope.role'] AS role,
    ResourceAttributes['stepscope.model'] AS model,
    toUInt64OrZero(SpanAttributes['stepscope.step.id']) AS step_id,
    toUInt32OrZero(SpanAttributes['stepscope.step.num_running']) AS num_running,
    toUInt32OrZero(SpanAttributes['stepscope.step.num_waiting']) AS num_waiting,
    toUInt32OrZero(SpanAttributes['stepscope.step.batch_size']) AS batch_size,
    toUInt32OrZero(SpanAttributes['stepscope.step.prefill_tokens']) AS prefill_tokens,
    toUInt32OrZero(SpanAttributes['stepscope.step.decode_tokens']) AS decode_tokens,
    toUInt32OrZero(SpanAttributes['stepscope.step.kv_blocks_used']) AS kv_blocks_used,
    toUInt32OrZero(SpanAttributes['stepscope.step.kv_blocks_free']) AS kv_blocks_free,
    toUInt32OrZero(SpanAttributes['stepscope.step.kv_blocks_total']) AS kv_blocks_total,
    toUInt32OrZero(SpanAttributes['stepscope.step.preemptions']) AS preemptions,
    toUInt32OrZero(SpanAttributes['stepscope.step.prefix_cache_hit_tokens']) AS prefix_hit_tokens,
    SpanAttributes['stepscope.step.weight_dtype'] AS weight_dtype,
    SpanAttributes['stepscope.step.kv_dtype'] AS kv_dtype,
    SpanAttributes['stepscope.step.chunked_prefill'] IN ('true', '1') AS chunked_prefill,
    toUInt32OrZero(SpanAttributes['stepscope.step.max_num_seqs']) AS max_num_seqs,
    toFloat64OrZero(SpanAttributes['stepscope.step.gap_s']) AS gap_s,
    toUInt64OrZero(SpanAttributes['stepscope.step.bytes_read']) AS bytes_read,
    length(Links.SpanId) AS num_links,
    CAST(mapApply((k, v) -> (k, toFloat64OrZero(v)),
                  mapFilter((k, v) -> startsWith(k, 'stepscope.gpu.') OR startsWith(k, 'stepscope.host.'),
                            SpanAttributes)),
         'Map(LowCardinality(String), Float64)') AS counters
FROM otel_traces
WHERE SpanName = 'engine.step';
