-- alerts: the history of alert rule states (alerting/, `stepscope collector --alert-rules`). One row per
-- transition: inactive -> pending, pending -> inactive, pending -> firing, firing -> resolved. `value` is
-- the observed value (seconds, requests/s, a fraction, or burn rate over its factor), `active_at` when the
-- breach was first seen, `details` a JSON object (summary, breakdown, top findings, windows).

CREATE TABLE IF NOT EXISTS alerts (
    time DateTime64(3),
    rule LowCardinality(String),
    state LowCardinality(String),
    previous LowCardinality(String),
    severity LowCardinality(String),
    metric LowCardinality(String),
    value Nullable(Float64),
    threshold Float64,
    requests UInt64,
    active_at Nullable(DateTime64(3)),
    labels Map(String, String),
    summary String CODEC(ZSTD(1)),
    details String CODEC(ZSTD(1))
) ENGINE = MergeTree
PARTITION BY toYYYYMM(time)
ORDER BY (rule, time)
SETTINGS index_granularity = 8192;
