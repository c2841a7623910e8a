"""What a notification says: the summary, the breakdown of the breached metric, and the diagnosis's top
findings for the alert's window against the window before it.

The diagnosis is looked up when an alert fires (`diagnosis.diagnose`, or `diagnosis.api.diagnose`), run
on its own thread with a time limit, and never allowed to stop a notification: if it is missing, fails or
is too slow, the notification goes out with the breakdown and a note saying why the findings are absent.
"""

from __future__ import annotations

import importlib
import json
import logging
import threading
from typing import Any

from alerting.evaluator import Transition
from alerting.notify import iso
from alerting.queries import QuerySource, breakdown, breakdown_text, headline
from alerting.rules import LATENCY_METRICS, Rule, fmt_duration, fmt_value
from collector.client import ReadError

log = logging.getLogger(__name__)

TOP_FINDINGS = 3


class DiagnosisSource:
    """Presents a QuerySource as a `collector.client.Reader` (`description`, `query`, `close`), the
    diagnosis's read path, turning query failures into its ReadError."""

    def __init__(self, source: QuerySource, description: str) -> None:
        self._source = source
        self.description = description

    def query(self, sql: str, params: dict[str, Any] | None = None) -> Any:
        try:
            return self._source.query(sql, params or {})
        except Exception as e:
            raise ReadError(str(e)) from e

    def close(self) -> None:
        """The wrapped source belongs to the caller."""


def alert_window(rule: Rule, transition: Transition, interval_s: float) -> tuple[tuple[float, float], ...]:
    """(window, baseline). The window runs from the last evaluation that saw no breach to the firing, at
    most the rule's window long (so it holds the breach, not the calm before it) and at least three
    intervals (so the diagnosis has samples). The baseline is as long and ends where the window starts,
    or where the breach began if that is earlier (a `for` longer than the window)."""
    now = transition.at
    cap = rule.window_s if rule.kind == "threshold" else min(w.short_s for w in rule.burn)
    calm_until = now - cap if transition.active_at is None else transition.active_at - interval_s
    start = min(max(calm_until, now - cap), now - 3 * interval_s)
    length = now - start
    end = min(start, calm_until)
    return (start, now), (end - length, end)


