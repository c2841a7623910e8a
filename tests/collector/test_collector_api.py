"""The read-only query API of a running collector, fed by the SDK exporter."""

from __future__ import annotations

import time

import httpx
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from instrumentation import attributes as A


def send_requests(url: str, n: int) -> list[str]:
    """n llm_request spans (TTFT i/100 s) with a prefill child and an engine.step each; their trace ids."""
    provider = TracerProvider(
        resource=Resource.create({"service.name": "engine", A.RESOURCE_INSTANCE: "e-0"})
    )
    provider.add_span_processor(
        SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{url}/v1/traces", timeout=30))
    )
    tracer = provider.get_tracer("tests.api")
    now, trace_ids = time.time_ns(), []
    for i in range(n):
        attrs = {A.GEN_AI_LATENCY_TTFT: i / 100, A.GEN_AI_LATENCY_E2E: 1.0, A.GEN_AI_USAGE_OUTPUT_TOKENS: 5,
                 A.GEN_AI_LATENCY_DECODE: 0.4, A.GEN_AI_REQUEST_ID: f"r{i}"}  # fmt: skip
        request = tracer.start_span(
            A.SPAN_REQUEST, kind=trace.SpanKind.SERVER, attributes=attrs, start_time=now
        )
        tracer.start_span(A.SPAN_PREFILL, context=trace.set_span_in_context(request), start_time=now).end(
            now + 10
        )
        tracer.start_span(
            A.SPAN_STEP, attributes={A.STEP_ID: i, A.STEP_BATCH_SIZE: i % 4}, start_time=now
        ).end(now + 1000)
        request.end(now + 1_000_000_000)
        trace_ids.append(format(request.get_span_context().trace_id, "032x"))
    provider.shutdown()
    return trace_ids


def test_requests_steps_percentiles_and_a_trace_by_id(start_collector):
    c = start_collector()
    trace_ids = send_requests(c.url, 20)
    assert c.wait_count("SELECT count() FROM requests", 20) == 20
    get = lambda path, **params: httpx.get(f"{c.url}/api/{path}", params=params, timeout=30)  # noqa: E731

    r = get("requests", service="engine", min_ttft_s=0.15, limit=3).json()
    rows = [dict(zip(r["columns"], row, strict=True)) for row in r["rows"]]
    assert len(rows) == 3 and all(row["ttft_s"] >= 0.15 for row in rows)
    assert rows[0]["tpot_s"] == 0.1 and rows[0]["instance"] == "e-0" and rows[0]["time"].endswith("Z")
    assert get("requests", service="nobody").json()["rows"] == []
    assert get("requests", since=time.time() + 3600).json()["rows"] == []

    steps = get("steps", min_batch_size=3).json()
    assert steps["columns"][:2] == ["time", "duration_s"] and len(steps["rows"]) == 5

    series = get("percentiles", interval_s=60).json()
    assert series["columns"][:5] == ["bucket", "requests", "p50_ttft_s", "p90_ttft_s", "p99_ttft_s"]
    assert sum(row[1] for row in series["rows"]) == 20
    assert get("percentiles", metrics="ttft_s;drop").status_code == 400

    spans = get(f"traces/{trace_ids[0]}").json()
    names = spans["rows"]
    assert sorted(row[spans["columns"].index("SpanName")] for row in names) == ["llm_request", "prefill"]
    assert get(f"traces/{'0' * 32}").status_code == 404
    assert get("traces/not-hex").status_code == 400


def test_sql_is_select_only_with_a_row_limit(start_collector):
    c = start_collector("--query-max-rows", "5")
    r = c.sql("SELECT number, toString(number) AS s FROM numbers(100)")
    assert r.status_code == 200
    assert r.json() == {
        "columns": ["number", "s"],
        "rows": [[i, str(i)] for i in range(5)],
        "truncated": True,
    }
    for statement in ("DROP TABLE otel_traces", "CREATE TABLE x (a Int8) ENGINE = Memory",
                      "INSERT INTO otel_traces (SpanName) VALUES ('x')", "SELECT * FROM url('http://127.0.0.1:1/')",
                      "SELECT nonsense FROM nowhere"):  # fmt: skip
        r = c.sql(statement)
        assert r.status_code == 400 and r.json()["error"], statement
    assert c.sql("SELECT count() FROM otel_traces").json()["rows"] == [[0]]
    params = httpx.post(f"{c.url}/api/sql", json={"sql": "SELECT {n:UInt8} + 1", "params": {"n": 41}})
    assert params.json()["rows"] == [[42]]
    assert httpx.post(f"{c.url}/api/sql", json={"query": "SELECT 1"}).status_code == 422


def test_readers_answer_the_same_through_the_api_and_from_the_directory(start_collector, tmp_path):
    from collector.client import open_reader

    c = start_collector()
    send_requests(c.url, 3)
    assert c.wait_count("SELECT count() FROM requests", 3) == 3
    sql, params = (
        "SELECT request_id FROM requests WHERE ttft_s >= {t:Float64} ORDER BY request_id",
        {"t": 0.01},
    )
    via_api = open_reader(url=c.url)
    assert via_api.query(sql, params).rows == [["r1"], ["r2"]]
    via_api.close()
    c.stop()
    direct = open_reader(store=f"chdb://{tmp_path / 'data'}")
    try:
        assert direct.query(sql, params).rows == [["r1"], ["r2"]]
    finally:
        direct.close()
