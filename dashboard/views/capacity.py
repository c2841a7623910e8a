"""Capacity: load-test results from `stepscope bench` (the step-load curve, knee, recommended load, cost
per 1k requests), and the capacity curve the stored traffic itself shows."""

from __future__ import annotations

import streamlit as st

from dashboard import bench, charts, data, queries, ui


def from_traffic(ctx: ui.Context) -> None:
    """Throughput against the number in flight, per bucket of the stored traffic (Little's law)."""
    st.subheader("From the stored traffic")
    if ctx.span.empty:
        st.info("The store holds no requests yet: nothing to derive a capacity curve from.")
        return
    df = ui.fetch("the traffic capacity curve", data.sql, ctx.api, queries.TRAFFIC_CAPACITY, ctx.slo_params())
    if not ui.has_rows(df, "No request completed in this range."):
        return
    assert df is not None
    st.caption(
        f"Each point is one {ctx.range.interval_s} s bucket: completions per second against the mean number "
        "of requests in flight (completions/s x mean E2E, Little's law). Where throughput stops rising "
        "with more in flight, the server is saturated: that is the knee this traffic has reached."
    )
    left, right = st.columns(2)
    long = df.melt(["in_flight"], ["requests_per_s", "goodput_per_s"], var_name="series", value_name="rate")
    long["series"] = long["series"].map({"requests_per_s": "completed", "goodput_per_s": "meeting the SLO"})
    left.altair_chart(
        charts.scatter(
            long,
            "in_flight",
            "rate",
            "requests in flight (mean)",
            "requests/s",
            color="series",
            title="Throughput vs load (from traffic)",
        ),
        width="stretch",
    )
    right.altair_chart(
        charts.scatter(
            df,
            "in_flight",
            "p99_ttft_ms",
            "requests in flight (mean)",
            "P99 TTFT (ms)",
            title="Tail latency vs load (from traffic)",
        ),
        width="stretch",
    )


def pick(ctx: ui.Context) -> bench.BenchResults | None:
    """A results.json: uploaded, typed as a path, or one found under --bench-dir."""
    found = bench.find(ctx.cfg.bench_dir) if ctx.cfg.bench_dir else []
    c1, c2 = st.columns(2)
    uploaded = c1.file_uploader("Upload a results.json", type=["json"], key="cap_upload")
    typed = c2.text_input("...or its path on the dashboard's machine", key="cap_path")
    chosen = None
    if found:
        chosen = st.selectbox(
            f"...or one found in {ctx.cfg.bench_dir}", found, format_func=str, key="cap_found"
        )
    try:
        if uploaded is not None:
            return bench.parse(uploaded.getvalue(), uploaded.name)
        if typed.strip():
            return bench.load(typed.strip())
        if chosen is not None:
            return bench.load(chosen)
    except bench.BenchFileError as e:
        st.warning(str(e))
        return None
    where = f" and none was found in {ctx.cfg.bench_dir}" if ctx.cfg.bench_dir else ""
    st.info(
        f"No load-test results chosen{where}. Run `stepscope bench --url ... --step-load 1,2,4,8 "
        "--out results.json` and open its results.json here (or start the dashboard with --bench-dir)."
    )
    return None


def results(res: bench.BenchResults) -> None:
    """Knee, recommended load, cost, and the step-load curves."""
    df = bench.steps_frame(res)
    knee, body = res.knee, res.body
    c1, c2, c3, c4 = st.columns(4)
    c1.metric("Knee", f"{knee['load']:g}" if knee.get("found") else "none", help=knee.get("reason"))
    rec = body.get("recommended_load")
    c2.metric("Recommended load", "none" if rec is None else f"{rec:g}", help=res.load_unit)
    cost = body.get("cost_per_1k_requests")
    c3.metric(
        "Cost per 1k requests",
        "n/a" if cost is None else f"{cost:.4f}",
        help=f"at {body.get('cost_per_hour')} per hour",
    )
    c4.metric("Model / workload", f"{body.get('model', '?')} / {body.get('workload', '?')}")
    st.caption(f"{res.source}: knee {knee.get('reason', '')}")
    rules = {"knee": knee["load"]} if knee.get("found") else {}
    if rec is not None:
        rules["recommended"] = rec
    left, right = st.columns(2)
    left.altair_chart(
        charts.lines(
            df,
            "load",
            {"requests_per_s": "throughput", "goodput_per_s": "goodput"},
            "requests/s",
            x_title=res.load_unit,
            title="Step load: throughput and goodput",
            points=True,
            integer_x=res.load_kind == "concurrency",
        ),
        width="stretch",
    )
    slo = res.slo
    lat_rules = {
        f"{k.split('_')[0].upper()} SLO": v * 1000 for k, v in slo.items() if k in ("ttft_s", "tpot_s") and v
    }
    right.altair_chart(
        charts.lines(
            df,
            "load",
            {"p99_ttft_ms": "P99 TTFT", "p99_tpot_ms": "P99 TPOT", "p50_ttft_ms": "P50 TTFT"},
            "latency (ms)",
            x_title=res.load_unit,
            title="Step load: latency",
            points=True,
            integer_x=res.load_kind == "concurrency",
            rules=lat_rules,
        ),
        width="stretch",
    )
    st.dataframe(df, hide_index=True, width="stretch")


def render(ctx: ui.Context) -> None:
    """The page."""
    st.title("Capacity")
    ui.range_note(ctx)
    st.subheader("Load test (stepscope bench)")
    res = pick(ctx)
    if res is not None:
        results(res)
    from_traffic(ctx)


render(ui.context())
