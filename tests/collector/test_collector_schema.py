"""The schema: exporter-compatible otel_traces, idempotent migrations, and the requests/steps views."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from collector import convert, otlp
from collector.store import QueryError, Store, migrations
from instrumentation import attributes as A

# The OpenTelemetry Collector contrib ClickHouse exporter's default traces table
# (exporter/clickhouseexporter/internal/sqltemplates/traces_table.sql), column by column.
EXPORTER_TRACES_COLUMNS = [
    ("Timestamp", "DateTime64(9)"),
    ("TraceId", "String"),
    ("SpanId", "String"),
    ("ParentSpanId", "String"),
    ("TraceState", "String"),
    ("SpanName", "LowCardinality(String)"),
    ("SpanKind", "LowCardinality(String)"),
    ("ServiceName", "LowCardinality(String)"),
    ("ResourceAttributes", "Map(LowCardinality(String), String)"),
    ("ScopeName", "String"),
    ("ScopeVersion", "String"),
    ("SpanAttributes", "Map(LowCardinality(String), String)"),
    ("Duration", "UInt64"),
    ("StatusCode", "LowCardinality(String)"),
    ("StatusMessage", "String"),
    ("Events.Timestamp", "Array(DateTime64(9))"),
    ("Events.Name", "Array(LowCardinality(String))"),
    ("Events.Attributes", "Array(Map(LowCardinality(String), String))"),
    ("Links.TraceId", "Array(String)"),
    ("Links.SpanId", "Array(String)"),
    ("Links.TraceState", "Array(String)"),
    ("Links.Attributes", "Array(Map(LowCardinality(String), String))"),
    ("ResourceAttributeItems", "Array(String)"),
    ("SpanAttributeItems", "Array(String)"),
]


@pytest.fixture
def store(tmp_path):
    with Store.open(f"chdb://{tmp_path / 'db'}") as s:
        yield s


def test_otel_traces_has_the_exporters_columns_types_keys_and_indexes(store):
    assert store.query(
        "SELECT name, type FROM system.columns WHERE database = currentDatabase() AND table = 'otel_traces' "
        "ORDER BY position"
    ).rows == [list(c) for c in EXPORTER_TRACES_COLUMNS]
    keys = store.query(
        "SELECT partition_key, sorting_key, primary_key FROM system.tables "
        "WHERE database = currentDatabase() AND name = 'otel_traces'"
    ).rows[0]
    assert keys == [
        "toDate(Timestamp)",
        "ServiceName, SpanName, toDateTime(Timestamp), Timestamp",
        "ServiceName, SpanName, toDateTime(Timestamp)",
    ]
    indexes = store.query(
        "SELECT name FROM system.data_skipping_indices WHERE table = 'otel_traces' ORDER BY name"
    ).rows
    assert [r[0] for r in indexes] == [
        "idx_duration", "idx_lower_span_name", "idx_res_attr_key", "idx_res_attr_value",
        "idx_span_attr_key", "idx_span_attr_value", "idx_trace_id",
    ]  # fmt: skip
    lookup = store.query("SELECT name, type FROM system.columns WHERE table = 'otel_traces_trace_id_ts'").rows
    assert lookup == [
        ["TraceId", "String"],
        ["Start", "SimpleAggregateFunction(min, DateTime)"],
        ["End", "SimpleAggregateFunction(max, DateTime)"],
    ]


def test_migrations_are_versioned_and_applying_them_again_changes_nothing(store):
    tables = store.query(
        "SELECT name FROM system.tables WHERE database = currentDatabase() ORDER BY name"
    ).rows
    assert store.migrate() == []
    shipped = migrations()  # every collector/sql/NNN_*.sql, whoever added it
    assert store.schema_version() == shipped[-1][0]
    assert store.query("SELECT count(), uniqExact(version) FROM stepscope_schema_migrations").rows == [
        [len(shipped), len(shipped)]
    ]
    assert (
        store.query("SELECT name FROM system.tables WHERE database = currentDatabase() ORDER BY name").rows
        == tables
    )


def test_ttl_days_sets_a_ttl_on_new_tables(tmp_path):
    with Store.open(f"chdb://{tmp_path / 'ttl'}", ttl_days=7) as s:
        ddl = s.query("SELECT create_table_query FROM system.tables WHERE name = 'otel_traces'").rows[0][0]
        assert "TTL toDateTime(Timestamp) + toIntervalDay(7)" in ddl


def _ingest(store: Store, spans: list) -> None:
    batch = convert.traces(otlp.parse_canonical("traces", encode_spans(spans).SerializeToString()))
    store.insert("otel_traces", batch.columns["otel_traces"], batch.tables["otel_traces"])


def _tracer(resource: dict) -> tuple:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create(resource))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    return provider.get_tracer("t"), memory


def test_requests_fill_from_stepscope_spans_and_from_vllm_shaped_spans(store):
    resource = {"service.name": "engine", A.RESOURCE_INSTANCE: "e-0", A.RESOURCE_ROLE: "prefill"}
    tracer, memory = _tracer(resource | {A.RESOURCE_MODEL: "tiny"})
    ours = {
        A.GEN_AI_REQUEST_ID: "r1", A.GEN_AI_LATENCY_TTFT: 0.25, A.GEN_AI_LATENCY_E2E: 2.0,
        A.GEN_AI_LATENCY_QUEUE: 0.05, A.GEN_AI_LATENCY_PREFILL: 0.2, A.GEN_AI_LATENCY_DECODE: 1.75,
        A.GEN_AI_USAGE_INPUT_TOKENS: 100, A.GEN_AI_USAGE_OUTPUT_TOKENS: 8,
        A.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: 64, A.GEN_AI_RESPONSE_FINISH_REASONS: ["length"],
        A.PREFIX_KEY: "abc", A.PREEMPTIONS: 2, A.TPOT_MEAN_S: 0.2, A.KV_TRANSFER_S: 0.01, A.ITL_COUNT: 7,
    }  # fmt: skip
    tracer.start_span(A.SPAN_REQUEST, kind=trace.SpanKind.SERVER, attributes=ours).end()
    _ingest(store, memory.get_finished_spans())
    # vLLM: gen_ai.latency.* only, the older token names, the model on the span, no stepscope resource
    tracer, memory = _tracer({"service.name": "vllm"})
    vllm = {
        A.GEN_AI_REQUEST_ID: "v1", A.GEN_AI_REQUEST_MODEL: "meta-llama/Llama-3", A.GEN_AI_LATENCY_TTFT: 0.1,
        A.GEN_AI_LATENCY_E2E: 1.1, A.GEN_AI_LATENCY_QUEUE: 0.01, A.GEN_AI_LATENCY_PREFILL: 0.09,
        A.GEN_AI_LATENCY_DECODE: 1.0, A.GEN_AI_USAGE_PROMPT_TOKENS: 10, A.GEN_AI_USAGE_COMPLETION_TOKENS: 11,
        A.GEN_AI_RESPONSE_FINISH_REASONS: ["stop"],
    }  # fmt: skip
    span = tracer.start_span(A.SPAN_REQUEST, kind=trace.SpanKind.SERVER, attributes=vllm)
    span.set_status(trace.Status(trace.StatusCode.ERROR, "aborted"))
    span.end()
    tracer.start_span(A.SPAN_PREFILL).end()  # not a request
    _ingest(store, memory.get_finished_spans())

    rows = {r["request_id"]: r for r in store.query("SELECT * FROM requests").dicts()}
    assert set(rows) == {"r1", "v1"}
    r1, v1 = rows["r1"], rows["v1"]
    assert (r1["service"], r1["instance"], r1["role"], r1["model"]) == ("engine", "e-0", "prefill", "tiny")
    assert (r1["ttft_s"], r1["tpot_s"], r1["e2e_s"], r1["queue_s"], r1["prefill_s"]) == (
        0.25,
        0.2,
        2.0,
        0.05,
        0.2,
    )
    assert (r1["decode_s"], r1["kv_transfer_s"], r1["input_tokens"], r1["output_tokens"]) == (
        1.75,
        0.01,
        100,
        8,
    )
    assert (r1["cached_tokens"], r1["prefix_key"], r1["finish_reason"], r1["preemptions"]) == (
        64,
        "abc",
        "length",
        2,
    )
    assert (v1["model"], v1["input_tokens"], v1["output_tokens"], v1["finish_reason"]) == (
        "meta-llama/Llama-3",
        10,
        11,
        "stop",
    )
    assert v1["tpot_s"] == pytest.approx(1.0 / 10) and v1["ttft_s"] == 0.1 and v1["is_error"] == 1
    assert (v1["role"], v1["kv_transfer_s"], v1["status_message"]) == ("", 0.0, "aborted")


def test_steps_hold_engine_step_attributes_as_typed_columns(store):
    tracer, memory = _tracer(
        {"service.name": "engine", A.RESOURCE_INSTANCE: "e-1", A.RESOURCE_ROLE: "decode"}
    )
    attributes = {
        A.STEP_ID: 41, A.STEP_NUM_RUNNING: 7, A.STEP_NUM_WAITING: 3, A.STEP_BATCH_SIZE: 7,
        A.STEP_PREFILL_TOKENS: 256, A.STEP_DECODE_TOKENS: 6, A.STEP_KV_BLOCKS_USED: 90,
        A.STEP_KV_BLOCKS_FREE: 10, A.STEP_KV_BLOCKS_TOTAL: 100, A.STEP_PREEMPTIONS: 1,
        A.STEP_PREFIX_HIT_TOKENS: 32,
        A.STEP_WEIGHT_DTYPE: "int8", A.STEP_KV_DTYPE: "bfloat16", A.STEP_CHUNKED_PREFILL: True,
        A.STEP_MAX_NUM_SEQS: 64, A.STEP_GAP_S: 0.002, A.STEP_BYTES_READ: 5_000_000_000,
        A.STEP_CPU_S: 0.004, A.STEP_SAMPLED_EVERY: 4, A.STEP_MAX_NUM_BATCHED_TOKENS: 512,
        "stepscope.gpu.sm_util": 87.5, "stepscope.host.rss_bytes": 123, "other": "x",
    }  # fmt: skip
    tracer.start_span(A.SPAN_STEP, attributes=attributes, start_time=1_000).end(end_time=5_001_000)
    _ingest(store, memory.get_finished_spans())
    (row,) = store.query("SELECT * EXCEPT (time, trace_id, span_id) FROM steps").dicts()
    assert row == {
        "duration_s": 0.005, "service": "engine", "instance": "e-1", "role": "decode", "model": "",
        "step_id": 41,
        "num_running": 7, "num_waiting": 3, "batch_size": 7, "prefill_tokens": 256, "decode_tokens": 6,
        "kv_blocks_used": 90, "kv_blocks_free": 10, "kv_blocks_total": 100, "preemptions": 1,
        "prefix_hit_tokens": 32, "weight_dtype": "int8", "kv_dtype": "bfloat16", "chunked_prefill": 1,
        "max_num_seqs": 64, "gap_s": 0.002, "bytes_read": 5_000_000_000, "num_links": 0,
        "counters": {"stepscope.gpu.sm_util": 87.5, "stepscope.host.rss_bytes": 123.0},
        "cpu_s": 0.004, "sample_every": 4, "max_num_batched_tokens": 512,
    }  # fmt: skip


def test_readonly_queries_refuse_writes_ddl_and_file_access(store):
    for sql in ("DROP TABLE otel_traces", "INSERT INTO requests (trace_id) VALUES ('x')",
                "SELECT * FROM file('/etc/hostname', 'LineAsString')", "SELECT 1 SETTINGS readonly = 0",
                "SELEC 1"):  # fmt: skip
        with pytest.raises(QueryError):
            store.query_readonly(sql)
    result = store.query_readonly("SELECT number FROM numbers(50)", max_rows=10)
    assert result.truncated and len(result.rows) == 10
    assert store.query("SELECT count() FROM otel_traces").rows == [[0]]


@pytest.mark.parametrize(
    ("value", "text"),
    [(1.0, "1"), (0.5, "0.5"), (-2.25, "-2.25"), (1e-7, "1e-7"), (1e21, "1e+21"),
     (1e20, "100000000000000000000"), (637.704, "637.704"), (float("nan"), "NaN"), (float("-inf"), "-Inf")],
)  # fmt: skip
def test_doubles_are_spelled_as_the_exporter_spells_them(value, text):
    assert convert.float_str(value) == text
