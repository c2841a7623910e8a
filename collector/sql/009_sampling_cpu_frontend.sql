-- What sampling kept, and where the time of a step and of the front end went.
-- requests gains `frontend_s` (HTTP receipt -> the core's queue: parsing, tokenizing), `loop_lag_s` (the
-- front end's worst event-loop lag while the request was open), `sample_weight` (how many requests the
-- row stands for: 1 / the head-sampling ratio, 1 for requests kept because they were slow or failed) and
-- `sampling_reason` (head | slow | error). steps gains `cpu_s` (the stepping thread's CPU time over the
-- step; NULL when not recorded), `sample_every` (the N of 1-in-N step sampling in force, 1 when not
-- said) and `max_num_batched_tokens` (the token budget in force, 0 when not said). Both views are dropped and created again with the columns added (the rest of their SELECTs is
-- 004's and 005's, unchanged); every statement is idempotent.

ALTER TABLE requests ADD COLUMN IF NOT EXISTS frontend_s Nullable(Float64);

ALTER TABLE requests ADD COLUMN IF NOT EXISTS loop_lag_s Nullable(Float64);

ALTER TABLE requests ADD COLUMN IF NOT EXISTS sample_weight Float64 DEFAULT 1;

ALTER TABLE requests ADD COLUMN IF NOT EXISTS sampling_reason LowCardinality(String);

ALTER TABLE steps ADD COLUMN IF NOT EXISTS cpu_s Nullable(Float64);

ALTER TABLE steps ADD COLUMN IF NOT EXISTS sample_every UInt32 DEFAULT 1;

ALTER TABLE steps ADD COLUMN IF NOT EXISTS max_num_batched_tokens UInt32 DEFAULT 0;

DROP VIEW IF EXISTS requests_mv;

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
    StatusMessage AS status_message,
    toFloat64OrNull(SpanAttributes['stepscope.rpc.delay_mean_s']) AS rpc_delay_s,
    toFloat64OrNull(SpanAttributes['stepscope.rpc.delay_max_s']) AS rpc_delay_max_s,
    toFloat64OrNull(SpanAttributes['stepscope.latency.frontend_s']) AS frontend_s,
    toFloat64OrNull(SpanAttributes['stepscope.frontend.loop_lag_s']) AS loop_lag_s,
    greatest(coalesce(toFloat64OrNull(SpanAttributes['stepscope.sampling.weight']), 1.0), 1.0) AS sample_weight,
    SpanAttributes['stepscope.sampling.reason'] AS sampling_reason
FROM otel_traces
WHERE SpanName = 'llm_request';

DROP VIEW IF EXISTS steps_mv;

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
         'Map(LowCardinality(String), Float64)') AS counters,
    toFloat64OrNull(SpanAttributes['stepscope.step.cpu_s']) AS cpu_s,
    greatest(toUInt32OrZero(SpanAttributes['stepscope.step.sampled_every']), 1) AS sample_every,
    toUInt32OrZero(SpanAttributes['stepscope.step.max_num_batched_tokens']) AS max_num_batched_tokens
FROM otel_traces
WHERE SpanName = 'engine.step';
