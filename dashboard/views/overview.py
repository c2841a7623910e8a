"""Overview: TTFT and TPOT P99 against their SLOs, goodput, throughput, firing alerts; P50/P99 over time."""

from __future__ import annotations

import math

import streamlit as st

from dashboard import charts, data, queries, ui


def _num(value: object) -> float | None:
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) else x


def _latency_tile(
    col: st.delta_generator.DeltaGenerator, label: str, p99_s: float | None, slo_s: float
) -> None:
    if p99_s is None:
        col.metric(label, "no data", help=f"SLO {slo_s * 1000:.0f} ms")
        return
    over = p99_s - slo_s
    col.metric(
        label,
        ui.fmt_s(p99_s),
        delta=f"{'+' if over >= 0 else '-'}{ui.fmt_s(abs(over))} vs SLO {ui.fmt_s(slo_s)}",
        delta_color="inverse",
        help="P99 over the range; red when above the SLO",
    )


def alerts_tile(ctx: ui.Context, col: st.delta_generator.DeltaGenerator) -> None:
    """Firing alerts from the alerting issue's `alerts` table; absent table: no rules configured."""
    try:
        df = data.sql(ctx.api, queries.ALERTS)
    except data.QueryFailed:
        col.metric("Firing alerts", "none", help="no alert rules configured (no `alerts` table)")
        col.caption("no alert rules configured")
        return
    except data.DataError as e:
        col.metric("Firing alerts", "?", help=str(e))
        return
    firing = df[df["state"] == "firing"] if not df.empty else df
    if df.empty:
        col.metric("Firing alerts", "none", help="alert rules configured, none has fired yet")
        return
    names = ", ".join(f"{r.rule} ({r.severity})" for r in firing.itertuples())
    col.metric("Firing alerts", str(len(firing)), help=names or f"{len(df)} rule(s), none firing")
    if names:
        col.caption(names)


def tiles(ctx: ui.Context) -> None:
    """The headline numbers over the range."""
    df = ui.fetch("the summary", data.sql, ctx.api, queries.SUMMARY, ctx.slo_params())
    if df is None or df.empty:
        return
    row = df.iloc[0]
    n = int(row["requests"])
    c1, c2, c3, c4, c5 = st.columns(5)
    _latency_tile(c1, "P99 TTFT", _num(row["p99_ttft_s"]), ctx.cfg.slo_ttft_s)
    _latency_tile(c2, "P99 TPOT", _num(row["p99_tpot_s"]), ctx.cfg.slo_tpot_s)
    first, last = ui.epoch(row["first"]), ui.epoch(row["last"])
    # rates per second of traffic: from the first start to the last completion inside the range
    seconds = max(1.0, min(last, ctx.range.end) - first) if first and last else ctx.range.seconds
    meeting = int(row["meeting_slo"])
    c3.metric(
        "Goodput",
        f"{meeting / seconds:,.2f} req/s",
        delta=f"{meeting / n:.0%} meet the SLO" if n else None,
        delta_color="off",
        help="requests meeting both SLOs (TTFT and TPOT, no error) per second of traffic in the range",
    )
    c4.metric(
        "Throughput",
        f"{n / seconds:,.2f} req/s",
        delta=f"{float(row['output_tokens']) / seconds:,.0f} output tok/s",
        delta_color="off",
        help=f"{n:,} requests started in the range, {int(row['errors']):,} errors",
    )
    alerts_tile(ctx, c5)


def latency_charts(ctx: ui.Context) -> None:
    """P50/P99 TTFT and TPOT per bucket, with the SLOs as dashed lines."""
    df = ui.fetch("latency percentiles", data.sql, ctx.api, queries.LATENCY_SERIES, ctx.params())
    if not ui.has_rows(df, "No requests in this time range: choose a wider range in the sidebar."):
        return
    assert df is not None
    df = ui.ms(df, ["p50_ttft_s", "p99_ttft_s", "p50_tpot_s", "p99_tpot_s"])
    left, right = st.columns(2)
    left.altair_chart(
        charts.lines(
            df,
            "bucket",
            {"p50_ttft_ms": "P50 TTFT", "p99_ttft_ms": "P99 TTFT"},
            "TTFT (ms)",
            title="Time to first token",
            rules={"TTFT SLO": ctx.cfg.slo_ttft_s * 1000},
            points=True,
        ),
        width="stretch",
    )
    right.altair_chart(
        charts.lines(
            df,
            "bucket",
            {"p50_tpot_ms": "P50 TPOT", "p99_tpot_ms": "P99 TPOT"},
            "TPOT (ms)",
            title="Time per output token",
            rules={"TPOT SLO": ctx.cfg.slo_tpot_s * 1000},
            points=True,
        ),
        width="stretch",
    )


def throughput_charts(ctx: ui.Context) -> None:
    """Requests, goodput and errors per second; output tokens per second."""
    df = ui.fetch("throughput", data.sql, ctx.api, queries.THROUGHPUT_SERIES, ctx.slo_params())
    if df is None or df.empty:
        return
    left, right = st.columns(2)
    series = {"requests_per_s": "started", "goodput_per_s": "meeting the SLO"}
    if df["errors_per_s"].fillna(0).sum() > 0:
        series["errors_per_s"] = "errors"
    left.altair_chart(
        charts.lines(df, "bucket", series, "requests/s", title="Throughput and goodput"),
        width="stretch",
    )
    right.altair_chart(
        charts.lines(
            df,
            "bucket",
            {"output_tokens_per_s": "output tokens"},
            "tokens/s",
            title="Output tokens per second",
        ),
        width="stretch",
    )


def render(ctx: ui.Context) -> None:
    """The page."""
    st.title("Overview")
    st.caption(
        f"SLOs: TTFT {ctx.cfg.slo_ttft_s * 1000:,.0f} ms, TPOT {ctx.cfg.slo_tpot_s * 1000:,.0f} ms "
        f"(set with --slo-ttft/--slo-tpot). Range: {ctx.range.label}."
    )
    ui.range_note(ctx)
    tiles(ctx)
    latency_charts(ctx)
    throughput_charts(ctx)


render(ui.context())
