"""Engine: batch size, tokens per step, step time, KV usage and preemptions over time; step time against
batch size, where the memory-bound to compute-bound bend shows."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, data, queries, ui


def series(ctx: ui.Context) -> None:
    """The step loop per bucket."""
    df = ui.fetch("engine steps", data.sql, ctx.api, queries.ENGINE_SERIES, ctx.params())
    if not ui.has_rows(df, "No engine steps in this range (is the engine's step tracing on?)."):
        return
    assert df is not None
    df["kv_usage_pct"] = df["kv_usage"] * 100
    st.caption(f"{int(df['steps'].sum()):,} steps in the range, {ctx.range.interval_s} s buckets.")
    left, right = st.columns(2)
    left.altair_chart(
        charts.lines(
            df,
            "bucket",
            {"batch_size": "batch size (running)", "waiting": "waiting"},
            "sequences (mean per step)",
            title="Batch size and queue",
        ),
        width="stretch",
    )
    right.altair_chart(
        charts.lines(
            df,
            "bucket",
            {"tokens_per_step": "tokens per step"},
            "tokens (mean per step)",
            title="Tokens per step (prefill + decode)",
        ),
        width="stretch",
    )
    left.altair_chart(
        charts.lines(
            df,
            "bucket",
            {"p50_step_ms": "P50 step", "p99_step_ms": "P99 step", "gap_ms": "gap"},
            "step time (ms)",
            title="Step time and the idle gap before each step",
        ),
        width="stretch",
    )
    right.altair_chart(
        charts.lines(
            df, "bucket", {"kv_usage_pct": "KV blocks used"}, "KV cache used (%)", title="KV-cache usage"
        ),
        width="stretch",
    )
    left.altair_chart(
        charts.lines(
            df,
            "bucket",
            {"prefill_tokens_per_s": "prefill", "decode_tokens_per_s": "decode"},
            "tokens/s",
            title="Engine token throughput",
        ),
        width="stretch",
    )
    right.altair_chart(
        charts.bars_over_time(df, "bucket", "preemptions", "preemptions (count)", title="Preemptions"),
        width="stretch",
    )


def bend(ctx: ui.Context) -> None:
    """Median step time per batch size, decode-only steps apart from steps carrying prefill."""
    df = ui.fetch("step time by batch size", data.sql, ctx.api, queries.STEP_TIME_BY_BATCH, ctx.params())
    if not ui.has_rows(df, "No steps with a batch in this range."):
        return
    assert df is not None
    st.subheader("Step time against batch size")
    st.caption(
        "While decode is memory-bound, a bigger batch costs little extra step time (the weights are read "
        "once per step either way); where the line turns upward the step has become compute-bound, and "
        "batching more buys throughput at the cost of TPOT. Point size: number of steps."
    )
    st.altair_chart(
        charts.scatter(
            df,
            "batch_size",
            "p50_step_ms",
            "batch size (sequences)",
            "P50 step time (ms, log scale)",
            color="kind",
            size="steps",
            line=True,
            log_y=True,
            integer_x=True,
            title="Step time vs batch size",
        ),
        width="stretch",
    )


def render(ctx: ui.Context) -> None:
    """The page."""
    st.title("Engine steps")
    ui.range_note(ctx)
    series(ctx)
    bend(ctx)


render(ui.context())
