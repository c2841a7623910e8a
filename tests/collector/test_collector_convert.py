"""Spans -> otel_traces rows (collector/traces.py): the exporter's encodings survive the Arrow path, one
request at a time and merged, and impossible input is refused rather than stored wrongly."""

from __future__ import annotations

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue

from collector import convert, otlp
from collector.store import Store

ROWS_SQL = (
    "SELECT * EXCEPT (ResourceAttributeItems, SpanAttributeItems) FROM otel_traces "
    "ORDER BY TraceId, SpanId, Timestamp"
)


def _kv(key: str, **value: object) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(**value))


def _request(resources: int = 2, scopes: int = 2, spans: int = 4) -> ExportTraceServiceRequest:
    """Several resources and scopes that repeat a service name and a scope version, every span kind and
    status code (and one OTLP does not define), events, links, a repeated attribute key."""
    req = ExportTraceServiceRequest()
    for r in range(resources):
        rs = req.resource_spans.add()
        rs.resource.attributes.extend([_kv("service.name", string_value="engine"), _kv("host", int_value=r)])
        for s in range(scopes):
            ss = rs.scope_spans.add()
            ss.scope.name, ss.scope.version = f"scope-{s}", "1.0"
            for i in range(spans):
                span = ss.spans.add()
                span.trace_id, span.span_id = bytes([r + 1] * 16), bytes([s * spans + i + 1] * 8)
                span.parent_span_id = bytes(8) if i == 0 else bytes([99] * 8)
                span.name, span.kind = f"op-{i}", (i if i < 3 else 9)
                span.start_time_unix_nano = 1_700_000_000_000_000_000 + i
                span.end_time_unix_nano = span.start_time_unix_nano + 1000 * i
                span.status.code, span.status.message = i % 3, "boom" if i % 3 == 2 else ""
                span.attributes.extend(
                    [
                        _kv("x", double_value=[2.0, 1e-7, 0.5, float("inf")][i]),
                        _kv("on", bool_value=True),
                        _kv("names", array_value=ArrayValue(values=[AnyValue(string_value="stop")])),
                        _kv("dup", int_value=1),
                        _kv("dup", int_value=2),
                    ]
                )
                if i % 2:
                    event = span.events.add()
                    event.name, event.time_unix_nano = "first_token", span.start_time_unix_nano + 5
                    event.attributes.append(_kv("k", int_value=1))
                    link = span.links.add()
                    link.trace_id, link.span_id, link.trace_state = bytes([7] * 16), bytes([8] * 8), "a=b"
                    link.attributes.append(_kv("w", int_value=1))
    return req


def test_spans_are_rows_with_the_exporters_encodings():
    batch = convert.traces(_request(resources=1, scopes=1))
    rows = batch.tables["otel_traces"].to_pylist()
    assert batch.rows("otel_traces") == 4 and batch.rejected == 0
    first, second, _, fourth = rows
    assert (first["SpanKind"], second["SpanKind"], fourth["SpanKind"]) == (
        "SPAN_KIND_UNSPECIFIED",
        "SPAN_KIND_INTERNAL",
        "",
    )
    assert (first["StatusCode"], rows[2]["StatusCode"], rows[2]["StatusMessage"]) == (
        "STATUS_CODE_UNSET",
        "STATUS_CODE_ERROR",
        "boom",
    )
    assert first["ParentSpanId"] == "" and second["ParentSpanId"] == "63" * 8
    assert dict(first["SpanAttributes"]) == {"x": "2", "on": "true", "names": '["stop"]', "dup": "2"}
    assert [dict(r["SpanAttributes"])["x"] for r in rows] == ["2", "1e-7", "0.5", "+Inf"]
    assert dict(first["ResourceAttributes"]) == {"service.name": "engine", "host": "0"}
    assert (first["ServiceName"], first["ScopeName"], first["ScopeVersion"]) == ("engine", "scope-0", "1.0")
    assert second["Events.Name"] == ["first_token"] and [dict(a) for a in second["Events.Attributes"]] == [
        {"k": "1"}
    ]
    assert second["Links.SpanId"] == ["08" * 8] and second["Links.TraceState"] == ["a=b"]
    assert first["Events.Name"] == [] and first["Links.TraceId"] == []
    assert [r["Duration"] for r in rows] == [0, 1000, 2000, 3000]


def test_batches_merged_into_one_insert_store_the_same_rows_as_one_insert_each():
    requests = [_request(), _request(resources=1, scopes=3)]
    requests[1].resource_spans[0].resource.attributes[0].value.string_value = "router"
    for rs in requests[1].resource_spans:
        for ss in rs.scope_spans:
            for span in ss.spans:
                span.trace_id = bytes([42] * 16)
    batches = [convert.traces(r) for r in requests]
    with Store.open("chdb://memory") as store:
        for i, batch in enumerate(batches):
            store.insert(
                "otel_traces", batch.columns["otel_traces"], batch.tables["otel_traces"], token=f"one-{i}"
            )
        one_each = store.query(ROWS_SQL).rows
        store.command("TRUNCATE TABLE otel_traces")
        merged = convert.merge(batches)
        store.insert(
            "otel_traces", merged.columns["otel_traces"], merged.tables["otel_traces"], token="merged"
        )
        assert store.query(ROWS_SQL).rows == one_each
        assert len(one_each) == 16 + 12
        assert store.query("SELECT DISTINCT ServiceName FROM otel_traces ORDER BY 1").rows == [
            ["engine"],
            ["router"],
        ]


def test_spans_without_valid_ids_are_counted_and_left_out():
    req = _request(resources=1, scopes=1)
    req.resource_spans[0].scope_spans[0].spans[1].trace_id = bytes(16)
    req.resource_spans[0].scope_spans[0].spans[2].span_id = b"\x01"
    batch = convert.traces(req)
    assert batch.rows("otel_traces") == 2 and batch.rejected == 2 and "2 span(s)" in batch.error_message


def test_a_span_time_past_datetime64s_range_is_a_payload_error():
    req = _request(resources=1, scopes=1, spans=1)
    req.resource_spans[0].scope_spans[0].spans[0].start_time_unix_nano = 2**64 - 1
    with pytest.raises(otlp.PayloadError, match="2262"):
        convert.traces(req)
