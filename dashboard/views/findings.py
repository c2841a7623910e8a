"""Findings: the diagnosis of a window against a baseline, each finding with its evidence charted, the
lever, and the SQL that reproduces it. The page renders the diagnosis's JSON; it derives no cause."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pandas as pd
import streamlit as st

from collector.timerange import TimeRange
from dashboard import charts, data, findings, queries, ui

BEFORE = "the same length just before the range"
CHANGE_POINT = "a change point inside the range (found by the diagnosis)"


def _fmt(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%H:%M:%S")


def _count(ctx: ui.Context, r: TimeRange) -> int | None:
    df = ui.fetch("the baseline's request count", data.sql, ctx.api, queries.COUNT_IN_RANGE, ctx.params(r))
    return None if df is None or df.empty else int(df.iloc[0]["requests"])


def choose(ctx: ui.Context) -> tuple[TimeRange, TimeRange | None] | None:
    """(window, baseline): the range against the span before it, or (range, None) to let the diagnosis
    split the range at a change point, chosen when the span before holds nothing (stored data older than
    the default window) or when asked. None when the API failed."""
    mode = st.radio("Baseline", [BEFORE, CHANGE_POINT], horizontal=True, key="findings_baseline")
    if mode == BEFORE:
        baseline = ctx.range.before()
        n = _count(ctx, baseline)
        if n is None:
            return None
        if n > 0:
            return ctx.range, baseline
        st.info(
            "No requests in the span before the range: the diagnosis splits the range itself at the "
            "change point it finds, and compares after with before."
        )
    return clip(ctx), None


def clip(ctx: ui.Context) -> TimeRange:
    """The range cut to the stored data in it, so that the diagnosis looks for its change point where
    the requests are, not across empty minutes."""
    span, r = ctx.span, ctx.range
    if span.empty or span.first is None or span.last is None:
        return r
    since, until = max(r.start, float(int(span.first))), min(r.end, float(int(span.last) + 1))
    return TimeRange(since, until, r.label, r.note) if until > since else r


def _span(result: dict[str, Any], key: str) -> tuple[float, float] | None:
    part = result.get(key) or {}
    return (part["from"], part["to"]) if "from" in part and "to" in part else None


def symptom_chart(ctx: ui.Context, window: tuple[float, float], baseline: tuple[float, float] | None) -> None:
    """P99 TTFT and TPOT across baseline and window, the two spans shaded."""
    since = min(window[0], baseline[0]) if baseline else window[0]
    until = max(window[1], baseline[1]) if baseline else window[1]
    whole = TimeRange(since, until, "both").covering(ctx.span)
    df = ui.fetch("latency percentiles", data.sql, ctx.api, queries.LATENCY_SERIES, ctx.params(whole))
    if not ui.has_rows(df, "No requests in the window or its baseline."):
        return
    assert df is not None
    df = ui.ms(df, ["p99_ttft_s", "p99_tpot_s"])
    sides = [("baseline", baseline), ("window", window)] if baseline else [("window", window)]
    spans = pd.DataFrame(
        {
            "start": pd.to_datetime([s[0] for _, s in sides], unit="s", utc=True),
            "end": pd.to_datetime([s[1] for _, s in sides], unit="s", utc=True),
            "span": [name for name, _ in sides],
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
    df = pd.DataFrame(rows)
    st.dataframe(
        df,
        hide_index=True,
        width="stretch",
        column_config={
            "metric": st.column_config.TextColumn("metric"),
            "baseline": st.column_config.NumberColumn("baseline", format="%.4g"),
            "current": st.column_config.NumberColumn("window", format="%.4g"),
            "ratio": st.column_config.NumberColumn("ratio", format="%.2fx"),
            "p_value": st.column_config.NumberColumn("p-value", format="%.2g"),
        },
    )


def finding(i: int, f: dict[str, Any]) -> None:
    """One finding: cause, confidence, symptoms, onset, evidence chart, lever, SQL."""
    with st.container(border=True):
        confidence = f.get("confidence")
        head = f"{i}. {f.get('cause', 'unnamed cause')}"
        if isinstance(confidence, int | float):
            head += f" (confidence {confidence:.0%})"
        st.subheader(head)
        if f.get("summary"):
            st.markdown(f["summary"])
        symptoms = f.get("symptoms") or []
        facts = []
        if symptoms:
            facts.append("**Symptoms:** " + ", ".join(str(s) for s in symptoms))
        if isinstance(f.get("onset"), int | float):
            facts.append(f"**Onset:** {_fmt(f['onset'])} UTC")
        if isinstance(f.get("share_explained"), int | float):
            facts.append(f"**Explains:** {f['share_explained']:.0%} of the change")
        if facts:
            st.markdown(" · ".join(facts))
        rows = [
            {"metric": e.get("metric"), "side": side, "value": e.get(side)}
            for e in f.get("evidence") or []
            for side in ("baseline", "current")
            if isinstance(e.get(side), int | float) and not isinstance(e.get(side), bool)
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
    asked = ((window.start, window.end), (baseline.start, baseline.end) if baseline else None)
    try:
        result = findings.diagnose(ctx.api, *asked, ctx.scope)
    except findings.DiagnosisUnavailable as e:
        st.info(f"Diagnosis unavailable: {e}")
        symptom_chart(ctx, *asked)
        return
    shown_window, shown_baseline = _span(result, "window") or asked[0], _span(result, "baseline")
    if shown_baseline:
        how = (
            "found at a change point"
            if (result.get("baseline") or {}).get("source") == "change_point"
            else ""
        )
        st.caption(
            f"Window {_fmt(shown_window[0])} to {_fmt(shown_window[1])} UTC against baseline "
            f"{_fmt(shown_baseline[0])} to {_fmt(shown_baseline[1])} UTC {how}."
        )
    symptom_chart(ctx, shown_window, shown_baseline)
    for note in result.get("notes") or []:
        st.info(str(note))
    if result.get("baseline") is None:
        return  # nothing compared: the notes say why
    regressions(result)
    found = result.get("findings") or []
    if not found and result.get("regressions"):
        st.info("The diagnosis names no cause for this window.")
    for i, f in enumerate(found, 1):
        finding(i, f)
    missing = result.get("not_enough_data") or []
    if missing:
        with st.expander(f"{len(missing)} rule(s) could not run: not enough data"):
            st.dataframe(pd.DataFrame(missing), hide_index=True, width="stretch")


render(ui.context())
