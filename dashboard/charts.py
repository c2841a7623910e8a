"""Chart builders: DataFrame in, Altair chart out. No data access and no Streamlit calls here.

Axis titles carry units; time axes are UTC.
"""

from __future__ import annotations

from collections.abc import Mapping

import altair as alt
import pandas as pd

TIME_TITLE = "time (UTC)"
_HEIGHT = 360  # Streamlit fits the whole chart (title, axes, legend) into this many pixels
RULE_HEADROOM = 3.0  # a rule further than this above the data would flatten it: named in the title instead
KIND_COLORS = {
    "client": "#9e9e9e",
    "request": "#1f4e79",
    "queue": "#f0a202",
    "prefill": "#d62728",
    "KV transfer": "#9467bd",
    "decode": "#2ca02c",
    "step (prefill)": "#ff9896",
    "step (decode)": "#98df8a",
    "other": "#17becf",
}
_PALETTE = alt.Scale(scheme="tableau10")  # distinct hues: Streamlit's default shades of blue blur together


def _long(df: pd.DataFrame, x: str, ys: Mapping[str, str]) -> pd.DataFrame:
    present = {col: label for col, label in ys.items() if col in df.columns}
    out = df[[x, *present]].rename(columns=present).melt(x, var_name="series", value_name="value")
    return out.dropna(subset=["value"])


def lines(
    df: pd.DataFrame,
    x: str,
    ys: Mapping[str, str],
    y_title: str,
    *,
    title: str = "",
    x_title: str = TIME_TITLE,
    rules: Mapping[str, float] | None = None,
    points: bool = False,
    integer_x: bool = False,
) -> alt.LayerChart:
    """One line per column of `ys` (column -> legend label), optional horizontal rules (label -> y)."""
    data = _long(df, x, ys)
    x_type = "T" if pd.api.types.is_datetime64_any_dtype(df[x]) else "Q"
    base = alt.Chart(data).encode(
        x=alt.X(
            f"{x}:{x_type}",
            title=x_title,
            axis=alt.Axis(format="d", tickMinStep=1) if integer_x else alt.Axis(),
        ),
        y=alt.Y("value:Q", title=y_title),
        color=alt.Color(
            "series:N",
            title=None,
            legend=alt.Legend(orient="bottom") if data["series"].nunique() > 1 else None,
            sort=list(ys.values()),
            scale=_PALETTE,
        ),
        tooltip=[
            alt.Tooltip(f"{x}:{x_type}", title=x_title),
            "series:N",
            alt.Tooltip("value:Q", format=",.3g"),
        ],
    )
    layers: list[alt.Chart] = [base.mark_line(point=points)]
    top = float(data["value"].max()) if not data.empty else 0.0
    off = {k: v for k, v in (rules or {}).items() if top > 0 and v > RULE_HEADROOM * top}
    rules = {k: v for k, v in (rules or {}).items() if k not in off}
    if off:
        title += " (" + ", ".join(f"{k} {v:,.0f}: far above" for k, v in off.items()) + ")"
    if rules:
        rule_df = pd.DataFrame({"rule": list(rules), "value": list(rules.values())})
        layers.append(
            alt.Chart(rule_df)
            .mark_rule(strokeDash=[6, 4], color="#d62728")
            .encode(y="value:Q", tooltip=["rule:N", alt.Tooltip("value:Q", format=",.3g")])
        )
    return alt.layer(*layers).properties(title=title, height=_HEIGHT)


def scatter(
    df: pd.DataFrame,
    x: str,
    y: str,
    x_title: str,
    y_title: str,
    *,
    title: str = "",
    color: str | None = None,
    size: str | None = None,
    line: bool = False,
    log_y: bool = False,
    integer_x: bool = False,
) -> alt.Chart | alt.LayerChart:
    """Points of `y` against `x` (optionally coloured, sized, joined in x order, y on a log scale)."""
    x_axis = alt.Axis(format="d", tickMinStep=1) if integer_x else alt.Axis()
    enc: dict[str, object] = {
        "x": alt.X(f"{x}:Q", title=x_title, axis=x_axis),
        "y": alt.Y(
            f"{y}:Q",
            title=y_title,
            scale=alt.Scale(type="log") if log_y else alt.Scale(zero=True),
            axis=alt.Axis(tickCount=5) if log_y else alt.Axis(),
        ),
        "tooltip": [c for c in (x, y, color, size) if c],
    }
    if color:
        enc["color"] = alt.Color(f"{color}:N", title=None, legend=alt.Legend(orient="bottom"), scale=_PALETTE)
    base = alt.Chart(df).encode(**enc)
    point_enc = {"size": alt.Size(f"{size}:Q", title=size, legend=None, scale=alt.Scale(range=[40, 400]))}
    chart = (
        base.mark_circle(opacity=0.8).encode(**point_enc) if size else base.mark_circle(opacity=0.8, size=60)
    )
    if line:
        chart = alt.layer(base.mark_line(opacity=0.6), chart)
    return chart.properties(title=title, height=_HEIGHT)


