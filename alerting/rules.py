"""Alert rules: a TOML file read into typed, validated dataclasses.

    [notify]
    webhook = "http://127.0.0.1:9000/hook"
    interval = "10s"

    [[rule]]                       # a threshold rule: P99 TTFT over the last minute above 2 s for 20 s
    name = "ttft-p99"
    metric = "ttft"                # ttft | tpot | e2e | queue | throughput | goodput | error_rate
    percentile = 99
    threshold = "2s"
    window = "1m"
    for = "20s"
    severity = "page"
    group_by = ["instance"]        # one alert per instance (labelled instance=...); none: the whole fleet

    [[rule]]                       # an SLO burn-rate rule: 99% of requests with TTFT under 2 s
    name = "ttft-slo"
    type = "burn_rate"
    metric = "ttft"
    objective = "99%"
    threshold = "2s"

Every error is a `RuleError` whose message names the file, the rule and the field.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LATENCY_METRICS = {"ttft": "ttft_s", "tpot": "tpot_s", "e2e": "e2e_s", "queue": "queue_s"}
RATE_METRICS = ("throughput", "goodput")  # requests per second; alert when they fall below the threshold
METRICS = (*LATENCY_METRICS, *RATE_METRICS, "error_rate")
FILTERS = ("service", "model", "role", "instance")
SEVERITIES_HINT = "any string; Alertmanager routes on it (page, ticket, warning, ...)"
# Google SRE workbook, chapter 5, "multiwindow, multi-burn-rate alerts" for a 30-day SLO period:
# 2% of the error budget spent in an hour, or 5% in six hours, pages.
DEFAULT_BURN_WINDOWS = ((3600.0, 300.0, 14.4), (21600.0, 1800.0, 6.0))

_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_RULE_KEYS = {
    "name", "metric", "type", "percentile", "threshold", "window", "for", "severity", "hysteresis",
    "min_requests", "objective", "burn", "slo_ttft", "slo_tpot", "labels", "annotations", "summary", "source",
    "group_by", *FILTERS,
}  # fmt: skip
_NOTIFY_KEYS = {"webhook", "interval", "timeout", "max_attempts", "diagnosis_timeout", "headers"}


class RuleError(ValueError):
    """A rules file that cannot be used; the message names the rule and the field."""


@dataclass(frozen=True, slots=True)
class BurnWindow:
    """One pair of the multiwindow test: both burn rates above `factor` means the budget burns too fast."""

    long_s: float
    short_s: float
    factor: float


@dataclass(frozen=True, slots=True)
class Notify:
    """Where and how often: the webhook (None: log only), the evaluation interval, delivery limits."""

    webhook: str | None = None
    interval_s: float = 10.0
    timeout_s: float = 5.0  # per POST
    max_attempts: int = 8  # per notification, with exponential backoff between them
    diagnosis_timeout_s: float = 30.0
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Rule:
    """One alert rule. `kind` is "threshold" (a windowed metric against `threshold`) or "burn_rate"
    (the error-budget burn rate of an SLO `objective` over `burn` window pairs)."""

    name: str
    metric: str
    kind: str = "threshold"
    percentile: float = 99.0
    threshold: float = 0.0  # seconds for latencies, requests/s for rates, a fraction for error_rate
    window_s: float = 60.0
    for_s: float = 0.0
    severity: str = "page"
    hysteresis: float = 0.1  # resolve only once the value is this fraction on the good side of threshold
    min_requests: int = 10  # fewer samples in the window: no data, neither breach nor recovery
    objective: float = 0.0  # burn_rate: the fraction of requests that must be good (0.99)
    burn: tuple[BurnWindow, ...] = ()
    slo_ttft_s: float | None = None  # goodput: a request counts when it meets these
    slo_tpot_s: float | None = None
    filters: tuple[tuple[str, str], ...] = ()  # (service|model|role|instance, value)
    labels: tuple[tuple[str, str], ...] = ()
    annotations: tuple[tuple[str, str], ...] = ()
    source: str = "spans"  # spans: the requests table; metrics: engines' scraped latency histograms
    group_by: tuple[str, ...] = ()  # ("instance",): evaluated once per instance seen in the window
    alertname: str = ""  # a grouped rule's per-instance copy: the rule's own name (`name` is NAME/INSTANCE)

    def for_group(self, key: str, value: str) -> Rule:
        """The copy of a grouped rule that watches one instance (its state is kept apart by name)."""
        return dataclasses.replace(
            self, name=f"{self.name}/{value}", alertname=self.name, group_by=(),
            filters=(*self.filters, (key, value)),
        )  # fmt: skip

    @property
    def above(self) -> bool:
        """True when a larger value is worse (latency, error rate, burn rate)."""
        return self.kind == "burn_rate" or self.metric not in RATE_METRICS

    def describe(self) -> str:
        """One line: what the rule watches."""
        where = "".join(f" {k}={v}" for k, v in self.filters)
        if self.kind == "burn_rate":
            pairs = ", ".join(
                f"{fmt_duration(w.long_s)}/{fmt_duration(w.short_s)} > {w.factor:g}x" for w in self.burn
            )
            good = "no error" if self.metric == "error_rate" else f"{self.metric} <= {fmt_value(self)}"
            return (
                f"{self.name}: SLO {self.objective * 100:.4g}% {good}{where}; burn {pairs}; "
                f"for {fmt_duration(self.for_s)} [{self.severity}]"
            )
        stat = f"p{self.percentile:g} {self.metric}" if self.metric in LATENCY_METRICS else self.metric
        if self.source == "metrics":
            stat += " (from metrics)"
        op = ">" if self.above else "<"
        return (
            f"{self.name}: {stat}{where} {op} {fmt_value(self)} over {fmt_duration(self.window_s)} "
            f"for {fmt_duration(self.for_s)} [{self.severity}]"
        )


@dataclass(frozen=True, slots=True)
class RuleSet:
    """A parsed rules file."""

    notify: Notify
    rules: tuple[Rule, ...]
    source: str = "<rules>"


def load_rules(path: str | Path) -> RuleSet:
    """Read and validate a rules file. Raises RuleError (file missing, bad TOML, bad rule)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise RuleError(f"{p}: cannot read: {e.strerror or e}") from None
    return parse_rules(text, str(p))


