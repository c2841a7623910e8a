"""The SQL of alerting, over `requests`: one observation per rule, and the breakdown sent with a firing.
Rules with `source = "metrics"` read the engines' scraped latency histograms (collector/histograms.py).

A request belongs to a window by its `end_time` (when it finished, so when its latencies are known).
Text is constant or assembled from fixed fragments; every value (times, thresholds, the percentile,
service/model/role filters) is a ClickHouse server-side parameter, so rule files never reach SQL text.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from alerting.evaluator import Observation
from alerting.rules import LATENCY_METRICS, Rule, fmt_duration
from collector import histograms
from collector.sqlfn import QUANTILE
from collector.store import QueryResult

# rule metric -> the scraped histogram of it (an engine's TPOT is its inter-token latency histogram)
HISTOGRAM_OF = {"ttft": "ttft_s", "tpot": "itl_s", "e2e": "e2e_s", "queue": "queue_s"}
NO_LIMIT_S = 1e300  # a goodput SLO bound left unset
LONGEST_REQUEST_S = 3600.0  # requests are found by start time (the sort key) this far before a window
_FILTER_SQL = {
    "service": "service = {service:String}",
    "model": "model = {model:String}",
    "role": "role = {role:String}",
    "instance": "instance = {instance:String}",
}


class QuerySource(Protocol):
    """Anything that runs read-only SQL with `{name:Type}` parameters: the store's read path, a collector's
    `/api/sql` (collector.client.ApiReader), or any collector.client.Reader."""

    def query(self, sql: str, parameters: dict[str, Any] | None = None, /) -> QueryResult: ...


def _where(rule: Rule, since: float, until: float) -> tuple[str, dict[str, Any]]:
    conditions = [
        "time >= fromUnixTimestamp64Nano(toInt64(({since:Float64} - {longest:Float64}) * 1e9))",
        "end_time >= fromUnixTimestamp64Nano(toInt64({since:Float64} * 1e9))",
        "end_time < fromUnixTimestamp64Nano(toInt64({until:Float64} * 1e9))",
    ]
    params: dict[str, Any] = {"since": since, "until": until, "longest": LONGEST_REQUEST_S}
    for key, value in rule.filters:
        conditions.append(_FILTER_SQL[key])
        params[key] = value
    return " WHERE " + " AND ".join(conditions), params


def groups(rule: Rule, source: QuerySource, now: float) -> list[tuple[str, str]]:
    """(key, value) of each group of a `group_by` rule with requests in its lookback window."""
    out = []
    for key in rule.group_by:
        lookback = max((w.long_s for w in rule.burn), default=rule.window_s)
        where, params = _where(rule, now - lookback, now)
        rows = source.query(
            f"SELECT DISTINCT {_GROUP_COLUMN[key]} FROM requests{where} ORDER BY 1", params
        ).rows
        out += [(key, str(r[0])) for r in rows]
    return out


_GROUP_COLUMN = {"instance": "instance", "service": "service"}


def _num(value: Any) -> float | None:
    if value is None:
        return None
    v = float(value)
    return v if math.isfinite(v) else None


def observe(rule: Rule, source: QuerySource, now: float) -> Observation:
    """Measure `rule`'s metric over the window ending at `now`."""
    if rule.kind == "burn_rate":
        return _burn_rate(rule, source, now)
    if rule.source == "metrics":
        got = histograms.percentiles(
            source, HISTOGRAM_OF[rule.metric], now - rule.window_s, now, (rule.percentile / 100.0,),
            **dict(rule.filters),
        )  # fmt: skip
        n = int(got.pop("count"))
        return Observation(_num(next(iter(got.values()))) if n else None, n)
    where, params = _where(rule, now - rule.window_s, now)
    if rule.metric in LATENCY_METRICS:
        col = LATENCY_METRICS[rule.metric]
        params["q"] = rule.percentile / 100.0
        sql = f"SELECT countIf(isNotNull({col})), {QUANTILE}({{q:Float64}})({col}) FROM requests{where}"
    elif rule.metric == "error_rate":
        sql = f"SELECT count(), avg(is_error) FROM requests{where}"
    elif rule.metric == "throughput":
        sql = f"SELECT count(), count() FROM requests{where}"
    else:  # goodput: requests per second that finished without error inside the SLO bounds
        params["slo_ttft"] = rule.slo_ttft_s if rule.slo_ttft_s is not None else NO_LIMIT_S
        params["slo_tpot"] = rule.slo_tpot_s if rule.slo_tpot_s is not None else NO_LIMIT_S
        sql = (
            "SELECT count(), countIf(is_error = 0 AND ifNull(ttft_s, 0) <= {slo_ttft:Float64} "
            f"AND ifNull(tpot_s, 0) <= {{slo_tpot:Float64}}) FROM requests{where}"
        )
    n, value = source.query(sql, params).rows[0]
    n = int(n or 0)
    v = _num(value)
    if rule.metric in ("throughput", "goodput"):
        v = (v or 0.0) / rule.window_s
    return Observation(None if n == 0 and rule.metric in LATENCY_METRICS else v, n)


