"""Instances: a fleet side by side. TTFT/TPOT P99, load, cached share and step time per instance over
time; the outlier (the instance furthest above its peers' median P99 TTFT) is marked."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import charts, data, queries, ui

OUTLIER_RATIO = 1.5  # P99 TTFT this many times the peers' median: marked


def outlier(summary: pd.DataFrame) -> str | None:
    """The instance whose P99 TTFT is furthest above the others' median (None under OUTLIER_RATIO)."""
    if len(summary) < 2:
        return None
    best, ratio = None, OUTLIER_RATIO
    for row in summary.itertuples():
        peers = summary.loc[summary["instance"] != row.instance, "p99_ttft_ms"].median()
        if peers and peers > 0 and row.p99_ttft_ms / peers >= ratio:
            best, ratio = row.instance, row.p99_ttft_ms / peers
    return best


def _by_instance(df: pd.DataFrame, column: str) -> tuple[pd.DataFrame, dict[str, str]]:
    wide = df.pivot_table(index="bucket", columns="instance", values=column).reset_index()
    return wide, {c: str(c) for c in wide.columns if c != "bucket"}


def render(ctx: ui.Context) -> None:
    """The page."""
    st.title("Instances")
    ui.range_note(ctx)
    summary = ui.fetch("instances", data.sql, ctx.api, queries.INSTANCE_SUMMARY, ctx.params())
    if not ui.has_rows(summary, "No requests in this time range: choose a wider range in the sidebar."):
        return
    assert summary is not None
    odd = outlier(summary)
    if odd:
        st.warning(f"{odd}: P99 TTFT well above its peers' (marked below)")
    summary.insert(0, "outlier", summary["instance"].map(lambda n: "⚠" if n == odd else ""))
    st.dataframe(summary, hide_index=True, width="stretch")
    params = ctx.params()
    series = ui.fetch("per-instance series", data.sql, ctx.api, queries.INSTANCE_SERIES, params)
    steps = ui.fetch("per-instance steps", data.sql, ctx.api, queries.INSTANCE_STEP_SERIES, params)
    panels = [
        (series, "p99_ttft_ms", "TTFT P99 (ms)"),
        (series, "p99_tpot_ms", "TPOT P99 (ms)"),
        (series, "requests_per_s", "requests/s"),
        (series, "cached_share", "cached share of prompt tokens"),
        (steps, "step_ms", "mean step time (ms)"),
        (steps, "load", "running + waiting"),
    ]
    cols = st.columns(2)
    for i, (df, column, title) in enumerate(panels):
        if df is None or df.empty:
            continue
        wide, ys = _by_instance(df, column)
        cols[i % 2].altair_chart(charts.lines(wide, "bucket", ys, title, title=title), width="stretch")


render(ui.context())