def parse_rules(text: str, source: str = "<rules>") -> RuleSet:
    """Parse TOML text into a RuleSet. Raises RuleError naming the rule and field."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise RuleError(f"{source}: not valid TOML: {e}") from None
    unknown = set(doc) - {"notify", "rule"}
    if unknown:
        raise RuleError(f"{source}: unknown top-level key {sorted(unknown)[0]!r} (use [notify] and [[rule]])")
    notify = _notify(doc.get("notify", {}), source)
    raw_rules = doc.get("rule", [])
    if not isinstance(raw_rules, list) or not raw_rules:
        raise RuleError(f"{source}: no [[rule]] tables")
    rules, seen = [], set()
    for i, raw in enumerate(raw_rules):
        rule = _rule(raw, f"{source}: rule #{i + 1}", source)
        if rule.name in seen:
            raise RuleError(f"{source}: rule {rule.name!r} field 'name': duplicate rule name")
        seen.add(rule.name)
        rules.append(rule)
    return RuleSet(notify, tuple(rules), source)


def parse_duration(value: Any) -> float:
    """`10s`, `1m`, `2h`, `500ms`, `1d`, or a number of seconds -> seconds. ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)\s*", str(value))
        if not m:
            raise ValueError(f"{value!r} is not a duration like 10s, 1m, 2h")
        seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{value!r} is not a duration like 10s, 1m, 2h")
    return seconds


def parse_quantity(value: Any) -> float:
    """`2s`, `80ms` (-> seconds), `1.5%` (-> 0.015), or a plain number. ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a number")
    if isinstance(value, int | float):
        number = float(value)
    else:
        text = str(value).strip()
        if text.endswith("%"):
            number = _float(text[:-1]) / 100.0
        elif re.fullmatch(r".*\d\s*(ms|s|m|h|d)", text):
            number = parse_duration(text)
        else:
            number = _float(text)
    if not math.isfinite(number):
        raise ValueError(f"{value!r} is not a finite number")
    return number


def fmt_duration(seconds: float) -> str:
    """Seconds as the shortest of `90s`, `5m`, `2h`, `250ms`."""
    if seconds == 0:
        return "0s"
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0), ("s", 1.0)):
        if seconds >= size and (seconds / size).is_integer():
            return f"{int(seconds / size)}{unit}"
    return f"{seconds:g}s" if seconds >= 1 else f"{seconds * 1000:g}ms"


def fmt_value(rule: Rule, value: float | None = None) -> str:
    """A value of the rule's metric with its unit (the threshold when `value` is None)."""
    v = rule.threshold if value is None else value
    if rule.metric in LATENCY_METRICS:
        return f"{v:.3g}s" if v >= 1 else f"{v * 1000:.3g}ms"
    if rule.metric == "error_rate":
        return f"{v:.3%}"
    return f"{v:.3g} req/s"


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None


