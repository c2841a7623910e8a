-- requests gains the front end's view of the RPC channel: `rpc_delay_s` (mean delay between the core
-- producing a token and the front end receiving it) and `rpc_delay_max_s`, from `stepscope.rpc.delay_mean_s`
-- and `stepscope.rpc.delay_max_s` on `llm_request`; NULL when the span does not carry them. The diagnosis's
-- rpc_overhead rule reads them. A materialized view cannot be altered in place, so requests_mv is dropped
-- and created again with the two columns added (the rest of its SELECT is 003's, unchanged). Every statement
-- is idempotent, so a migration cut short is simply applied again; spans that arrive between the DROP and
-- the CREATE (the collector migrates before it listens) would miss `requests`.

ALTER TABLE requests ADD COLUMN IF NOT EXISTS rpc_delay_s Nullable(Float64);

ALTER TABLE requests ADD COLUMN IF NOT EXISTS rpc_delay_max_s Nullable(Float64);

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
    toFloat64OrNull(SpanAttributes['stepscope.rpc.delay_max_s']) AS rpc_delay_max_s
FROM otel_traces
WHERE SpanName = 'llm_request';
