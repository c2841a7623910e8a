"""GPU: NVML counters (SM and memory-bandwidth utilization, memory, power, clock, temperature) next to
step time; on an engine without a GPU, host CPU utilization, labelled as such."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import charts, data, queries, ui
from instrumentation import attributes as A

# counter name -> (chart title, y title, scale from the stored unit)
GPU_COUNTERS = {
    A.GPU_SM_UTILIZATION: ("SM utilization", "SM busy (%)", 100.0),
    A.GPU_MEM_BW_UTILIZATION: ("Memory-bandwidth utilization", "memory busy (%)", 100.0),
    A.GPU_MEMORY_USED_BYTES: ("GPU memory used", "memory (GiB)", 1 / 2**30),
    A.GPU_POWER_W: ("Power", "power (W)", 1.0),
    A.GPU_SM_CLOCK_MHZ: ("SM clock", "clock (MHz)", 1.0),
    A.GPU_TEMPERATURE_C: ("Temperature", "temperature (°C)", 1.0),
}


def split(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(gpu rows with `gpu` and `name` columns, host CPU rows) from the counter series."""
    is_gpu = df["counter"].str.startswith(A.GPU_PREFIX)
    gpu = df[is_gpu].copy()
    parts = gpu["counter"].str.removeprefix(A.GPU_PREFIX).str.split(".", n=1)
    gpu["gpu"] = "GPU " + parts.str[0]
    gpu["name"] = parts.str[1]
    host = df[df["counter"] == A.HOST_CPU_UTILIZATION].copy()
    return gpu, host


def step_time(ctx: ui.Context, col: st.delta_generator.DeltaGenerator) -> None:
    """P50/P99 step time over the same buckets."""
    df = ui.fetch("step time", data.sql, ctx.api, queries.ENGINE_SERIES, ctx.params())
    if df is None or df.empty:
        col.info("No engine steps in this range.")
        return
    col.altair_chart(
        charts.lines(
            df,
            "bucket",
            {"p50_step_ms": "P50 step", "p99_step_ms": "P99 step"},
            "step time (ms)",
            title="Step time",
        ),
        width="stretch",
    )


def gpu_charts(ctx: ui.Context, gpu: pd.DataFrame) -> None:
    """One chart per NVML counter, a line per GPU, each beside step time."""
    st.caption(
        f"NVML counters of {gpu['gpu'].nunique()} GPU(s), sampled by the engine and attached to its "
        "steps; mean per bucket."
    )
    for name, (title, y_title, scale) in GPU_COUNTERS.items():
        rows = gpu[gpu["name"] == name]
        if rows.empty:
            continue
        wide = rows.assign(value=rows["value"] * scale).pivot_table("value", "bucket", "gpu").reset_index()
        left, right = st.columns(2)
        left.altair_chart(
            charts.lines(wide, "bucket", {g: g for g in wide.columns if g != "bucket"}, y_title, title=title),
            width="stretch",
        )
        step_time(ctx, right)


def host_chart(ctx: ui.Context, host: pd.DataFrame) -> None:
    """Host CPU utilization (no GPU), beside step time."""
    st.info("No GPU on this engine (NVML absent): showing host CPU utilization instead.")
    left, right = st.columns(2)
    host = host.assign(cpu_pct=host["value"] * 100)
    left.altair_chart(
        charts.lines(
            host,
            "bucket",
            {"cpu_pct": "host CPU (all cores)"},
            "host CPU busy (%)",
            title="Host CPU utilization (no GPU)",
        ),
        width="stretch",
    )
    step_time(ctx, right)


def render(ctx: ui.Context) -> None:
    """The page."""
    st.title("GPU")
    ui.range_note(ctx)
    df = ui.fetch("GPU and host counters", data.sql, ctx.api, queries.COUNTER_SERIES, ctx.params())
    if df is None:
        return
    gpu, host = (df, df) if df.empty else split(df)
    if not gpu.empty:
        gpu_charts(ctx, gpu)
    elif not host.empty:
        host_chart(ctx, host)
    else:
        st.info("The engine reported no GPU or host counters in this range: showing step time alone.")
        left, _ = st.columns(2)
        step_time(ctx, left)


render(ui.context())
