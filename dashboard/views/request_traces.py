"""Requests: a searchable table, slowest first, and one request's waterfall: queue, prefill chunks, KV
transfer, decode, and the engine steps it shared (through the step -> request links)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import charts, data, queries, ui, waterfall

_LATENCIES = ["e2e_s", "ttft_s", "tpot_s", "queue_s", "prefill_s", "kv_transfer_s", "decode_s"]


def table(ctx: ui.Context) -> pd.DataFrame | None:
    """The search controls and the slowest requests matching them."""
    c1, c2, c3 = st.columns([3, 1, 1])
    search = c1.text_input("Search", key="req_search", placeholder="trace id, request id or finish reason")
    min_e2e_ms = c2.number_input("Min E2E (ms)", min_value=0.0, value=0.0, step=100.0, key="req_min_e2e")
    limit = c3.selectbox("Rows", [50, 200, 1000], key="req_limit")
    params = ctx.params(search=search.strip(), min_e2e_s=min_e2e_ms / 1000, limit=limit)
    df = ui.fetch("requests", data.sql, ctx.api, queries.SLOWEST_REQUESTS, params)
    if not ui.has_rows(df, "No request in this range matches: widen the range or clear the search."):
        return None
    assert df is not None
    shown = ui.ms(df, _LATENCIES).drop(columns=_LATENCIES)
    first = [
        "time",
        "trace_id",
        "e2e_ms",
        "ttft_ms",
        "tpot_ms",
        "queue_ms",
        "prefill_ms",
        "kv_transfer_ms",
        "decode_ms",
        "input_tokens",
        "output_tokens",
        "cached_tokens",
    ]
    shown = shown[[c for c in first if c in shown] + [c for c in shown if c not in first]]
    st.caption(f"{len(df)} slowest requests of the range (latencies in ms), slowest first.")
    st.dataframe(
        shown,
        hide_index=True,
        width="stretch",
        height=280,
        column_config={
            "time": st.column_config.DatetimeColumn("start (UTC)", format="YYYY-MM-DD HH:mm:ss.SSS"),
            **{c: st.column_config.NumberColumn(format="%.1f") for c in shown if c.endswith("_ms")},
        },
    )
    return df


def request_tiles(row: pd.Series) -> None:
    """The chosen request's latencies."""
    cols = st.columns(6)
    for col, (name, label) in zip(
        cols,
        [
            ("e2e_s", "E2E"),
            ("ttft_s", "TTFT"),
            ("tpot_s", "TPOT"),
            ("queue_s", "Queue"),
            ("prefill_s", "Prefill"),
            ("decode_s", "Decode"),
        ],
        strict=True,
    ):
        col.metric(label, ui.fmt_s(row.get(name)))


def show_waterfall(ctx: ui.Context, trace_id: str) -> None:
    """The waterfall of one trace, with the engine steps it shared."""
    spans = ui.fetch(f"trace {trace_id}", data.trace, ctx.api, trace_id)
    if not ui.has_rows(spans, f"Trace {trace_id} has no spans."):
        return
    assert spans is not None
    start = spans["Timestamp"].min().timestamp()
    end = max((ts.timestamp() + d / 1e9) for ts, d in zip(spans["Timestamp"], spans["Duration"], strict=True))
    steps = ui.fetch(
        "the engine steps of this request",
        data.sql,
        ctx.api,
        queries.LINKED_STEPS,
        {"trace_id": trace_id, "since": start - 1.0, "until": end + 1.0},
    )
    rows = waterfall.build(spans, steps)
    if rows.empty:
        st.info("This trace has no request spans to draw.")
        return
    n_steps = 0 if steps is None else len(steps)
    st.altair_chart(
        charts.waterfall(rows, title=f"Trace {trace_id}: spans and the {n_steps} engine steps it shared"),
        width="stretch",
    )
    if steps is not None and not steps.empty:
        st.caption(
            f"Shared {n_steps} engine steps: mean batch size {steps['batch_size'].mean():.1f}, "
            f"step time P50 {steps['duration_s'].median() * 1000:.2f} ms, "
            f"{int(steps['is_prefill'].sum())} of them prefill for this request."
        )
    elif steps is not None:
        st.caption("No engine step links to this request (step tracing off or sampled out).")


def render(ctx: ui.Context) -> None:
    """The page."""
    st.title("Requests")
    ui.range_note(ctx)
    df = table(ctx)
    if df is None:
        return
    st.subheader("Waterfall")
    labels = {
        tid: f"{tid} ({e2e * 1000:,.1f} ms)" for tid, e2e in zip(df["trace_id"], df["e2e_s"], strict=True)
    }
    trace_id = st.selectbox("Trace (slowest first)", list(labels), format_func=labels.get, key="req_trace")
    if not trace_id:
        return
    request_tiles(df.loc[df["trace_id"] == trace_id].iloc[0])
    show_waterfall(ctx, trace_id)


render(ui.context())
