"""The compiled span decoder (collector/spans.c) gives the rows the Python converter gives, byte for byte,
refuses what a protobuf parser refuses, and its check before the acknowledgement counts what the insert
keeps."""

from __future__ import annotations

import json
import math
import random

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from test_collector_convert import _request

from collector import convert, otlp, spans, traces
from collector.values import float_str

pytestmark = pytest.mark.skipif(not spans.available(), reason="no C compiler to build the span decoder")


def _python_rows(payload: bytes) -> list[dict]:
    table, _ = traces.spans_table(traces.RawTraceRequest.FromString(payload))
    return table.to_pylist()


def _native_rows(*payloads: bytes) -> list[dict]:
    with spans.SpanDecoder() as decoder:
        for payload in payloads:
            decoder.feed(payload)
        return decoder.table().to_pylist()


def _value(rnd: random.Random, depth: int = 0) -> AnyValue:
    kind = rnd.randint(0, 8 if depth < 2 else 5)
    text = "".join(rnd.choice('ab"\\\n\x01é😀\t') for _ in range(rnd.randint(0, 5)))
    if kind == 0:
        return AnyValue(string_value=text)
    if kind == 1:
        return AnyValue(bool_value=rnd.random() < 0.5)
    if kind == 2:
        return AnyValue(int_value=rnd.randint(-(2**63), 2**63 - 1))
    if kind == 3:
        return AnyValue(double_value=_double(rnd))
    if kind == 4:
        return AnyValue(bytes_value=rnd.randbytes(rnd.randint(0, 7)))
    if kind == 5:
        return AnyValue()
    if kind in (6, 7):
        return AnyValue(
            array_value=ArrayValue(values=[_value(rnd, depth + 1) for _ in range(rnd.randint(0, 3))])
        )
    pairs = [KeyValue(key=rnd.choice("abc"), value=_value(rnd, depth + 1)) for _ in range(rnd.randint(0, 4))]
    return AnyValue(kvlist_value=KeyValueList(values=pairs))


def _double(rnd: random.Random) -> float:
    choice = rnd.random()
    if choice < 0.3:
        return rnd.random() * 10 ** rnd.randint(-12, 25) * rnd.choice([1, -1])
    if choice < 0.5:
        return math.ldexp(1, rnd.randint(-1074, 1023))  # powers of two, subnormals among them
    if choice < 0.7:
        return float.fromhex(f"0x1.{rnd.getrandbits(52):013x}p{rnd.randint(-1022, 1023)}")
    specials = [0.0, -0.0, 1e21, 1e-6, 1e-7, 1e16, 1e15, 1e-5, 2.0**63, 123.0, math.nan, math.inf, 5e-324]
    return rnd.choice([*specials, round(rnd.random(), rnd.randint(1, 8))])


def _random_request(rnd: random.Random) -> ExportTraceServiceRequest:
    def kvs(n: int) -> list[KeyValue]:
        return [
            KeyValue(key=rnd.choice(["a", "b", "service.name", "c"]), value=_value(rnd)) for _ in range(n)
        ]

    req = ExportTraceServiceRequest()
    for _ in range(rnd.randint(1, 2)):
        rs = req.resource_spans.add()
        rs.resource.attributes.extend(kvs(rnd.randint(0, 3)))
        for _ in range(rnd.randint(1, 2)):
            ss = rs.scope_spans.add()
            ss.scope.name, ss.scope.version = rnd.choice(["s", "t"]), rnd.choice(["1", ""])
            for _ in range(rnd.randint(0, 4)):
                span = ss.spans.add()
                span.trace_id = rnd.choice([bytes(16), rnd.randbytes(16), rnd.randbytes(16), b"\x01" * 15])
                span.span_id = rnd.choice([bytes(8), rnd.randbytes(8), rnd.randbytes(8)])
                span.parent_span_id = rnd.choice([b"", bytes(8), rnd.randbytes(8), rnd.randbytes(3)])
                span.name, span.kind = rnd.choice(["x", "ü"]), rnd.randint(-2, 8)
                span.start_time_unix_nano = rnd.randint(0, 2**63 - 1)
                span.end_time_unix_nano = rnd.randint(0, 2**63 - 1)
                span.attributes.extend(kvs(rnd.choice([0, 3, 8, 40])))  # 40: repeated keys, hashed
                span.status.code, span.status.message = rnd.randint(-1, 4), rnd.choice(["", "boom"])
                for _ in range(rnd.randint(0, 2)):
                    event = span.events.add()
                    event.name, event.time_unix_nano = "e", rnd.randint(0, 2**63 - 1)
                    event.attributes.extend(kvs(rnd.randint(0, 2)))
                for _ in range(rnd.randint(0, 2)):
                    link = span.links.add()
                    link.trace_id = rnd.choice([b"", bytes(16), rnd.randbytes(16)])
                    link.span_id, link.trace_state = rnd.choice([b"", rnd.randbytes(8)]), "k=v"
                    link.attributes.extend(kvs(rnd.randint(0, 2)))
    return req


def test_decoded_rows_equal_the_python_converters():
    rnd = random.Random(1)
    payloads = [_request().SerializeToString()] + [
        _random_request(rnd).SerializeToString() for _ in range(60)
    ]
    for payload in payloads:
        assert _native_rows(payload) == _python_rows(payload)
    # several requests fed to one decoder: one table, resources and scopes numbered across them
    assert _native_rows(*payloads[:5]) == [row for p in payloads[:5] for row in _python_rows(p)]


def test_doubles_are_spelled_as_go_does_and_json_arrays_as_python_does():
    rnd = random.Random(2)
    xs = [_double(rnd) for _ in range(2000)]
    req = _request(resources=1, scopes=1, spans=1)
    span = req.resource_spans[0].scope_spans[0].spans[0]
    del span.attributes[:]
    span.attributes.extend(KeyValue(key=str(i), value=AnyValue(double_value=x)) for i, x in enumerate(xs))
    array = ArrayValue(values=[AnyValue(double_value=x) for x in xs])
    span.attributes.append(KeyValue(key="array", value=AnyValue(array_value=array)))
    attributes = dict(_native_rows(req.SerializeToString())[0]["SpanAttributes"])
    assert [attributes[str(i)] for i in range(len(xs))] == [float_str(x) for x in xs]
    finite = [x if math.isfinite(x) else float_str(x) for x in xs]
    assert attributes["array"] == json.dumps(finite, separators=(",", ":"))


def test_the_check_counts_what_the_insert_keeps_and_refuses_what_it_refuses():
    rnd = random.Random(3)
    base = _request(resources=1, scopes=2).SerializeToString()
    checker, decoder = spans.SpanDecoder(), spans.SpanDecoder()
    for _ in range(300):
        payload = bytearray(base)
        for _ in range(rnd.randint(0, 2)):  # flipped bytes: most no longer parse
            payload[rnd.randrange(len(payload))] = rnd.getrandbits(8)
        try:
            rows = decoder.rows
            rejected = decoder.feed(bytes(payload))
            fed = (decoder.rows - rows, rejected)
        except otlp.PayloadError:
            fed = None
        try:
            checked = checker.check(bytes(payload))
        except otlp.PayloadError:
            checked = None
        assert checked == fed
    assert decoder.rows and checker.rows == 0 and checker.table().num_rows == 0  # the check keeps no row


def test_a_group_leaves_out_the_payload_that_does_not_parse():
    good = _request(resources=1, scopes=1, spans=2).SerializeToString()
    batch, bad = convert.traces_rows([good, b"\x0a\xff\xff\xff\xff\x0f garbage", good])
    assert bad == [1] and batch.rows("otel_traces") == 4
