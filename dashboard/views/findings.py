"""Findings: the diagnosis of a window against a baseline, each finding with its evidence charted, the
lever, and the SQL that reproduces it. The page renders the diagnosis's JSON; it derives no cause."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pandas as pd
import streamlit as st

from dashboard import charts, data, findings, queries, ui
from dashboard.timerange import TimeRange

BEFORE = "the same length just before the window"
HALVES = "first half of the range against its second half"


def _fmt(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%H:%M:%S")


def _count(ctx: ui.Context, r: TimeRange) -> int | None:
    df = ui.fetch("the baseline's request count", data.sql, ctx.api, queries.COUNT_IN_RANGE, r.params())
    return None if df is None or df.empty else int(df.iloc[0]["requests"])


def choose(ctx: ui.Context) -> tuple[TimeRange, TimeRange] | None:
    """(window, baseline): the range against the span before it, or its two halves when the span before
    holds nothing (stored data older than the default window) or when asked."""
    mode = st.radio("Baseline", [BEFORE, HALVES], horizontal=True, key="findings_baseline")
    window, baseline = ctx.range, ctx.range.before()
    if mode == BEFORE:
        n = _count(ctx, baseline)
        if n is None:
            return None
        if n == 0:
            st.info(
                "No requests in the span before the window: comparing the second half of the range "
                "with its first half instead."
            )
            mode = HALVES
    if mode == HALVES:
        baseline, window = ctx.range.halves()
    st.caption(
        f"Window {_fmt(window.since)} to {_fmt(window.until)} UTC against baseline "
        f"{_fmt(baseline.since)} to {_fmt(baseline.until)} UTC ({baseline.label})."
    )
    return window, baseline


def symptom_chart(ctx: ui.Context, window: TimeRange, baseline: TimeRange) -> None:
    """P99 TTFT and TPOT across baseline and window, the two spans shaded."""
    whole = TimeRange(min(window.since, baseline.since), max(window.until, baseline.until), "both")
    df = ui.fetch(
        "latency percentiles", data.percentiles, ctx.api, whole.since, whole.until, whole.interval_s
    )
    if not ui.has_rows(df, "No requests in the window or its baseline."):
        return
    assert df is not None
    df = ui.ms(df, ["p99_ttft_s", "p99_tpot_s"])
    spans = pd.DataFrame(
        {
            "start": pd.to_datetime([baseline.since, window.since], unit="s", utc=True),
            "end": pd.to_datetime([baseline.until, window.until], unit="s", utc=True),
            "span": ["baseline", "window"],
        }
    )
    ys = {"p99_ttft_ms": "P99 TTFT", "p99_tpot_ms": "P99 TPOT"}
    st.altair_chart(
        charts.window_shading(df, "bucket", ys, "latency (ms)", spans, title="Symptoms: P99 latency"),
        width="stretch",
    )


def regressions(result: dict[str, Any]) -> None:
    """The symptom regressions the diagnosis found significant."""
    rows = result.get("regressions") or []
    if not rows:
        st.success("No significant regression between the baseline and the window.")
        return
    st.subheader("Regressions")
    st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")


def finding(i: int, f: dict[str, Any]) -> None:
    """One finding: cause, confidence, symptoms, onset, evidence chart, lever, SQL."""
    with st.container(border=True):
        confidence = f.get("confidence")
        head = f"{i}. {f.get('cause', 'unnamed cause')}"
        if isinstance(confidence, int | float):
            head += f" (confidence {confidence:.0%})"
        st.subheader(head)
        symptoms = f.get("symptoms") or []
        if symptoms:
            st.markdown("**Symptoms:** " + ", ".join(str(s) for s in symptoms))
        if f.get("onset") is not None:
            st.markdown(f"**Onset:** {f['onset']}")
        rows = [
            {"metric": e.get("metric"), "side": side, "value": e.get(side)}
            for e in f.get("evidence") or []
            for side in ("baseline", "current")
            if isinstance(e.get(side), int | float)
        ]
        if rows:
            st.altair_chart(charts.evidence(pd.DataFrame(rows), title="Evidence: baseline vs window"))
        if f.get("lever"):
            st.markdown(f"**Lever:** {f['lever']}")
        if f.get("sql"):
            with st.expander("SQL to reproduce"):
                st.code(f["sql"], language="sql")


def render(ctx: ui.Context) -> None:
    """The page."""
    st.title("Findings")
    ui.range_note(ctx)
    chosen = choose(ctx)
    if chosen is None:
        return
    window, baseline = chosen
    symptom_chart(ctx, window, baseline)
    try:
        result = findings.diagnose(ctx.api, (window.since, window.until), (baseline.since, baseline.until))
    except findings.DiagnosisUnavailable as e:
        st.info(f"Diagnosis unavailable: {e}")
        return
    regressions(result)
    found = result.get("findings") or []
    if not found:
        st.info("The diagnosis names no cause for this window.")
    for i, f in enumerate(found, 1):
        finding(i, f)


render(ui.context())
