"""OTLP/HTTP ingest into a running collector: the SDK exporter, the specification's examples, bad input."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import httpx
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Status, StatusCode

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "otlp"


def test_sdk_exporter_spans_are_stored_with_the_exporters_encodings(start_collector):
    c = start_collector()
    provider = TracerProvider(
        resource=Resource.create({"service.name": "sdk-test", "service.instance.id": "i-1"})
    )
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{c.url}/v1/traces", timeout=30))
    )
    tracer = provider.get_tracer("tests.collector", "1.2.3")
    with tracer.start_as_current_span("parent", kind=trace.SpanKind.SERVER) as parent:
        parent.set_attributes({"flag": True, "n": 3, "x": 0.5, "whole": 2.0, "names": ["a", "b"]})
        parent.add_event("first_token", {"k": 1})
        parent.set_status(Status(StatusCode.ERROR, "boom"))
        with tracer.start_as_current_span("child", links=[trace.Link(parent.get_span_context(), {"w": 1})]):
            pass
    for i in range(300):
        with tracer.start_as_current_span("bulk", attributes={"i": i}):
            pass
    assert provider.force_flush(30_000)
    provider.shutdown()

    assert c.wait_count("SELECT count() FROM otel_traces WHERE ServiceName = 'sdk-test'", 302) == 302
    row = c.sql(
        "SELECT SpanKind, StatusCode, StatusMessage, SpanAttributes, ScopeName, ScopeVersion, TraceId, "
        "SpanId, ParentSpanId, Events.Name, Events.Attributes, Duration > 0, "
        "ResourceAttributes['service.instance.id'] FROM otel_traces WHERE SpanName = 'parent'"
    ).json()["rows"][0]
    (
        kind,
        code,
        message,
        attrs,
        scope,
        version,
        trace_id,
        span_id,
        parent_id,
        events,
        event_attrs,
        dur,
        inst,
    ) = row
    assert (kind, code, message, scope, version) == (
        "SPAN_KIND_SERVER",
        "STATUS_CODE_ERROR",
        "boom",
        "tests.collector",
        "1.2.3",
    )
    assert attrs == {"flag": "true", "n": "3", "x": "0.5", "whole": "2", "names": '["a","b"]'}
    assert trace_id == format(parent.get_span_context().trace_id, "032x")
    assert span_id == format(parent.get_span_context().span_id, "016x") and parent_id == ""
    assert events == ["first_token"] and event_attrs == [{"k": "1"}] and dur == 1 and inst == "i-1"
    child = c.sql(
        "SELECT ParentSpanId, Links.SpanId, Links.Attributes, SpanKind FROM otel_traces "
        "WHERE SpanName = 'child'"
    )
    assert child.json()["rows"][0] == [span_id, [span_id], [{"w": "1"}], "SPAN_KIND_INTERNAL"]


def test_specification_examples_ingest_as_json_and_as_gzipped_protobuf(start_collector):
    c = start_collector()
    for signal in ("traces", "metrics", "logs"):
        body = (FIXTURES / f"{signal}.json" if signal != "traces" else FIXTURES / "trace.json").read_bytes()
        r = httpx.post(f"{c.url}/v1/{signal}", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("application/json") and r.json() == {}
    # the same trace again, as gzipped protobuf: the hex ids must decode to the same bytes
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    from collector import otlp

    message = otlp.decode("traces", (FIXTURES / "trace.json").read_bytes(), otlp.JSON).message
    message.resource_spans[0].resource.attributes[0].value.string_value = "proto.service"
    body = gzip.compress(message.SerializeToString())
    headers = {"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"}
    r = httpx.post(f"{c.url}/v1/traces", content=body, headers=headers)
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-protobuf"
    assert not ExportTraceServiceResponse.FromString(r.content).HasField("partial_success")

    assert c.wait_count("SELECT count() FROM otel_traces", 2) == 2
    ids = c.sql("SELECT DISTINCT TraceId, SpanId, ParentSpanId, SpanKind, Duration FROM otel_traces").json()[
        "rows"
    ]
    assert ids == [
        [
            "5b8efff798038103d269b633813fc60c",
            "eee19b7ec3c1b174",
            "eee19b7ec3c1b173",
            "SPAN_KIND_SERVER",
            10**9,
        ]
    ]
    tables = {
        "otel_metrics_sum": "my.counter",
        "otel_metrics_gauge": "my.gauge",
        "otel_metrics_histogram": "my.histogram",
        "otel_metrics_exponential_histogram": "my.exponential.histogram",
    }
    for table, name in tables.items():
        assert c.scalar(f"SELECT groupArray(MetricName) FROM {table}") == [name]
    assert c.scalar("SELECT LogAttributes['double.attribute'] FROM otel_logs") == "637.704"


def test_bad_input_gets_4xx_with_a_message_and_stores_nothing(start_collector):
    c = start_collector("--max-body-bytes", "1000000")
    url = f"{c.url}/v1/traces"
    spec = (FIXTURES / "trace.json").read_bytes()
    cases = [
        (b"\x0a\xff\xff\xff\xff\x0f garbage", "application/x-protobuf", None, 400),
        (b'{"resourceSpans": 5}', "application/json", None, 400),
        (b"not json", "application/json", None, 400),
        (b"[1, 2]", "application/json", None, 400),
        (spec.replace(b"5B8EFFF7", b"ZZZZZZZZ"), "application/json", None, 400),
        (b"\x1f\x8b\x08 not gzip", "application/x-protobuf", "gzip", 400),
        (spec, "text/plain", None, 415),
        (spec, "application/json", "br", 415),
        (b"\0" * 2_000_000, "application/x-protobuf", None, 413),
        (gzip.compress(b"\0" * 3_000_000), "application/x-protobuf", "gzip", 413),
    ]
    for body, ctype, encoding, status in cases:
        headers = {"Content-Type": ctype} | ({"Content-Encoding": encoding} if encoding else {})
        r = httpx.post(url, content=body, headers=headers, timeout=60)
        assert r.status_code == status, (body[:30], r.status_code, r.text)
        assert _status_message(r) and "Traceback" not in _status_message(r)
    assert (
        httpx.post(
            f"{c.url}/v1/profiles", content=spec, headers={"Content-Type": "application/json"}
        ).status_code
        == 404
    )
    assert c.scalar("SELECT count() FROM otel_traces") == 0
    assert c.health()["spooled_batches"] == 0


def test_spans_without_valid_ids_are_rejected_in_partial_success_and_the_rest_stored(start_collector):
    c = start_collector()
    doc = json.loads((FIXTURES / "trace.json").read_text())
    spans = doc["resourceSpans"][0]["scopeSpans"][0]["spans"]
    spans.append(dict(spans[0], traceId="", spanId="0000000000000001", name="no trace id"))
    spans.append(dict(spans[0], spanId="EEE19B7EC3C1B175", name="good"))
    r = httpx.post(f"{c.url}/v1/traces", json=doc)
    assert r.status_code == 200
    assert (
        r.json()["partialSuccess"]["rejectedSpans"] == "1"
        and "trace id" in r.json()["partialSuccess"]["errorMessage"]
    )
    assert c.wait_count("SELECT count() FROM otel_traces", 2) == 2
    assert c.scalar("SELECT countIf(SpanName = 'no trace id') FROM otel_traces") == 0


def test_a_token_locks_ingest_and_queries_but_not_health(start_collector):
    c = start_collector(token="s3cret")
    body = (FIXTURES / "trace.json").read_bytes()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        r = httpx.post(
            f"{c.url}/v1/traces", content=body, headers={"Content-Type": "application/json", **headers}
        )
        assert r.status_code == 401
        assert httpx.post(f"{c.url}/api/sql", json={"sql": "SELECT 1"}, headers=headers).status_code == 401
        assert httpx.get(f"{c.url}/api/requests", headers=headers).status_code == 401
    assert httpx.get(f"{c.url}/health").status_code == 200
    ok = {"Content-Type": "application/json", "Authorization": "Bearer s3cret"}
    assert httpx.post(f"{c.url}/v1/traces", content=body, headers=ok).status_code == 200
    assert c.wait_count("SELECT count() FROM otel_traces", 1) == 1


def _status_message(r: httpx.Response) -> str:
    """The google.rpc.Status message of an OTLP error answer, in the request's encoding."""
    from google.rpc.status_pb2 import Status

    if r.headers["content-type"].startswith("application/x-protobuf"):
        return Status.FromString(r.content).message
    return r.json()["message"]
