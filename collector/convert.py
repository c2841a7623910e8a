"""Export requests -> row batches for the exporter-compatible tables, with the exporter's value encodings.

Encodings follow the OpenTelemetry Collector ClickHouse exporter: ids as lowercase hex ("" when empty),
`SpanKind` as `SPAN_KIND_SERVER` and friends, `StatusCode` as `STATUS_CODE_OK`..., `Duration` in ns,
attribute values as pdata's `Value.AsString()` (collector/values.py).

Traces, the bulk of what stepscope sends, become an Arrow table: through the compiled decoder
(collector/spans.py) where a C compiler is found, else in Python (collector/traces.py), to the same rows.
Metrics and logs become Python lists per column (one list per column, no dict per row).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import pyarrow as pa
from google.protobuf.message import DecodeError

from collector import spans
from collector.otlp import PayloadError
from collector.traces import SPAN_KINDS, STATUS_CODES, TRACE_COLUMNS, RawTraceRequest, spans_table
from collector.values import ZERO_SPAN, ZERO_TRACE, attrs, float_str, hex_id, value_str

__all__ = ["SPAN_KINDS", "STATUS_CODES", "TRACE_COLUMNS", "attrs", "float_str", "value_str"]

_METRIC_COMMON = (
    "ResourceAttributes",
    "ResourceSchemaUrl",
    "ScopeName",
    "ScopeVersion",
    "ScopeAttributes",
    "ScopeDroppedAttrCount",
    "ScopeSchemaUrl",
    "ServiceName",
    "MetricName",
    "MetricDescription",
    "MetricUnit",
    "Attributes",
    "StartTimeUnix",
    "TimeUnix",
)
_EXEMPLARS = (
    "Exemplars.FilteredAttributes",
    "Exemplars.TimeUnix",
    "Exemplars.Value",
    "Exemplars.SpanId",
    "Exemplars.TraceId",
)
METRIC_COLUMNS: dict[str, tuple[str, ...]] = {
    "otel_metrics_gauge": (*_METRIC_COMMON, "Value", "Flags", *_EXEMPLARS),
    "otel_metrics_sum": (
        *_METRIC_COMMON,
        "Value",
        "Flags",
        *_EXEMPLARS,
        "AggregationTemporality",
        "IsMonotonic",
    ),
    "otel_metrics_histogram": (
        *_METRIC_COMMON,
        "Count",
        "Sum",
        "BucketCounts",
        "ExplicitBounds",
        *_EXEMPLARS,
        "Flags",
        "Min",
        "Max",
        "AggregationTemporality",
    ),
    "otel_metrics_exponential_histogram": (
        *_METRIC_COMMON,
        "Count",
        "Sum",
        "Scale",
        "ZeroCount",
        "PositiveOffset",
        "PositiveBucketCounts",
        "NegativeOffset",
        "NegativeBucketCounts",
        *_EXEMPLARS,
        "Flags",
        "Min",
        "Max",
        "AggregationTemporality",
    ),
    "otel_metrics_summary": (
        *_METRIC_COMMON,
        "Count",
        "Sum",
        "ValueAtQuantiles.Quantile",
        "ValueAtQuantiles.Value",
        "Flags",
    ),
}
LOG_COLUMNS = (
    "Timestamp",
    "TraceId",
    "SpanId",
    "TraceFlags",
    "SeverityText",
    "SeverityNumber",
    "ServiceName",
    "Body",
    "ResourceSchemaUrl",
    "ResourceAttributes",
    "ScopeSchemaUrl",
    "ScopeName",
    "ScopeVersion",
    "ScopeAttributes",
    "LogAttributes",
)


@dataclass(slots=True)
class Batch:
    """Rows for one or more tables, plus what was rejected and why. A table's rows are an Arrow table
    (traces) or a list of columns (metrics, logs); `Store.insert` takes either."""

    tables: dict[str, pa.Table | list[list[Any]]] = field(default_factory=dict)
    columns: dict[str, tuple[str, ...]] = field(default_factory=dict)
    rejected: int = 0
    errors: list[str] = field(default_factory=list)
    deferred_rows: int = 0  # rows checked but not built: decoded again at insert (`traces_rows`)

    def rows(self, table: str) -> int:
        data = self.tables.get(table)
        if isinstance(data, pa.Table):
            return data.num_rows
        return len(data[0]) if data else 0

    @property
    def error_message(self) -> str:
        return "; ".join(self.errors[:5])


# --- traces --------------------------------------------------------------------------------------------


def traces(request: Any) -> Batch:
    """ExportTraceServiceRequest -> rows for otel_traces. Spans without a valid trace or span id are
    rejected (counted, with a reason), the rest are kept. `traces_payload` is the same from the request's
    bytes, without building the message first (the ingest path)."""
    if not isinstance(request, RawTraceRequest):
        request = RawTraceRequest.FromString(request.SerializeToString())
    try:
        table, bad = spans_table(request)
    except OverflowError:  # DateTime64(9) ends in 2262: a time past it is no time a span can have
        raise PayloadError("a span or event time is past the year 2262") from None
    except DecodeError as e:  # an attribute that is not a KeyValue (a payload not parsed before)
        raise PayloadError(f"malformed protobuf ExportTraceServiceRequest: {e}") from None
    return trace_batch(table, bad)


def trace_batch(table: pa.Table | None, rejected: int, deferred_rows: int = 0) -> Batch:
    """otel_traces rows (or, with `deferred_rows`, only their count) and the spans rejected."""
    batch = Batch(deferred_rows=deferred_rows)
    if table is not None:
        batch.tables["otel_traces"], batch.columns["otel_traces"] = table, TRACE_COLUMNS
    if rejected:
        batch.rejected = rejected
        batch.errors.append(f"{rejected} span(s) without a valid 16-byte trace id and 8-byte span id")
    return batch


def check_traces(payload: bytes) -> Batch:
    """What the receiver needs before it acknowledges a request: PayloadError if the bytes are not a valid
    ExportTraceServiceRequest, else how many spans are kept (`deferred_rows`) and how many rejected. The
    columns are built at insert time, for a whole group at once (`traces_rows`). Without the compiled
    decoder this is `traces_payload`."""
    if not spans.available():
        return traces_payload(payload)
    decoder = getattr(_checkers, "decoder", None)
    if decoder is None:  # one per thread, reused: its buffers stay allocated
        decoder = _checkers.decoder = spans.SpanDecoder()
    rows, rejected = decoder.check(payload)
    return trace_batch(None, rejected, deferred_rows=rows)


_checkers = threading.local()


def traces_rows(payloads: list[bytes]) -> tuple[Batch, list[int]]:
    """The rows of several ExportTraceServiceRequests as one batch (one Arrow table), and the indices of
    the payloads that did not parse (left out). Needs the compiled decoder (`spans.available()`)."""
    bad = []
    with spans.SpanDecoder() as decoder:
        for i, payload in enumerate(payloads):
            try:
                decoder.feed(payload)
            except PayloadError:
                bad.append(i)
        return trace_batch(decoder.table(), 0), bad


def traces_payload(payload: bytes) -> Batch:
    """The rows of one ExportTraceServiceRequest's protobuf bytes; PayloadError if they do not parse."""
    if spans.available():
        with spans.SpanDecoder() as decoder:
            rejected = decoder.feed(payload)
            return trace_batch(decoder.table(), rejected)
    try:
        request = RawTraceRequest.FromString(payload)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise PayloadError(f"malformed protobuf ExportTraceServiceRequest: {e}") from None
    return traces(request)


