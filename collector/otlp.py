"""OTLP/HTTP payloads -> protobuf request messages, as the OTLP specification describes them.

Binary protobuf (`application/x-protobuf`) and JSON (`application/json`), each optionally gzip-compressed.
OTLP/JSON differs from protobuf's canonical JSON mapping in one way that matters: trace and span ids are
hex strings, not base64. They are rewritten to base64 before `json_format` parses the message, so both
encodings end in the same classes and the same bytes.
"""

from __future__ import annotations

import base64
import json
import zlib
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

PROTOBUF = "application/x-protobuf"
JSON = "application/json"

# signal name -> (request class, response class)
SIGNALS: dict[str, tuple[type[Message], type[Message]]] = {
    "traces": (ExportTraceServiceRequest, ExportTraceServiceResponse),
    "metrics": (ExportMetricsServiceRequest, ExportMetricsServiceResponse),
    "logs": (ExportLogsServiceRequest, ExportLogsServiceResponse),
}

# OTLP/JSON fields that carry ids as hex; protobuf JSON wants base64 for `bytes`.
_HEX_ID_FIELDS = frozenset({"traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id"})


class PayloadError(ValueError):
    """A payload that cannot be decoded: HTTP 400 with this message."""


class PayloadTooLarge(ValueError):
    """A payload over the size limit, before or after decompression: HTTP 413."""


class UnsupportedMediaType(ValueError):
    """A content type or encoding OTLP/HTTP does not define: HTTP 415."""


@dataclass(frozen=True, slots=True)
class Decoded:
    """A decoded export request and its canonical protobuf bytes (what the spool stores); `message` is None
    when protobuf was passed through unparsed (`decode(..., parse=False)`)."""

    message: Message | None
    payload: bytes


def media_type(content_type: str | None) -> str:
    """The bare media type (`application/json; charset=utf-8` -> `application/json`); 415 if not OTLP's."""
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    if kind not in (PROTOBUF, JSON):
        raise UnsupportedMediaType(f"unsupported content type {content_type!r}: use {PROTOBUF} or {JSON}")
    return kind


def decompress(body: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    """Undo `Content-Encoding: gzip` (or none), refusing anything that inflates past `max_bytes`."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "x-gzip"):
        raise UnsupportedMediaType(f"unsupported content encoding {content_encoding!r}: use gzip or none")
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(body, max_bytes + 1)
    except zlib.error as e:
        raise PayloadError(f"bad gzip body: {e}") from None
    if len(out) > max_bytes:
        raise PayloadTooLarge(f"decompressed body is over the {max_bytes} byte limit")
    if not inflater.eof:
        raise PayloadError("truncated gzip body")
    return out


def decode(signal: str, body: bytes, kind: str, *, parse: bool = True) -> Decoded:
    """Parse one export request of `signal` ("traces", "metrics", "logs") from `body` in media type `kind`.
    With `parse=False` a protobuf body is passed through as it is (message None), for a caller whose
    converter parses it and refuses what this would refuse (traces: convert.traces_payload)."""
    request_cls = SIGNALS[signal][0]
    message = request_cls()
    if kind == PROTOBUF and not parse:
        return Decoded(None, body)
    if kind == PROTOBUF:
        try:
            message.ParseFromString(body)
        except (DecodeError, RuntimeError, ValueError) as e:
            raise PayloadError(f"malformed protobuf {request_cls.__name__}: {e}") from None
        return Decoded(message, body)
    try:
        document = json.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        raise PayloadError(f"malformed JSON: {e}") from None
    if not isinstance(document, dict):
        raise PayloadError(f"malformed JSON {request_cls.__name__}: expected an object")
    try:
        json_format.ParseDict(_hex_ids_to_base64(document), message, ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError) as e:
        raise PayloadError(f"malformed JSON {request_cls.__name__}: {e}") from None
    return Decoded(message, message.SerializeToString())


def parse_canonical(signal: str, payload: bytes) -> Message:
    """Parse protobuf bytes previously returned in `Decoded.payload` (a spooled batch)."""
    message = SIGNALS[signal][0]()
    message.ParseFromString(payload)
    return message


def encode_response(signal: str, kind: str, rejected: int, error_message: str) -> bytes:
    """The export response in the request's encoding, with `partial_success` when items were rejected."""
    response = SIGNALS[signal][1]()
    if rejected:
        field = {
            "traces": "rejected_spans",
            "metrics": "rejected_data_points",
            "logs": "rejected_log_records",
        }
        setattr(response.partial_success, field[signal], rejected)
        response.partial_success.error_message = error_message
    if kind == PROTOBUF:
        return response.SerializeToString()
    return json_format.MessageToJson(response, indent=None).encode()


def encode_status(kind: str, code: int, message: str) -> bytes:
    """A google.rpc.Status body for error responses, in the request's encoding."""
    from google.rpc.status_pb2 import Status

    status = Status(code=code, message=message)
    if kind == PROTOBUF:
        return status.SerializeToString()
    return json_format.MessageToJson(status, indent=None).encode()


def _hex_ids_to_base64(node: Any) -> Any:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key in _HEX_ID_FIELDS and isinstance(value, str):
                out[key] = _hex_to_base64(key, value)
            else:
                out[key] = _hex_ids_to_base64(value)
        return out
    if isinstance(node, list):
        return [_hex_ids_to_base64(item) for item in node]
    return node


def _hex_to_base64(key: str, value: str) -> str:
    try:
        return base64.b64encode(bytes.fromhex(value)).decode()
    except ValueError:
        raise PayloadError(f"{key} {value[:40]!r} is not a hex string") from None