def run_diagnosis(
    source: DiagnosisSource, window: tuple[float, float], baseline: tuple[float, float], timeout_s: float
) -> tuple[list[dict[str, Any]], str]:
    """The diagnosis's findings (best first) and a note ("" when it ran). Never raises."""
    try:
        diagnose = _diagnose_function()
        from collector.timerange import TimeRange
    except Exception as e:  # not installed yet, or broken: the breakdown still goes out
        return [], f"diagnosis unavailable ({type(e).__name__}: {e})"
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            result = diagnose(source, window=TimeRange(*window), baseline=TimeRange(*baseline))
            box["json"] = result.to_json() if hasattr(result, "to_json") else result
        except Exception as e:
            box["error"] = f"{type(e).__name__}: {e}"

    thread = threading.Thread(target=work, name="alert-diagnosis", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return [], f"diagnosis did not finish within {fmt_duration(timeout_s)}"
    if "error" in box:
        log.warning("diagnosis for an alert failed: %s", box["error"])
        return [], f"diagnosis failed ({box['error'][:300]})"
    result = box.get("json") or {}
    findings = sorted(result.get("findings") or [], key=lambda f: -(f.get("confidence") or 0))
    if findings:
        return findings, ""
    moved = ", ".join(
        f"{r.get('metric')} {_v(r.get('baseline'))} -> {_v(r.get('current'))}"
        for r in (result.get("regressions") or [])[:3]
    )
    return [], "the diagnosis found no cause it could stand behind" + (
        f" (regressions: {moved})" if moved else ""
    )


def _diagnose_function() -> Any:
    for name in ("diagnosis", "diagnosis.api"):
        try:
            fn = getattr(importlib.import_module(name), "diagnose", None)
        except ImportError:
            continue
        if callable(fn):
            return fn
    raise ImportError("no diagnose() in diagnosis or diagnosis.api")


def findings_text(findings: list[dict[str, Any]]) -> str:
    """Top findings, one line each: cause, confidence, onset, evidence (metric baseline -> current), lever."""
    lines = []
    for i, f in enumerate(findings[:TOP_FINDINGS], 1):
        evidence = "; ".join(
            f"{e.get('metric')} {_v(e.get('baseline'))} -> {_v(e.get('current'))}"
            for e in (f.get("evidence") or [])[:4]
        )
        confidence = f.get("confidence")
        head = f"{i}. {f.get('cause')}" + (
            f" (confidence {confidence:.2f})" if confidence is not None else ""
        )
        if f.get("onset"):
            head += f", since {f['onset'] if isinstance(f['onset'], str) else iso(float(f['onset']))}"
        lines.append(
            head
            + (f": {evidence}" if evidence else "")
            + (f". Lever: {f['lever']}" if f.get("lever") else "")
        )
    return "\n".join(lines)


def compact_findings(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The top findings with only what a receiver needs: cause, confidence, onset, evidence, lever."""
    keys = ("cause", "confidence", "onset", "evidence", "lever")
    return [{k: f.get(k) for k in keys if k in f} for f in findings[:TOP_FINDINGS]]


def summary(rule: Rule, transition: Transition) -> str:
    """`TTFT P99 is 3.1s over the last 1m (threshold 2s), breaching since ...` or its resolved form."""
    if rule.kind == "burn_rate":
        what = f"{rule.metric} SLO ({rule.objective * 100:.4g}%) error budget"
        value = "n/a" if transition.value is None else f"{transition.value:.2f}x the burn-rate limit"
        if transition.new == "resolved":
            return f"{what} burn back under its limit ({value}) for {fmt_duration(rule.for_s)}"
        return f"{what} burning too fast: {value}, since {iso(transition.active_at)}"
    stat = f"{rule.metric.upper()} P{rule.percentile:g}" if rule.metric in LATENCY_METRICS else rule.metric
    where = "".join(f" {k}={v}" for k, v in rule.filters)
    value = "no data" if transition.value is None else fmt_value(rule, transition.value)
    if transition.new == "resolved":
        return (
            f"{stat}{where} back to {value} over the last {fmt_duration(rule.window_s)} "
            f"(threshold {fmt_value(rule)}, held clear for {fmt_duration(rule.for_s)})"
        )
    return (
        f"{stat}{where} is {value} over the last {fmt_duration(rule.window_s)} "
        f"(threshold {fmt_value(rule)}), breaching since {iso(transition.active_at)}"
    )


def annotate(
    rule: Rule,
    transition: Transition,
    source: QuerySource | None,
    *,
    interval_s: float,
    diagnosis_timeout_s: float,
    description: str = "stepscope",
) -> tuple[dict[str, str], dict[str, Any]]:
    """Annotations for a firing alert (strings, as Alertmanager carries them) and the structured details
    stored in history: summary, breakdown, findings and the windows they were computed on."""
    notes = dict(rule.annotations)
    notes.pop("summary_template", None)
    ann: dict[str, str] = {"summary": summary(rule, transition), "description": rule.describe(), **notes}
    details: dict[str, Any] = {"summary": ann["summary"]}
    if source is None:
        return ann, details
    window, baseline = alert_window(rule, transition, interval_s)
    details["window"], details["baseline"] = window, baseline
    ann["window"] = f"{iso(window[0])} .. {iso(window[1])} vs {iso(baseline[0])} .. {iso(baseline[1])}"
    try:
        b = breakdown(rule, source, window, baseline)
        ann["breakdown"] = breakdown_text(b)
        details["breakdown"] = b
        if headline(b):
            ann["summary"] += f"; {headline(b)}"
    except Exception as e:  # the store may be momentarily down; the alert still goes out
        ann["breakdown"] = f"breakdown unavailable ({type(e).__name__}: {e})"
    findings, note = run_diagnosis(
        DiagnosisSource(source, description), window, baseline, diagnosis_timeout_s
    )
    top = compact_findings(findings)
    details["findings"] = top
    ann["findings"] = findings_text(findings) or note
    ann["findings_json"] = json.dumps(top, default=str)
    if note:
        details["note"] = note
    if findings:
        ann["summary"] += f"; likely cause: {findings[0].get('cause')}"
    return ann, details


def _v(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)
