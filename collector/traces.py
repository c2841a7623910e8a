"""ExportTraceServiceRequest -> an Arrow table of otel_traces rows, with the exporter's value encodings.

This is the collector's hot loop (about 11 attributes per stepscope span), so it is built for speed by its
structure rather than by tricks:

- one pass over the protobuf, reading each field once (upb builds a Python object per field read);
- Python lists per column, never a dict per row;
- Map columns as flat key and value lists plus offsets, which Arrow takes without a per-row conversion:

      SpanAttributes   keys   [k0 k1 k2 | k0 k3 | ...]     values [v0 v1 v2 | v0 v3 | ...]
                       offsets [0, 3, 5, ...]               (row i is keys[offsets[i]:offsets[i+1]])

- resource attributes converted once per resource and repeated per row by Arrow (`take`), scope fields
  once per scope;
- attributes parsed as their encoded bytes (`RawTraceRequest`: the same wire format, with every
  `attributes` field declared `repeated bytes`), so that a KeyValue seen before costs a dict lookup
  (values.KeyValueMemo) instead of two upb messages and four field reads;
- ClickHouse reads the Arrow table natively, so clickhouse-connect has no per-value Python work on insert.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from collector.values import ZERO_SPAN, ZERO_TRACE, KeyValueMemo

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
SPAN_KINDS = (
    "SPAN_KIND_UNSPECIFIED",
    "SPAN_KIND_INTERNAL",
    "SPAN_KIND_SERVER",
    "SPAN_KIND_CLIENT",
    "SPAN_KIND_PRODUCER",
    "SPAN_KIND_CONSUMER",
)
STATUS_CODES = ("STATUS_CODE_UNSET", "STATUS_CODE_OK", "STATUS_CODE_ERROR")
_KIND_NAMES = pa.array([*SPAN_KINDS, ""])  # "" for a kind OTLP does not define
_STATUS_NAMES = pa.array([*STATUS_CODES, ""])

_STR = pa.string()
_NS = pa.timestamp("ns")  # DateTime64(9) in ClickHouse
_MAP = pa.map_(_STR, _STR)  # Map(LowCardinality(String), String)
_DICT = pa.dictionary(pa.int32(), _STR)
_TYPES = {  # every other column is a String
    "Timestamp": _NS,
    "SpanKind": _DICT,
    "ServiceName": _DICT,
    "ScopeName": _DICT,
    "ScopeVersion": _DICT,
    "StatusCode": _DICT,
    "ResourceAttributes": _MAP,
    "SpanAttributes": _MAP,
    "Duration": pa.uint64(),
    "Events.Timestamp": pa.list_(_NS),
    "Events.Name": pa.list_(_STR),
    "Events.Attributes": pa.list_(_MAP),
    "Links.TraceId": pa.list_(_STR),
    "Links.SpanId": pa.list_(_STR),
    "Links.TraceState": pa.list_(_STR),
    "Links.Attributes": pa.list_(_MAP),
}
SCHEMA = pa.schema([(name, _TYPES.get(name, _STR)) for name in TRACE_COLUMNS])


def _raw_request_class() -> type:
    """ExportTraceServiceRequest with every `attributes` field (of KeyValue) read as `repeated bytes`."""
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(file: Any) -> None:
        if file.name in added:
            return
        for dependency in file.dependencies:
            add(dependency)
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        for message in proto.message_type:
            as_bytes(message)
        pool.Add(proto)
        added.add(file.name)

    def as_bytes(message: descriptor_pb2.DescriptorProto) -> None:
        for f in message.field:
            if f.name == "attributes" and f.type_name.endswith(".KeyValue"):
                f.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
                f.ClearField("type_name")
        for nested in message.nested_type:
            as_bytes(nested)

    add(trace_service_pb2.DESCRIPTOR)
    name = trace_service_pb2.ExportTraceServiceRequest.DESCRIPTOR.full_name
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(name))


RawTraceRequest = _raw_request_class()
_MEMO = KeyValueMemo()  # a pure memo: it changes no result, only what one costs


class _FlatMaps:
    """A Map column as flat keys, values and row offsets."""

    __slots__ = ("keys", "offsets", "values")

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.values: list[str] = []
        self.offsets: list[int] = [0]

    def add(self, row: dict[str, str]) -> None:
        self.keys.extend(row)
        self.values.extend(row.values())
        self.offsets.append(len(self.keys))

    def array(self) -> pa.MapArray:
        return pa.MapArray.from_arrays(
            pa.array(self.offsets, pa.int32()), pa.array(self.keys, _STR), pa.array(self.values, _STR)
        )


def _dictionary(indices: list[int] | pa.Array, names: list[str] | pa.Array) -> pa.DictionaryArray:
    # A column with few distinct values as indices into them, so that Arrow encodes each distinct string
    # once, not once per row. ClickHouse reads a dictionary into String and LowCardinality alike, but
    # refuses one with repeated values, hence dictionary_encode().
    encoded = pa.array(names, _STR).dictionary_encode()
    return pa.DictionaryArray.from_arrays(encoded.indices.take(indices), encoded.dictionary)


def _timestamps(ns: list[int]) -> pa.Array:
    # Python ints -> int64 is a plain copy; straight to timestamp[ns] Arrow takes a ten times slower path
    return pa.array(ns, pa.int64()).view(_NS)


def _list_array(offsets: list[int], values: pa.Array) -> pa.ListArray:
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values)


def spans_table(request: Any, memo: KeyValueMemo = _MEMO) -> tuple[pa.Table, int]:
    """The otel_traces rows of one export request (a RawTraceRequest), and how many spans were rejected
    (no valid 16-byte trace id and 8-byte span id). Raises DecodeError for an attribute that is not a
    KeyValue."""
    attrs = memo.attrs
    resources = _FlatMaps()
    # per scope (one entry per ScopeSpans): its resource, service, name, version; each row points at one
    scope_resource: list[int] = []
    scope_service: list[str] = []
    scope_name: list[str] = []
    scope_version: list[str] = []
    scope_of_row: list[int] = []
    ts: list[int] = []
    tid: list[str] = []
    sid: list[str] = []
    psid: list[str] = []
    tstate: list[str] = []
    name: list[str] = []
    kind: list[str] = []
    sattr = _FlatMaps()
    dur: list[int] = []
    scode: list[str] = []
    smsg: list[str] = []
    # events and links: rows own consecutive runs of these flat lists, delimited by the offsets
    ev_off, ev_ts, ev_name, ev_attr = [0], [], [], _FlatMaps()
    ln_off, ln_tid, ln_sid, ln_state, ln_attr = [0], [], [], [], _FlatMaps()

    add_sattr = sattr.add
    bad = 0
    for rs in request.resource_spans:
        resource = attrs(rs.resource.attributes)
        resource_index = len(resources.offsets) - 1
        resources.add(resource)
        service = resource.get("service.name", "")
        for ss in rs.scope_spans:
            scope_index = len(scope_name)
            scope_resource.append(resource_index)
            scope_service.append(service)
            scope_name.append(ss.scope.name)
            scope_version.append(ss.scope.version)
            kept = 0
            for span in ss.spans:
                trace_id, span_id = span.trace_id, span.span_id
                if len(trace_id) != 16 or len(span_id) != 8 or trace_id == ZERO_TRACE or span_id == ZERO_SPAN:
                    bad += 1
                    continue
                kept += 1
                start, end = span.start_time_unix_nano, span.end_time_unix_nano
                ts.append(start)
                dur.append(end - start if end > start else 0)
                tid.append(trace_id.hex())
                sid.append(span_id.hex())
                parent = span.parent_span_id
                psid.append(parent.hex() if parent and parent != ZERO_SPAN else "")
                tstate.append(span.trace_state)
                name.append(span.name)
                k = span.kind
                kind.append(k if 0 <= k < 6 else 6)  # an index into _KIND_NAMES
                add_sattr(attrs(span.attributes))
                status = span.status
                code = status.code
                scode.append(code if 0 <= code < 3 else 3)  # an index into _STATUS_NAMES
                smsg.append(status.message)
                events = span.events
                if events:
                    for e in events:
                        ev_ts.append(e.time_unix_nano)
                        ev_name.append(e.name)
                        ev_attr.add(attrs(e.attributes))
                ev_off.append(len(ev_name))
                links = span.links
                if links:
                    for link in links:
                        lt, ls = link.trace_id, link.span_id
                        ln_tid.append("" if not lt or lt == ZERO_TRACE else lt.hex())
                        ln_sid.append("" if not ls or ls == ZERO_SPAN else ls.hex())
                        ln_state.append(link.trace_state)
                        ln_attr.add(attrs(link.attributes))
                ln_off.append(len(ln_tid))
            scope_of_row.extend([scope_index] * kept)

    scopes = pa.array(scope_of_row, pa.int32())
    columns = [
        _timestamps(ts),
        pa.array(tid, _STR),
        pa.array(sid, _STR),
        pa.array(psid, _STR),
        pa.array(tstate, _STR),
        pa.array(name, _STR),
        _dictionary(pa.array(kind, pa.int32()), _KIND_NAMES),
        _dictionary(scopes, scope_service),
        resources.array().take(pa.array(scope_resource, pa.int32()).take(scopes)),
        _dictionary(scopes, scope_name),
        _dictionary(scopes, scope_version),
        sattr.array(),
        pa.array(dur, pa.uint64()),
        _dictionary(pa.array(scode, pa.int32()), _STATUS_NAMES),
        pa.array(smsg, _STR),
        _list_array(ev_off, _timestamps(ev_ts)),
        _list_array(ev_off, pa.array(ev_name, _STR)),
        _list_array(ev_off, ev_attr.array()),
        _list_array(ln_off, pa.array(ln_tid, _STR)),
        _list_array(ln_off, pa.array(ln_sid, _STR)),
        _list_array(ln_off, pa.array(ln_state, _STR)),
        _list_array(ln_off, ln_attr.array()),
    ]
    return pa.Table.from_arrays(columns, schema=SCHEMA), bad