# --- metrics -------------------------------------------------------------------------------------------


def metrics(request: Any) -> Batch:
    """ExportMetricsServiceRequest -> rows for the otel_metrics_* tables (one per point type)."""
    batch = Batch()
    for table, names in METRIC_COLUMNS.items():
        batch.tables[table] = [[] for _ in names]
        batch.columns[table] = names
    for rm in request.resource_metrics:
        res_attrs = attrs(rm.resource.attributes)
        head0 = (res_attrs, rm.schema_url)
        service = res_attrs.get("service.name", "")
        for sm in rm.scope_metrics:
            scope = sm.scope
            head1 = (
                *head0,
                scope.name,
                scope.version,
                attrs(scope.attributes),
                scope.dropped_attributes_count,
                sm.schema_url,
                service,
            )
            for metric in sm.metrics:
                head = (*head1, metric.name, metric.description, metric.unit)
                which = metric.WhichOneof("data")
                if which is None:
                    batch.rejected += 1
                    batch.errors.append(f"metric {metric.name!r} has no data")
                    continue
                _METRIC_WRITERS[which](batch, head, getattr(metric, which))
    for table in list(batch.tables):
        if not batch.rows(table):
            del batch.tables[table], batch.columns[table]
    return batch


def _point_head(cols: list[list[Any]], head: tuple, p: Any) -> None:
    values = (*head, attrs(p.attributes), p.start_time_unix_nano, p.time_unix_nano)
    for col, value in zip(cols, values, strict=False):
        col.append(value)


def _exemplars(cols: list[list[Any]], p: Any) -> None:
    ex = p.exemplars
    cols[0].append([attrs(e.filtered_attributes) for e in ex])
    cols[1].append([e.time_unix_nano for e in ex])
    cols[2].append([e.as_double if e.WhichOneof("value") == "as_double" else float(e.as_int) for e in ex])
    cols[3].append([hex_id(e.span_id, ZERO_SPAN) for e in ex])
    cols[4].append([hex_id(e.trace_id, ZERO_TRACE) for e in ex])


def _number(p: Any) -> float:
    return p.as_double if p.WhichOneof("value") == "as_double" else float(p.as_int)