def _burn_rate(rule: Rule, source: QuerySource, now: float) -> Observation:
    """Error-budget burn rate per window: (bad / total) / (1 - objective). The value is the worst window
    pair's min(long burn, short burn) / factor, so a value above 1 means both windows of a pair burn faster
    than the pair's factor (the SRE workbook's multiwindow condition)."""
    durations = sorted({d for w in rule.burn for d in (w.long_s, w.short_s)})
    where, params = _where(rule, now - durations[-1], now)
    if rule.metric == "error_rate":
        total, bad = "1", "is_error = 1"
    else:
        col = LATENCY_METRICS[rule.metric]
        total = f"(is_error = 1 OR isNotNull({col}))"
        bad = f"(is_error = 1 OR {col} > {{threshold:Float64}})"
        params["threshold"] = rule.threshold
    columns = []
    for i, d in enumerate(durations):
        params[f"w{i}"] = now - d
        recent = f"end_time >= fromUnixTimestamp64Nano(toInt64({{w{i}:Float64}} * 1e9))"
        columns.append(f"countIf({recent} AND {total}), countIf({recent} AND {bad})")
    row = source.query(f"SELECT {', '.join(columns)} FROM requests{where}", params).rows[0]
    budget = 1.0 - rule.objective
    burn, counts = {}, {}
    for i, d in enumerate(durations):
        n, k = int(row[2 * i] or 0), int(row[2 * i + 1] or 0)
        counts[d] = n
        burn[d] = (k / n) / budget if n else 0.0
    worst = max(min(burn[w.long_s], burn[w.short_s]) / w.factor for w in rule.burn)
    detail = tuple((f"burn_rate_{fmt_duration(d)}", round(burn[d], 4)) for d in durations)
    return Observation(worst, min(counts.values()), detail)


def breakdown(
    rule: Rule, source: QuerySource, window: tuple[float, float], baseline: tuple[float, float]
) -> dict:
    """Means of the TTFT and E2E parts, arrivals and prompt sizes in `window` and in `baseline`, measured on
    the same requests table the rule reads; the evidence a firing alert carries even without a diagnosis."""
    where, params = _where(rule, baseline[0], window[1])
    params["split"] = window[0]
    sql = (
        "SELECT end_time >= fromUnixTimestamp64Nano(toInt64({split:Float64} * 1e9)) AS current, count(), "
        "avg(ttft_s), avg(queue_s), avg(prefill_s), avg(kv_transfer_s), avg(decode_s), avg(e2e_s), "
        "avg(tpot_s), avg(input_tokens), avg(output_tokens), avg(is_error), avg(preemptions) "
        f"FROM requests{where} GROUP BY current"
    )
    names = ("requests", "ttft_s", "queue_s", "prefill_s", "kv_transfer_s", "decode_s", "e2e_s", "tpot_s",
             "input_tokens", "output_tokens", "error_rate", "preemptions")  # fmt: skip
    periods: dict[str, dict[str, float | None]] = {
        "window": dict.fromkeys(names, None),
        "baseline": dict.fromkeys(names, None),
    }
    for row in source.query(sql, params).rows:
        key = "window" if int(row[0]) else "baseline"
        periods[key] = {name: _num(v) for name, v in zip(names, row[1:], strict=True)}
    for key, (start, end) in (("window", window), ("baseline", baseline)):
        periods[key]["arrivals_per_s"] = (periods[key]["requests"] or 0.0) / max(end - start, 1e-9)
    total = "e2e_s" if rule.metric == "e2e" else "ttft_s"
    parts = ("queue_s", "prefill_s", "kv_transfer_s") + (("decode_s",) if total == "e2e_s" else ())
    shares = []
    for part in parts:
        now_v, was_v = periods["window"][part], periods["baseline"][part]
        now_t, was_t = periods["window"][total], periods["baseline"][total]
        shares.append({
            "part": part.removesuffix("_s"),
            "current_s": now_v,
            "baseline_s": was_v,
            "share": now_v / now_t if now_v is not None and now_t else None,
            "baseline_share": was_v / was_t if was_v is not None and was_t else None,
        })  # fmt: skip
    return {"of": total.removesuffix("_s"), "parts": shares, **periods}


def breakdown_text(b: dict) -> str:
    """One paragraph: `TTFT mean 3.2 s (was 180 ms): queue 2.6 s = 80% of it (was 144 ms, 80%); ...`."""
    w, base = b["window"], b["baseline"]
    of = b["of"]
    text = f"{of.upper()} mean {_s(w[of + '_s'])} (was {_s(base[of + '_s'])}):"
    items = []
    for p in b["parts"]:
        if p["current_s"] is None and p["baseline_s"] is None:
            continue
        items.append(
            f"{p['part'].replace('_', ' ')} {_s(p['current_s'])} = {_pct(p['share'])} of it "
            f"(was {_s(p['baseline_s'])}, {_pct(p['baseline_share'])})"
        )
    text += " " + ("; ".join(items) if items else "no phase timings on these requests")
    text += (
        f". Arrivals {w['arrivals_per_s']:.3g}/s (x{_ratio(w['arrivals_per_s'], base['arrivals_per_s'])}),"
        f" prompts {_n(w['input_tokens'])} tokens (x{_ratio(w['input_tokens'], base['input_tokens'])}),"
        f" errors {_pct(w['error_rate'])} (was {_pct(base['error_rate'])})."
    )
    return text


def headline(b: dict) -> str:
    """The part that grew most, in a few words: `queue time is 80% of TTFT (2.03 s, was 160 ms), arrivals
    x1.80`; "" when the requests carry no phase timings."""
    grown = [p for p in b["parts"] if p["current_s"] is not None and p["share"] is not None]
    if not grown:
        return ""
    top = max(grown, key=lambda p: p["current_s"] - (p["baseline_s"] or 0.0))
    w, base = b["window"], b["baseline"]
    return (
        f"{top['part'].replace('_', ' ')} time is {_pct(top['share'])} of {b['of'].upper()} "
        f"({_s(top['current_s'])}, was {_s(top['baseline_s'])}), "
        f"arrivals x{_ratio(w['arrivals_per_s'], base['arrivals_per_s'])}"
    )


def _s(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v:.3g} s" if v >= 1 else f"{v * 1000:.3g} ms"


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0%}"


def _n(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "n/a"