def _notify(raw: Any, source: str) -> Notify:
    where = f"{source}: [notify]"
    if not isinstance(raw, dict):
        raise RuleError(f"{where}: must be a table")
    for key in raw:
        if key not in _NOTIFY_KEYS:
            raise RuleError(f"{where} field {key!r}: unknown (known: {', '.join(sorted(_NOTIFY_KEYS))})")
    webhook = raw.get("webhook")
    if webhook is not None and (not isinstance(webhook, str) or not re.match(r"https?://[^/\s]+", webhook)):
        raise RuleError(f"{where} field 'webhook': {webhook!r} is not an http(s) URL")
    headers = raw.get("headers", {})
    if not isinstance(headers, dict) or not all(isinstance(v, str) for v in headers.values()):
        raise RuleError(f"{where} field 'headers': must be a table of strings")
    values = {}
    for key, name, default in (
        ("interval", "interval_s", "10s"),
        ("timeout", "timeout_s", "5s"),
        ("diagnosis_timeout", "diagnosis_timeout_s", "30s"),
    ):
        try:
            values[name] = parse_duration(raw.get(key, default))
        except ValueError as e:
            raise RuleError(f"{where} field {key!r}: {e}") from None
        if values[name] <= 0:
            raise RuleError(f"{where} field {key!r}: must be positive")
    attempts = raw.get("max_attempts", 8)
    if not isinstance(attempts, int) or isinstance(attempts, bool) or attempts < 1:
        raise RuleError(f"{where} field 'max_attempts': must be a positive integer")
    return Notify(webhook, max_attempts=attempts, headers=tuple(sorted(headers.items())), **values)