def _gauge(batch: Batch, head: tuple, data: Any) -> None:
    cols = batch.tables["otel_metrics_gauge"]
    for p in data.data_points:
        _point_head(cols, head, p)
        cols[14].append(_number(p))
        cols[15].append(p.flags)
        _exemplars(cols[16:21], p)


def _sum(batch: Batch, head: tuple, data: Any) -> None:
    cols = batch.tables["otel_metrics_sum"]
    for p in data.data_points:
        _point_head(cols, head, p)
        cols[14].append(_number(p))
        cols[15].append(p.flags)
        _exemplars(cols[16:21], p)
        cols[21].append(data.aggregation_temporality)
        cols[22].append(data.is_monotonic)


def _histogram(batch: Batch, head: tuple, data: Any) -> None:
    cols = batch.tables["otel_metrics_histogram"]
    for p in data.data_points:
        _point_head(cols, head, p)
        cols[14].append(p.count)
        cols[15].append(p.sum)
        cols[16].append(list(p.bucket_counts))
        cols[17].append(list(p.explicit_bounds))
        _exemplars(cols[18:23], p)
        cols[23].append(p.flags)
        cols[24].append(p.min)
        cols[25].append(p.max)
        cols[26].append(data.aggregation_temporality)


def _exp_histogram(batch: Batch, head: tuple, data: Any) -> None:
    cols = batch.tables["otel_metrics_exponential_histogram"]
    for p in data.data_points:
        _point_head(cols, head, p)
        cols[14].append(p.count)
        cols[15].append(p.sum)
        cols[16].append(p.scale)
        cols[17].append(p.zero_count)
        cols[18].append(p.positive.offset)
        cols[19].append(list(p.positive.bucket_counts))
        cols[20].append(p.negative.offset)
        cols[21].append(list(p.negative.bucket_counts))
        _exemplars(cols[22:27], p)
        cols[27].append(p.flags)
        cols[28].append(p.min)
        cols[29].append(p.max)
        cols[30].append(data.aggregation_temporality)


def _summary(batch: Batch, head: tuple, data: Any) -> None:
    cols = batch.tables["otel_metrics_summary"]
    for p in data.data_points:
        _point_head(cols, head, p)
        cols[14].append(p.count)
        cols[15].append(p.sum)
        cols[16].append([q.quantile for q in p.quantile_values])
        cols[17].append([q.value for q in p.quantile_values])
        cols[18].append(p.flags)


_METRIC_WRITERS = {
    "gauge": _gauge,
    "sum": _sum,
    "histogram": _histogram,
    "exponential_histogram": _exp_histogram,
    "summary": _summary,
}


# --- logs ----------------------------------------------------------------------------------------------


def logs(request: Any) -> Batch:
    """ExportLogsServiceRequest -> rows for otel_logs."""
    cols: list[list[Any]] = [[] for _ in LOG_COLUMNS]
    batch = Batch(tables={"otel_logs": cols}, columns={"otel_logs": LOG_COLUMNS})
    for rl in request.resource_logs:
        res_attrs = attrs(rl.resource.attributes)
        service = res_attrs.get("service.name", "")
        for sl in rl.scope_logs:
            scope = sl.scope
            scope_attrs = attrs(scope.attributes)
            for r in sl.log_records:
                row = (
                    r.time_unix_nano or r.observed_time_unix_nano,
                    hex_id(r.trace_id, ZERO_TRACE),
                    hex_id(r.span_id, ZERO_SPAN),
                    r.flags & 0xFF,
                    r.severity_text,
                    max(0, min(255, r.severity_number)),
                    service,
                    value_str(r.body),
                    rl.schema_url,
                    res_attrs,
                    sl.schema_url,
                    scope.name,
                    scope.version,
                    scope_attrs,
                    attrs(r.attributes),
                )
                for col, value in zip(cols, row, strict=True):
                    col.append(value)
    if not batch.rows("otel_logs"):
        batch.tables.clear()
        batch.columns.clear()
    return batch


def merge(batches: list[Batch]) -> Batch:
    """One batch holding the rows of several (same columns per table), for a single insert per table."""
    if len(batches) == 1:
        return batches[0]
    parts: dict[str, list] = {}
    out = Batch()
    for b in batches:
        for table, rows in b.tables.items():
            parts.setdefault(table, []).append(rows)
            out.columns[table] = b.columns[table]
        out.rejected += b.rejected
        out.errors.extend(b.errors)
    for table, pieces in parts.items():
        if isinstance(pieces[0], pa.Table):
            # one contiguous block, each dictionary column with one dictionary of distinct values
            out.tables[table] = pa.concat_tables(pieces).unify_dictionaries().combine_chunks()
        else:
            out.tables[table] = [list(chain.from_iterable(cols)) for cols in zip(*pieces, strict=True)]
    return out


CONVERTERS = {"traces": traces, "metrics": metrics, "logs": logs}
