"""What every page shares: the sidebar (time range, services and instances, auto-refresh), the page
context, and the helpers that turn a missing answer into a message instead of an exception."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pandas as pd
import streamlit as st

from collector.timerange import DataSpan, TimeRange
from dashboard import data, queries, timerange
from dashboard.config import DashboardConfig
from dashboard.scope import Scope, instances_of, label

T = TypeVar("T")
_CTX_KEY = "stepscope_ctx"


@dataclass(frozen=True, slots=True)
class Context:
    """Everything a page needs: the config, the API, the store's data span, the chosen range and the
    chosen services and instances."""

    cfg: DashboardConfig
    api: data.Api
    span: DataSpan
    range: TimeRange
    scope: Scope

    def params(self, r: TimeRange | None = None, **extra: Any) -> dict[str, Any]:
        """The parameters of a query of `requests` or `steps`: the range (or `r`), the scope, `extra`."""
        return (r or self.range).params(**self.scope.params(), **extra)

    def slo_params(self) -> dict[str, Any]:
        """`params()` and the SLO targets: what the queries that judge requests take."""
        return self.params(slo_ttft_s=self.cfg.slo_ttft_s, slo_tpot_s=self.cfg.slo_tpot_s)


def fetch(what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
    """Call a `dashboard.data` function; on failure show why (naming `what`) and return None."""
    try:
        return fn(*args, **kwargs)
    except data.Unreachable as e:
        st.warning(str(e))
    except data.DataError as e:
        st.warning(f"Could not load {what}: {e}")
    return None


def has_rows(df: pd.DataFrame | None, message: str) -> bool:
    """True when `df` has rows; otherwise show `message` (None: the failure was shown already)."""
    if df is None:
        return False
    if df.empty:
        st.info(message)
        return False
    return True


def epoch(ts: Any) -> float | None:
    """A timestamp (pandas, datetime or ISO string) as epoch seconds; None for null or the 1970 zero
    that ClickHouse returns for min()/max() over no rows."""
    if ts is None or (not isinstance(ts, str) and pd.isna(ts)):
        return None
    value = pd.Timestamp(ts)
    value = value.tz_localize("UTC") if value.tzinfo is None else value
    seconds = value.timestamp()
    return seconds if seconds > 0 else None


def data_span(api: data.Api) -> DataSpan | None:
    """How many requests the store holds, and from when to when (None when the API failed)."""
    df = fetch("the stored data span", data.sql, api, queries.DATA_SPAN)
    if df is None:
        return None
    row = df.iloc[0]
    return DataSpan(int(row["requests"]), epoch(row["first"]), epoch(row["last"]))


def _fmt(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def sidebar(cfg: DashboardConfig, api: data.Api, span: DataSpan) -> Context:
    """The time-range picker, the fleet filter and the refresh controls; the context they choose."""
    chosen = _time_range(span)
    fleet = _fleet_filter(api)
    sb = st.sidebar
    if sb.toggle(f"Auto-refresh every {cfg.refresh_s} s", key="auto_refresh"):
        _refresher(cfg.refresh_s)
    if sb.button("Refresh now"):
        st.cache_data.clear()
    sb.caption(f"Collector API: {cfg.api}")
    return Context(cfg, api, span, chosen, fleet)


def _time_range(span: DataSpan) -> TimeRange:
    sb = st.sidebar
    choice = sb.selectbox("Time range", list(timerange.PRESETS), key="range_choice")
    custom = None
    if choice == timerange.CUSTOM:
        end = dt.datetime.fromtimestamp(span.last or time.time(), dt.UTC)
        start = end - dt.timedelta(minutes=15)
        since = sb.datetime_input("From (UTC)", value=start.replace(tzinfo=None), key="range_from")
        until = sb.datetime_input("To (UTC)", value=end.replace(tzinfo=None), key="range_to")
        if since and until:
            custom = (since.replace(tzinfo=dt.UTC).timestamp(), until.replace(tzinfo=dt.UTC).timestamp())
            if custom[1] <= custom[0]:
                sb.warning("'To' must be after 'From'.")
    chosen = timerange.resolve(choice, time.time(), span, custom)
    sb.caption(f"{_fmt(chosen.start)} to {_fmt(chosen.end)} UTC, {chosen.interval_s} s buckets")
    return chosen


def _fleet_filter(api: data.Api) -> Scope:
    # Keyed widgets drawn on every run keep their choice across pages; a choice the options no longer
    # hold (the instances of a service no longer chosen) is dropped by Streamlit itself.
    df = fetch("the services and instances", data.sql, api, queries.SCOPE_OPTIONS)
    empty = df is None or df.empty  # an empty store answers no rows, and no columns either
    pairs = [] if empty else list(zip(df["service"], df["instance"], strict=True))
    sb = st.sidebar
    services = sb.multiselect(
        "Services",
        sorted({service for service, _ in pairs}),
        key="scope_services",
        format_func=label,
        placeholder="all",
    )
    instances = sb.multiselect(
        "Instances",
        instances_of(pairs, services),
        key="scope_instances",
        format_func=label,
        placeholder="all",
    )
    return Scope(tuple(services), tuple(instances))


def _refresher(every_s: int) -> None:
    # The fragment's first run comes with the full run and only arms it; each timed run after that
    # reruns the whole app, so relative ranges slide forward and every page re-queries.
    st.session_state["_refresh_armed"] = False

    @st.fragment(run_every=every_s)
    def tick() -> None:
        if st.session_state.get("_refresh_armed"):
            st.rerun(scope="app")
        st.session_state["_refresh_armed"] = True

    tick()


def set_context(ctx: Context) -> None:
    """Made by the app before the page runs."""
    st.session_state[_CTX_KEY] = ctx


def context() -> Context:
    """The context the app made for this run (pages run only after it)."""
    return st.session_state[_CTX_KEY]


def range_note(ctx: Context) -> None:
    """Say when the range is not what was asked for (the automatic fallback to stored data), and which
    services and instances the page is filtered to."""
    if ctx.range.note:
        st.info(ctx.range.note)
    note = ctx.scope.note()
    if note:
        st.info(note, icon=":material/filter_alt:")


def fmt_s(seconds: float | None) -> str:
    """A latency for a tile: `12.5 ms`, `1.41 s`, or `n/a`."""
    if seconds is None or pd.isna(seconds):
        return "n/a"
    return f"{seconds * 1000:,.1f} ms" if seconds < 1 else f"{seconds:,.2f} s"


def ms(df: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """Seconds columns -> milliseconds, renamed `_s` -> `_ms`."""
    out = df.copy()
    for col in columns:
        if col in out.columns:
            out[col.removesuffix("_s") + "_ms"] = pd.to_numeric(out[col], errors="coerce") * 1000
    return out
