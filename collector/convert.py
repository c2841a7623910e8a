"""Export requests -> column batches for the exporter-compatible tables, with the exporter's value encodings.

Encodings follow the OpenTelemetry Collector ClickHouse exporter: ids as lowercase hex ("" when empty),
`SpanKind` as `SPAN_KIND_SERVER` and friends, `StatusCode` as `STATUS_CODE_OK`..., `Duration` in ns,
attribute values as pdata's `Value.AsString()` (ints in decimal, doubles in shortest form, bools as
`true`/`false`, bytes as base64, arrays and maps as JSON).

Rows are built column by column (one Python list per column, no dict per span): the ingest path's cost is
this loop, so it touches each protobuf field once.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

TRACE_COLUMNS = (
    "Timestamp",
    "TraceId",
    "SpanId",
    "ParentSpanId",
    "TraceState",
    "SpanName",
    "SpanKind",
    "ServiceName",
    "ResourceAttributes",
    "ScopeName",
    "ScopeVersion",
    "SpanAttributes",
    "Duration",
    "StatusCode",
    "StatusMessage",
    "Events.Timestamp",
    "Events.Name",
    "Events.Attributes",
    "Links.TraceId",
    "Links.SpanId",
    "Links.TraceState",
    "Links.Attributes",
)

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

SPAN_KINDS = (
    "SPAN_KIND_UNSPECIFIED",
    "SPAN_KIND_INTERNAL",
    "SPAN_KIND_SERVER",
    "SPAN_KIND_CLIENT",
    "SPAN_KIND_PRODUCER",
    "SPAN_KIND_CONSUMER",
)
STATUS_CODES = ("STATUS_CODE_UNSET", "STATUS_CODE_OK", "STATUS_CODE_ERROR")
_ZERO_TRACE = bytes(16)
_ZERO_SPAN = bytes(8)


@dataclass(slots=True)
class Batch:
    """Rows for one or more tables, column-oriented, plus what was rejected and why."""

    tables: dict[str, list[list[Any]]] = field(default_factory=dict)
    columns: dict[str, tuple[str, ...]] = field(default_factory=dict)
    rejected: int = 0
    errors: list[str] = field(default_factory=list)

    def rows(self, table: str) -> int:
        data = self.tables.get(table)
        return len(data[0]) if data else 0

    @property
    def error_message(self) -> str:
        return "; ".join(self.errors[:5])


# --- attribute values ---------------------------------------------------------------------------------


def value_str(v: Any) -> str:
    """An AnyValue as the exporter stores it (pdata `Value.AsString()`)."""
    kind = v.WhichOneof("value")
    if kind == "string_value":
        return v.string_value
    if kind == "int_value":
        return str(v.int_value)
    if kind == "bool_value":
        return "true" if v.bool_value else "false"
    if kind == "double_value":
        return float_str(v.double_value)
    if kind == "bytes_value":
        return base64.b64encode(v.bytes_value).decode()
    if kind is None:
        return ""
    return json.dumps(_raw(v), separators=(",", ":"), ensure_ascii=False)


def float_str(f: float) -> str:
    """A double as Go's ES6-style formatting: 1 -> "1", 0.5 -> "0.5", 1e-07 -> "1e-7", 1e21 -> "1e+21"."""
    if math.isnan(f) or math.isinf(f):
        return "NaN" if math.isnan(f) else ("+Inf" if f > 0 else "-Inf")
    if f == int(f) and abs(f) < 1e21:
        return str(int(f))
    a = abs(f)
    if 1e-6 <= a < 1e21:
        text = repr(f)
        return text if "e" not in text else format(Decimal(text), "f")
    mantissa, _, exp = repr(f).partition("e")
    return f"{mantissa}e{exp[0]}{exp[1:].lstrip('0')}" if exp[0] in "+-" else f"{mantissa}e+{exp}"


