"""The named-query library behind `stepscope query`: small, parameterized post-incident questions.

Each query's SQL is in `diagnosis.queries`; here are its parameters (typed, with defaults), how they are
read from `key=value` text, and how results are shown (a table, or a trace as a waterfall).
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, field
from typing import Any

from collector.client import Reader
from collector.store import QueryResult
from collector.timerange import parse_time
from diagnosis import queries

_FAR_FUTURE_NS = 9_000_000_000_000_000_000
LATENCY_COLUMNS = (
    "ttft_s",
    "tpot_s",
    "tpot_max_s",
    "e2e_s",
    "queue_s",
    "prefill_s",
    "decode_s",
    "kv_transfer_s",
)


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter: `kind` is time (-> ns, Int64), int, str or choice."""

    kind: str
    help: str
    default: Any = None  # None: required
    choices: tuple[str, ...] = ()
    sql_name: str = ""  # the SQL parameter's name when it differs


@dataclass(frozen=True, slots=True)
class NamedQuery:
    """A query of the library: description, SQL, parameters."""

    name: str
    description: str
    sql: str
    params: dict[str, Param] = field(default_factory=dict)
    view: str = "table"  # table | waterfall


_FROM = Param("time", "window start (ISO 8601, unix s, or 15m ago)", "0", sql_name="w0")
_TO = Param("time", "window end", "", sql_name="w1")

LIBRARY: dict[str, NamedQuery] = {
    q.name: q
    for q in (
        NamedQuery(
            "slowest",
            "the slowest requests in a window by a latency column",
            queries.SLOWEST,
            {
                "from": _FROM,
                "to": _TO,
                "metric": Param("choice", "latency column", "ttft_s", LATENCY_COLUMNS),
                "limit": Param("int", "rows", "20"),
            },
        ),
        NamedQuery(
            "compare",
            "two windows side by side: counts, errors, quantiles, phase means, prompt lengths, cache share",
            queries.COMPARE,
            {
                "a_from": Param("time", "first window start"),
                "a_to": Param("time", "first window end"),
                "b_from": Param("time", "second window start"),
                "b_to": Param("time", "second window end"),
            },
        ),
        NamedQuery(
            "waterfall",
            "one trace's spans as a waterfall in the terminal",
            queries.WATERFALL,
            {"trace_id": Param("str", "32 hex digits")},
            view="waterfall",
        ),
        NamedQuery(
            "cache_hit_rate",
            "prefix-cache hit share of prompt tokens and distinct prefix keys over time",
            queries.CACHE_HIT_RATE,
            {"from": _FROM, "to": _TO, "interval_s": Param("int", "bucket seconds", "60")},
        ),
        NamedQuery(
            "step_time_by_batch",
            "engine step time (P50/P99), gaps and tokens by batch size: the knee of the batching curve",
            queries.STEP_TIME_BY_BATCH,
            {"from": _FROM, "to": _TO},
        ),
        NamedQuery(
            "scrape_health",
            "scraped engines (collector --scrape): up now, samples of the last scrape, failures, last error",
            queries.SCRAPE_HEALTH,
            {"from": _FROM, "to": _TO},
        ),
    )
}


def bind(query: NamedQuery, values: dict[str, str], now: float) -> dict[str, Any]:
    """Typed SQL parameters from `key=value` text; ValueError names the bad or missing parameter."""
    unknown = set(values) - set(query.params)
    if unknown:
        raise ValueError(f"unknown parameter(s) {sorted(unknown)} for {query.name}: {sorted(query.params)}")
    out: dict[str, Any] = {}
    for name, p in query.params.items():
        text = values.get(name, p.default)
        if text is None:
            raise ValueError(f"{query.name} needs {name}=... ({p.help})")
        key = p.sql_name or name
        if p.kind == "time":
            out[key] = _FAR_FUTURE_NS if text == "" else int(parse_time(text, now) * 1e9)
        elif p.kind == "int":
            if not text.isdigit() or int(text) < 1:
                raise ValueError(f"{name} must be a positive integer, got {text!r}")
            out[key] = int(text)
        elif p.kind == "choice":
            if text not in p.choices:
                raise ValueError(f"{name} must be one of {list(p.choices)}, got {text!r}")
            out[key] = text
        else:
            if query.name == "waterfall" and not (
                len(text) == 32 and all(c in "0123456789abcdefABCDEF" for c in text)
            ):
                raise ValueError(f"trace_id must be 32 hex digits, got {text!r}")
            out[key] = text
    return out


def run(source: Reader, name: str, values: dict[str, str], now: float) -> QueryResult:
    """Run library query `name` with `values`; KeyError for an unknown name, ValueError for bad values."""
    query = LIBRARY[name]
    return source.query(query.sql, bind(query, values, now))


def _cell(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def table(result: QueryResult) -> str:
    """Columns aligned for a terminal."""
    rows = [[_cell(v) for v in row] for row in result.rows]
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(result.columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(result.columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines) + "\n"


def waterfall(result: QueryResult, width: int = 60) -> str:
    """Spans as indented names with bars on a shared time axis (children under their parent)."""
    spans = result.dicts()
    if not spans:
        return "trace not found\n"
    t0 = min(int(s["start_ns"]) for s in spans)
    t1 = max(int(s["start_ns"]) + int(s["duration_ns"]) for s in spans)
    scale = width / max(1, t1 - t0)
    ids = {s["span_id"] for s in spans}
    depth: dict[str, int] = {}

    def level(s: dict[str, Any]) -> int:
        if s["span_id"] not in depth:
            parent = next((p for p in spans if p["span_id"] == s["parent_span_id"]), None)
            depth[s["span_id"]] = 0 if parent is None or s["parent_span_id"] not in ids else level(parent) + 1
        return depth[s["span_id"]]

    start = dt.datetime.fromtimestamp(t0 / 1e9, dt.UTC).isoformat(timespec="milliseconds")
    lines = [f"trace {len(spans)} spans from {start}, {(t1 - t0) / 1e6:.1f} ms"]
    for s in spans:
        begin = int((int(s["start_ns"]) - t0) * scale)
        length = max(1, int(int(s["duration_ns"]) * scale))
        label = ("  " * min(level(s), 8) + s["name"])[:32]
        bar = " " * begin + "#" * min(length, width - begin)
        lines.append(f"{label:<32} |{bar:<{width}}| {int(s['duration_ns']) / 1e6:9.2f} ms")
    return "\n".join(lines) + "\n"
