"""A minimal OTLP/HTTP receiver on loopback that decodes protobuf trace and metric exports into lists: what
the tests and the CUDA check read spans from, with no collector or ClickHouse behind it."""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


def value(v: Any) -> Any:
    """An OTLP AnyValue as Python (arrays as tuples)."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


def attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: value(kv.value) for kv in kvs}


class OtlpReceiver:
    """Spans as dicts (name, kind, trace_id, span_id, parent, start, end, attrs, resource, events, links)
    and metrics by name ({"unit", "bounds"}), as they arrive on `url`/v1/traces and `url`/v1/metrics."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.metrics: dict[str, dict] = {}
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path == "/v1/traces":
                    receiver.add_traces(body)
                    reply: Any = ExportTraceServiceResponse()
                elif self.path == "/v1/metrics":
                    receiver.add_metrics(body)
                    reply = ExportMetricsServiceResponse()
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                data = reply.SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add_traces(self, body: bytes) -> None:
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        for rs in req.resource_spans:
            resource = attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans.append({
                        "name": s.name, "kind": s.kind, "trace_id": s.trace_id.hex(),
                        "span_id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                        "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                        "attrs": attrs(s.attributes), "resource": resource,
                        "events": [e.name for e in s.events],
                        "links": [(ln.span_id.hex(), attrs(ln.attributes)) for ln in s.links],
                    })  # fmt: skip

    def add_metrics(self, body: bytes) -> None:
        req = ExportMetricsServiceRequest()
        req.ParseFromString(body)
        for rm in req.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    bounds: tuple[float, ...] = ()
                    if m.WhichOneof("data") == "histogram" and m.histogram.data_points:
                        bounds = tuple(m.histogram.data_points[0].explicit_bounds)
                    self.metrics[m.name] = {"unit": m.unit, "bounds": bounds}

    def named(self, name: str) -> list[dict]:
        return [s for s in self.spans if s["name"] == name]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
