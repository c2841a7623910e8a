"""OTLP AnyValue -> the string the OpenTelemetry Collector ClickHouse exporter stores (`Value.AsString()`).

Strings as is, ints in decimal, doubles in Go's shortest form (`2.0` -> `2`, `1e-07` -> `1e-7`), bools
`true`/`false`, bytes base64, arrays and maps as JSON. `attrs()` is the ingest path's innermost loop: it reads
each protobuf field once and keeps the three common kinds inline. `KeyValueMemo` reads attributes that
arrive as their encoded bytes (collector/traces.py parses them so), converting each distinct KeyValue once.
"""

from __future__ import annotations

import base64
import json
import math
from decimal import Decimal
from typing import Any

from opentelemetry.proto.common.v1.common_pb2 import KeyValue

ZERO_TRACE = bytes(16)
ZERO_SPAN = bytes(8)


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
    """Repeated KeyValue -> {key: AsString(value)} (a repeated key keeps its last value, as in pdata)."""
    out = {}
    for kv in kvs:
        v = kv.value
        kind = v.WhichOneof("value")
        if kind == "string_value":
            out[kv.key] = v.string_value
        elif kind == "int_value":
            out[kv.key] = str(v.int_value)
        elif kind == "double_value":
            # repr() is already the shortest round-trip form; only "2.0", exponents, nan and inf differ
            # from Go's spelling
            text = repr(v.double_value)
            if text[-2:] == ".0":
                out[kv.key] = text[:-2] if len(text) < 18 else float_str(v.double_value)
            elif "e" in text or "n" in text:
                out[kv.key] = float_str(v.double_value)
            else:
                out[kv.key] = text
        else:
            out[kv.key] = value_str(v)
    return out


def hex_id(b: bytes, zero: bytes) -> str:
    """A trace or span id as lowercase hex; "" when empty or all zeros."""
    return "" if not b or b == zero else b.hex()


class KeyValueMemo:
    """Encoded KeyValues -> {key: AsString(value)}, each distinct encoding converted once.

    Reading a KeyValue through upb builds a Python object per message and field read (about 0.5 us per
    attribute); most of a span's attributes are byte for byte those of earlier spans (model, dtype, small
    counts), and a dict lookup on their bytes is several times cheaper. The memo never changes a result,
    only its cost. It keeps two generations of at most `max_entries` each: when the young one is full it
    becomes the old one (and the old one is dropped); a hit in the old generation moves back to the young.
    So values seen once (ids, measured times) age out while the recurring ones stay, in bounded memory.
    """

    __slots__ = ("_old", "_pairs", "max_entries")

    def __init__(self, max_entries: int = 50_000) -> None:
        self._pairs: dict[bytes, tuple[str, str]] = {}
        self._old: dict[bytes, tuple[str, str]] = {}
        self.max_entries = max_entries

    def attrs(self, encoded: Any) -> dict[str, str]:
        """Repeated KeyValue encodings -> {key: value} as `attrs()` (a repeated key keeps its last value).
        Raises google.protobuf's DecodeError for bytes that are not a KeyValue."""
        out = {}
        get = self._pairs.get
        for raw in encoded:
            pair = get(raw)
            if pair is None:
                pair = self._miss(raw)
                get = self._pairs.get  # a new young generation may have begun
            out[pair[0]] = pair[1]
        return out

    def _miss(self, raw: bytes) -> tuple[str, str]:
        pair = self._old.get(raw)
        if pair is None:
            pair = _key_value(KeyValue.FromString(raw))
        if len(self._pairs) >= self.max_entries:
            self._old, self._pairs = self._pairs, {}
        self._pairs[raw] = pair
        return pair


def _key_value(kv: Any) -> tuple[str, str]:
    v = kv.value
    kind = v.WhichOneof("value")  # the two kinds that miss most (ids, counts) inline, as in attrs()
    if kind == "string_value":
        return kv.key, v.string_value
    if kind == "int_value":
        return kv.key, str(v.int_value)
    return kv.key, value_str(v)