def _rule(raw: Any, where: str, source: str) -> Rule:
    if not isinstance(raw, dict):
        raise RuleError(f"{where}: must be a table")
    name = raw.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.:-]+", name):
        raise RuleError(f"{where} field 'name': {name!r} must be a word of letters, digits, _ . : -")
    where = f"{source}: rule {name!r}"

    def bad(key: str, message: str) -> RuleError:
        return RuleError(f"{where} field {key!r}: {message}")

    for key in raw:
        if key not in _RULE_KEYS:
            raise bad(key, f"unknown (known: {', '.join(sorted(_RULE_KEYS))})")
    kind = raw.get("type", "threshold")
    if kind not in ("threshold", "burn_rate"):
        raise bad("type", f"{kind!r} is not threshold or burn_rate")
    metric = raw.get("metric")
    if metric not in METRICS:
        raise bad("metric", f"{metric!r} is not one of {' | '.join(METRICS)}")

    def get(key: str, parse: Any, default: Any) -> Any:
        if key not in raw:
            return default
        try:
            return parse(raw[key])
        except (ValueError, TypeError) as e:
            raise bad(key, str(e)) from None

    args: dict[str, Any] = {"name": name, "metric": metric, "kind": kind}
    args["percentile"] = get("percentile", parse_quantity, 99.0)
    if not 0 < args["percentile"] <= 100:
        raise bad("percentile", f"{raw.get('percentile')!r} must be in (0, 100]")
    if "threshold" not in raw and not (kind == "burn_rate" and metric == "error_rate"):
        raise bad("threshold", "missing")
    args["threshold"] = get("threshold", parse_quantity, 0.0)
    if args["threshold"] < 0:
        raise bad("threshold", "must not be negative")
    if metric == "error_rate" and args["threshold"] > 1:
        raise bad("threshold", "an error rate is a fraction or a percent (1% or 0.01)")
    args["window_s"] = get("window", parse_duration, 60.0)
    if args["window_s"] <= 0:
        raise bad("window", "must be positive")
    args["for_s"] = get("for", parse_duration, 0.0)
    severity = raw.get("severity", "page")
    if not isinstance(severity, str) or not severity:
        raise bad("severity", f"{severity!r}: {SEVERITIES_HINT}")
    args["severity"] = severity
    args["hysteresis"] = get("hysteresis", parse_quantity, 0.1)
    if not 0 <= args["hysteresis"] < 1:
        raise bad("hysteresis", "must be in [0, 1): a fraction such as 0.1 or 10%")
    min_requests = raw.get("min_requests", 10)
    if not isinstance(min_requests, int) or isinstance(min_requests, bool) or min_requests < 1:
        raise bad("min_requests", "must be a positive integer")
    args["min_requests"] = min_requests
    for key, attr in (("slo_ttft", "slo_ttft_s"), ("slo_tpot", "slo_tpot_s")):
        args[attr] = get(key, parse_duration, None)
        if args[attr] is not None and metric != "goodput":
            raise bad(key, "only goodput rules take it")
    filters = []
    for key in FILTERS:
        if key in raw:
            if not isinstance(raw[key], str) or not raw[key]:
                raise bad(key, "must be a non-empty string")
            filters.append((key, raw[key]))
    args["filters"] = tuple(filters)
    source_kind = raw.get("source", "spans")
    if source_kind not in ("spans", "metrics"):
        raise bad("source", f"{source_kind!r} is not spans or metrics")
    if source_kind == "metrics":
        if kind != "threshold" or metric not in LATENCY_METRICS:
            raise bad(
                "source",
                "metrics (scraped latency histograms) serve threshold rules on ttft, tpot, e2e, queue",
            )
        if {k for k, _ in filters} - {"service", "instance"}:
            raise bad(
                "source", "scraped samples carry service and instance only: drop model and role filters"
            )
    args["source"] = source_kind
    group_by = raw.get("group_by", [])
    if (
        not isinstance(group_by, list)
        or len(group_by) > 1
        or not all(g in ("instance", "service") for g in group_by)
    ):
        raise bad("group_by", 'must be ["instance"] or ["service"]')
    if any(g in raw for g in group_by):
        raise bad("group_by", "a rule cannot both filter on and group by the same key")
    args["group_by"] = tuple(group_by)
    for key in ("labels", "annotations"):
        table = raw.get(key, {})
        if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
            raise bad(key, "must be a table of strings")
        args[key] = tuple(sorted(table.items()))
    if "summary" in raw:
        args["annotations"] = (*args["annotations"], ("summary_template", str(raw["summary"])))
    if kind == "burn_rate":
        if metric in RATE_METRICS:
            raise bad("metric", "a burn-rate SLO needs ttft, tpot, e2e, queue or error_rate")
        args["objective"] = get("objective", parse_quantity, None)
        if args["objective"] is None:
            raise bad("objective", "missing (such as 99% or 0.99)")
        if args["objective"] > 1:  # "objective = 99" means 99%
            args["objective"] /= 100.0
        if not 0 < args["objective"] < 1:
            raise bad("objective", "must be between 0% and 100%, exclusive")
        args["burn"] = _burn(raw.get("burn"), bad)
    else:
        for key in ("objective", "burn"):
            if key in raw:
                raise bad(key, 'only burn_rate rules take it (add type = "burn_rate")')
    return Rule(**args)


def _burn(raw: Any, bad: Any) -> tuple[BurnWindow, ...]:
    if raw is None:
        return tuple(BurnWindow(*w) for w in DEFAULT_BURN_WINDOWS)
    if not isinstance(raw, list) or not raw:
        raise bad("burn", "must be an array of tables {long, short, factor}")
    out = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or set(item) - {"long", "short", "factor"}:
            raise bad(f"burn[{i}]", "must be a table with long, short and factor")
        try:
            long_s, short_s = parse_duration(item["long"]), parse_duration(item["short"])
            factor = parse_quantity(item["factor"])
        except KeyError as e:
            raise bad(f"burn[{i}].{e.args[0]}", "missing") from None
        except ValueError as e:
            raise bad(f"burn[{i}]", str(e)) from None
        if not 0 < short_s <= long_s or factor <= 0:
            raise bad(f"burn[{i}]", "needs 0 < short <= long and a positive factor")
        out.append(BurnWindow(long_s, short_s, factor))
    return tuple(out)