def _raw(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_raw(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _raw(kv.value) for kv in v.kvlist_value.values}
    if kind == "bytes_value":
        return base64.b64encode(v.bytes_value).decode()
    if kind == "double_value":
        f = v.double_value
        return f if math.isfinite(f) else float_str(f)
    return None if kind is None else getattr(v, kind)


def attrs(kvs: Any) -> dict[str, str]:
    """Repeated KeyValue -> {key: AsString(value)}; strings, ints and doubles stay inline for speed."""
    out = {}
    for kv in kvs:
        v = kv.value
        kind = v.WhichOneof("value")
        if kind == "string_value":
            out[kv.key] = v.string_value
        elif kind == "int_value":
            out[kv.key] = str(v.int_value)
        elif kind == "double_value":
            text = repr(v.double_value)
            if text[-2:] == ".0":
                out[kv.key] = text[:-2] if len(text) < 18 else float_str(v.double_value)
            elif "e" in text or "n" in text:  # exponents, nan, inf: Go's spelling differs from Python's
                out[kv.key] = float_str(v.double_value)
            else:
                out[kv.key] = text
        else:
            out[kv.key] = value_str(v)
    return out


def _hex_id(b: bytes, zero: bytes) -> str:
    return "" if not b or b == zero else b.hex()


# --- traces --------------------------------------------------------------------------------------------


def traces(request: Any) -> Batch:
    """ExportTraceServiceRequest -> rows for otel_traces. Spans without a valid trace or span id are
    rejected (counted, with a reason), the rest are kept."""
    cols: list[list[Any]] = [[] for _ in TRACE_COLUMNS]
    (ts, tid, sid, psid, tstate, name, kind, svc, rattr, scname, scver, sattr, dur, scode, smsg) = cols[:15]
    ev_ts, ev_name, ev_attr, ln_tid, ln_sid, ln_state, ln_attr = cols[15:]
    batch = Batch(tables={"otel_traces": cols}, columns={"otel_traces": TRACE_COLUMNS})
    bad = 0
    for rs in request.resource_spans:
        res_attrs = attrs(rs.resource.attributes)
        service = res_attrs.get("service.name", "")
        for ss in rs.scope_spans:
            scope_name, scope_version = ss.scope.name, ss.scope.version
            for span in ss.spans:
                trace_id, span_id = span.trace_id, span.span_id
                if (
                    len(trace_id) != 16
                    or len(span_id) != 8
                    or trace_id == _ZERO_TRACE
                    or span_id == _ZERO_SPAN
                ):
                    bad += 1
                    continue
                start, end = span.start_time_unix_nano, span.end_time_unix_nano
                ts.append(start)
                tid.append(trace_id.hex())
                sid.append(span_id.hex())
                psid.append(_hex_id(span.parent_span_id, _ZERO_SPAN))
                tstate.append(span.trace_state)
                name.append(span.name)
                kind.append(SPAN_KINDS[span.kind] if 0 <= span.kind < 6 else "")
                svc.append(service)
                rattr.append(res_attrs)
                scname.append(scope_name)
                scver.append(scope_version)
                sattr.append(attrs(span.attributes))
                dur.append(end - start if end > start else 0)
                status = span.status
                scode.append(STATUS_CODES[status.code] if 0 <= status.code < 3 else "")
                smsg.append(status.message)
                events = span.events
                if events:
                    ev_ts.append([e.time_unix_nano for e in events])
                    ev_name.append([e.name for e in events])
                    ev_attr.append([attrs(e.attributes) for e in events])
                else:
                    ev_ts.append([])
                    ev_name.append([])
                    ev_attr.append([])
                links = span.links
                if links:
                    ln_tid.append([_hex_id(x.trace_id, _ZERO_TRACE) for x in links])
                    ln_sid.append([_hex_id(x.span_id, _ZERO_SPAN) for x in links])
                    ln_state.append([x.trace_state for x in links])
                    ln_attr.append([attrs(x.attributes) for x in links])
                else:
                    ln_tid.append([])
                    ln_sid.append([])
                    ln_state.append([])
                    ln_attr.append([])
    if bad:
        batch.rejected = bad
        batch.errors.append(f"{bad} span(s) without a valid 16-byte trace id and 8-byte span id")
    return batch


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
    cols[3].append([_hex_id(e.span_id, _ZERO_SPAN) for e in ex])
    cols[4].append([_hex_id(e.trace_id, _ZERO_TRACE) for e in ex])


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
                    _hex_id(r.trace_id, _ZERO_TRACE),
                    _hex_id(r.span_id, _ZERO_SPAN),
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
    out = Batch()
    for b in batches:
        for table, cols in b.tables.items():
            if table not in out.tables:
                out.tables[table] = [list(c) for c in cols]
                out.columns[table] = b.columns[table]
            else:
                for acc, col in zip(out.tables[table], cols, strict=True):
                    acc.extend(col)
        out.rejected += b.rejected
        out.errors.extend(b.errors)
    return out


CONVERTERS = {"traces": traces, "metrics": metrics, "logs": logs}