def bars_over_time(df: pd.DataFrame, x: str, y: str, y_title: str, *, title: str = "") -> alt.Chart:
    """Counts per time bucket (preemptions, errors)."""
    return (
        alt.Chart(df)
        .mark_bar()
        .encode(
            x=alt.X(f"{x}:T", title=TIME_TITLE),
            y=alt.Y(f"{y}:Q", title=y_title, axis=alt.Axis(format="d", tickMinStep=1)),
            tooltip=[alt.Tooltip(f"{x}:T", title=TIME_TITLE), alt.Tooltip(f"{y}:Q", format=",.3g")],
        )
        .properties(title=title, height=_HEIGHT)
    )


def window_shading(
    df: pd.DataFrame, x: str, ys: Mapping[str, str], y_title: str, spans: pd.DataFrame, *, title: str = ""
) -> alt.LayerChart:
    """Lines over time with shaded spans (`spans`: columns start, end, span)."""
    band = (
        alt.Chart(spans)
        .mark_rect(opacity=0.12)
        .encode(
            x=alt.X("start:T", title=TIME_TITLE),
            x2="end:T",
            color=alt.Color("span:N", title=None, scale=alt.Scale(range=["#7f7f7f", "#ff7f0e"])),
        )
    )
    data = _long(df, x, ys)
    line = (
        alt.Chart(data)
        .mark_line(point=True)
        .encode(
            x=alt.X(f"{x}:T", title=TIME_TITLE),
            y=alt.Y("value:Q", title=y_title),
            color=alt.Color("series:N", title=None, scale=alt.Scale(range=["#1f4e79", "#9467bd"])),
            tooltip=["series:N", alt.Tooltip("value:Q", format=",.3g")],
        )
    )
    return alt.layer(band, line).resolve_scale(color="independent").properties(title=title, height=_HEIGHT)


def waterfall(spans: pd.DataFrame, *, title: str = "") -> alt.Chart:
    """A Gantt of one request: columns lane, start_ms, end_ms, kind, detail (one bar per span or step)."""
    return (
        alt.Chart(spans)
        .mark_bar(cornerRadius=2)
        .encode(
            x=alt.X("start_ms:Q", title="time since the request arrived (ms)"),
            x2="end_ms:Q",
            y=alt.Y("lane:N", title=None, sort=list(dict.fromkeys(spans["lane"]))),
            color=alt.Color(
                "kind:N",
                title=None,
                legend=alt.Legend(orient="bottom", columns=5),
                scale=alt.Scale(domain=list(KIND_COLORS), range=list(KIND_COLORS.values())),
            ),
            tooltip=[
                "lane:N",
                "detail:N",
                alt.Tooltip("start_ms:Q", format=",.2f"),
                alt.Tooltip("end_ms:Q", format=",.2f"),
            ],
        )
        .properties(title=title, height=int(160 + 30 * spans["lane"].nunique()))
    )


def evidence(rows: pd.DataFrame, *, title: str = "") -> alt.FacetChart:
    """Baseline against current, one small panel per evidence metric (columns metric, side, value),
    each with its own y scale: the metrics have different units (named in the metric, `_s`, `_share`)."""
    return (
        alt.Chart(rows)
        .mark_bar()
        .encode(
            x=alt.X("side:N", title=None, sort=["baseline", "current"], axis=alt.Axis(labelAngle=0)),
            y=alt.Y("value:Q", title=None),
            color=alt.Color("side:N", legend=None, scale=alt.Scale(range=["#7f7f7f", "#ff7f0e"])),
            tooltip=["metric:N", "side:N", alt.Tooltip("value:Q", format=",.4g")],
        )
        .properties(width=120, height=150)
        .facet(facet=alt.Facet("metric:N", title=title or None), columns=4)
        .resolve_scale(y="independent")
    )
