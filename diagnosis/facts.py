"""Query results as small frames: what rules read. All SQL is in `diagnosis.queries`; this module runs it
through a Reader and shapes the answers (per-side aggregates, per-interval series, step shapes, samples)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from collector.client import Reader
from collector.timerange import TimeRange
from diagnosis import queries, stats
from diagnosis.config import DiagnosisConfig
from diagnosis.frame import StepFrame
from diagnosis.records import Regression

_FAR_FUTURE_NS = 9_000_000_000_000_000_000  # 2255: "no upper bound" for DateTime64(9)
SAMPLE_COLUMNS = ("ttft_s", "tpot_s", "e2e_s", "tpot_max_s", "queue_s", "prefill_s", "kv_transfer_s")


@dataclass(frozen=True, slots=True)
class Series:
    """Per-interval series over [start, start + len * interval_s); NaN where an interval had no data."""

    start: float
    interval_s: float
    columns: dict[str, np.ndarray]
    steps: StepFrame | None = None  # the step frame the step columns were summed from, by interval

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def time_of(self, index: int) -> float:
        """Unix seconds at the start of interval `index`."""
        return self.start + index * self.interval_s

    def index_of(self, t: float) -> int:
        """The interval holding `t`, clipped to the series."""
        return int(min(max(0, math.floor((t - self.start) / self.interval_s)), max(0, len(self) - 1)))

    def get(self, name: str) -> np.ndarray:
        """A numeric series (all NaN when absent)."""
        return self.columns.get(name, np.full(len(self), np.nan))


@dataclass(frozen=True, slots=True)
class Facts:
    """Everything the rules may read. `req`/`steps` are (baseline, current) aggregates by column name;
    `steps` is None when neither side has step rows (vLLM-shaped traces). `engine` holds the same per-side
    evidence from scraped /metrics samples (None when there are none): `engine_pair` reads the running
    batch, waiting queue, KV usage, pool size, preemptions and batch limit from whichever is there."""

    window: TimeRange  # the current side
    baseline: TimeRange
    req: tuple[dict[str, float], dict[str, float]]
    sample: tuple[dict[str, np.ndarray], dict[str, np.ndarray]]
    steps: tuple[dict[str, Any], dict[str, Any]] | None
    shape: list[dict[str, float]]
    series: Series
    config: DiagnosisConfig
    regressions: tuple[Regression, ...] = ()
    fleet: Any = None  # diagnosis.fleet.Localization: the instances compared over the same windows
    decomposition: dict[str, Any] = field(default_factory=dict)
    engine: tuple[dict[str, float], dict[str, float]] | None = None

    def evidence_source(self) -> str | None:
        """Where batch, KV and preemption evidence comes from: "steps" (engine.step spans on both sides),
        "metrics" (scraped engine samples on both sides), or None."""
        if self.steps is not None and self.step_baseline("steps") > 0 and self.step_current("steps") > 0:
            return "steps"
        if self.engine is not None and self.engine[0].get("samples", 0) > 0 < self.engine[1].get(
            "samples", 0
        ):
            return "metrics"
        return None

    def engine_pair(self, key: str) -> tuple[float, float]:
        """(baseline, current) of an engine quantity (batch_mean, waiting_mean, kv_usage_p50/p90,
        kv_blocks_total_mean, max_num_seqs_mean, preemptions), from steps or else from scraped samples."""
        source = self.evidence_source()
        if source == "steps":
            return self.step_pair(key)
        if source == "metrics" and self.engine is not None:
            return num(self.engine[0].get(key)), num(self.engine[1].get(key))
        return math.nan, math.nan

    def metric_pair(self, key: str) -> tuple[float, float]:
        """(baseline, current) of a scraped-sample aggregate only (NaN without samples)."""
        if self.engine is None:
            return math.nan, math.nan
        return num(self.engine[0].get(key)), num(self.engine[1].get(key))

    def regressed(self, *families: str) -> tuple[str, ...]:
        """Metric names of the regressions in these families (`ttft`, `tpot`, `e2e`, `itl_max`, ...)."""
        return tuple(r.metric for r in self.regressions if r.family in families)

    def req_baseline(self, key: str) -> float:
        """Baseline request aggregate."""
        return num(self.req[0].get(key))

    def req_current(self, key: str) -> float:
        """Current request aggregate."""
        return num(self.req[1].get(key))

    def step_baseline(self, key: str) -> float:
        """Baseline step aggregate (NaN without steps)."""
        return num(self.steps[0].get(key)) if self.steps else math.nan

    def step_current(self, key: str) -> float:
        """Current step aggregate (NaN without steps)."""
        return num(self.steps[1].get(key)) if self.steps else math.nan

    def req_pair(self, key: str) -> tuple[float, float]:
        """(baseline, current) request aggregate."""
        return self.req_baseline(key), self.req_current(key)

    def step_pair(self, key: str) -> tuple[float, float]:
        """(baseline, current) step aggregate (NaN without steps)."""
        return self.step_baseline(key), self.step_current(key)

    def req_ratio(self, key: str, default: float) -> float:
        """Current over baseline request aggregate; `default` when the baseline is not positive."""
        base = self.req_baseline(key)
        return self.req_current(key) / base if base > 0 else default

    def step_ratio(self, key: str, default: float) -> float:
        """Current over baseline step aggregate; `default` when the baseline is not positive (or no steps)."""
        base = self.step_baseline(key)
        return self.step_current(key) / base if base > 0 else default

    def onset(self, name: str | tuple[str, ...], fallback: float | None = None) -> float | None:
        """Unix seconds of the change point of the finding's own evidence series `name`, searched near the
        split of the compared windows (within `onset_search_share` of the analysed span, at least
        `onset_search_s`, after it and twice that before it: the split lands where the symptoms moved,
        which a cause precedes by the time its backlog takes to build): a series that drifts elsewhere in
        a long window cannot pull the onset away from the change. Several names: one split shared by the
        series, each voting with the share of its own variance the split explains (`stats.change_point`).
        `fallback` (the split by default) when the series show none."""
        fallback = self.window.start if fallback is None else fallback
        names = (name,) if isinstance(name, str) else name
        lo, hi = self._onset_range(any(n in SETTINGS for n in names))
        segments = [seg for n in names if (seg := self._onset_segment(n, lo, hi)) is not None]
        if not segments:
            return fallback
        k = stats.change_point(segments, max(2, (hi - lo) // 8))
        return fallback if k is None else self.series.time_of(lo + k)

    def _onset_range(self, setting: bool) -> tuple[int, int]:
        """[lo, hi) intervals the onset is searched in (see `onset`)."""
        cfg = self.config
        split = self.window.start
        first = min(self.baseline.start, self.window.start)
        if setting:  # a setting steps where it was changed and never drifts: search it all
            return self.series.index_of(first), self.series.index_of(self.window.end) + 1
        reach = max(cfg.onset_search_s, cfg.onset_search_share * (self.window.end - first))
        lo = self.series.index_of(max(split - 2 * reach, first))
        return lo, self.series.index_of(min(split + reach, self.window.end)) + 1

    def _onset_segment(self, name: str, lo: int, hi: int) -> np.ndarray | None:
        """Series `name` over [lo, hi), on a log scale where it spans 100x; None with under 6 values."""
        seg = self.series.get(name)[lo:hi]
        if np.isfinite(seg).sum() < 6:
            return None
        finite = seg[np.isfinite(seg)]
        low, high = np.quantile(finite, [0.1, 0.9])
        if finite.min() > 0 and high > 10 * low:
            # a step of 100x followed by a backlog's growth: the step is the change. Judged on the 10th
            # and 90th percentiles (the searched segment is at least a third after the split): a
            # per-second mean of a few heavy-tailed values spans 10x by chance, and on a log scale its
            # smallest intervals, not the shift, decide where the split goes.
            return np.log(seg)
        return seg


# Series of the engine's settings (the share of steps with chunked prefill, the batch limits, the KV pool,
# the weights' dtype): they step where someone changed a setting, so a finding on one takes its onset from
# the whole analysed span, not only from near the split the symptoms put.
SETTINGS = frozenset(
    ("chunked_share", "max_num_seqs", "max_num_batched_tokens", "kv_blocks_total_mean")
    + ("weight_dtype_is_last",)
)


def span_params(span: TimeRange | None) -> dict[str, int]:
    """Parameters t0/t1 (ns) for a span; the whole store when None."""
    if span is None:
        return {"t0": 0, "t1": _FAR_FUTURE_NS}
    return {"t0": span.start_ns, "t1": span.end_ns}


def side_params(baseline: TimeRange, current: TimeRange) -> dict[str, int]:
    """Parameters b0/b1/c0/c1 (ns) of the two compared windows."""
    return {"b0": baseline.start_ns, "b1": baseline.end_ns, "c0": current.start_ns, "c1": current.end_ns}


def bounds(source: Reader, span: TimeRange | None) -> dict[str, float]:
    """Requests and steps in `span` (the whole store when None), with the first and last request time."""
    row = source.query(queries.BOUNDS, span_params(span)).dicts()[0]
    return {k: num(v) for k, v in row.items()}


def series(source: Reader, span: TimeRange, interval_s: float) -> Series:
    """Request and step series per interval over `span`, aligned on one index."""
    iv_ms = max(1, round(interval_s * 1000))
    params = span_params(span) | {"t0_ms": span.start_ns // 1_000_000, "iv_ms": iv_ms}
    m = max(1, math.ceil(span.seconds * 1000 / iv_ms))
    columns: dict[str, np.ndarray] = {}
    result = source.query(queries.REQUEST_SERIES, params)
    idx = [int(r[0]) for r in result.rows]
    for j, name in enumerate(result.columns[1:], start=1):
        col = np.full(m, np.nan)
        for i, row in zip(idx, result.rows, strict=True):
            if 0 <= i < m:
                col[i] = num(row[j])
        columns[name] = col
    frame = StepFrame.from_result(source.query(queries.STEP_FRAME_BY_INTERVAL, params))
    columns |= frame.series(m)
    columns |= engine_series(source, params, m, steps_recorded=bool(np.nansum(columns["steps"])))
    dtypes = columns["weight_dtype"]
    named = [d for d in dtypes if d]
    last = named[-1] if named else ""
    columns["weight_dtype_is_last"] = np.array([float(d == last) if d else np.nan for d in dtypes])
    return Series(span.start, iv_ms / 1000, columns, frame)


# step series -> the scraped series that stands in for it when the span has no step spans
_FROM_METRICS = {
    "batch_mean": "m_batch_mean",
    "waiting_mean": "m_waiting_mean",
    "kv_usage": "m_kv_usage",
    "preemptions": "m_preemptions",
    "max_num_seqs": "m_max_num_seqs",
    "kv_blocks_total_mean": "m_kv_blocks_total",
}


def engine_series(
    source: Reader, params: dict[str, int], m: int, steps_recorded: bool
) -> dict[str, np.ndarray]:
    """Scraped engine series per interval (`m_*`); without step spans in the span they also fill the step
    series of the same meaning, so change points and onsets read them the same way."""
    result = source.query(queries.ENGINE_SERIES, params)
    columns: dict[str, np.ndarray] = {}
    for j, name in enumerate(result.columns[1:], start=1):
        col = np.full(m, np.nan)
        for row in result.rows:
            i = int(row[0])
            if 0 <= i < m:
                col[i] = num(row[j])
        columns[name] = col
    if not steps_recorded and result.rows:
        columns |= {step: columns[sample] for step, sample in _FROM_METRICS.items() if sample in columns}
    return columns


def engine_sides(source: Reader, baseline: TimeRange, current: TimeRange) -> tuple[dict, dict] | None:
    """Per-side aggregates of the scraped engine samples (None when neither side has any)."""
    b, c = _two_sides(source.query(queries.ENGINE_SIDES, side_params(baseline, current)).dicts())
    if not b and not c:
        return None
    for side in (b, c):
        for k, v in list(side.items()):
            side[k] = num(v)
        side.setdefault("samples", 0.0)
        seconds = side.get("seconds_scraped", math.nan)
        side["preemptions_per_min"] = (
            60 * side.get("preemptions", math.nan) / seconds if seconds > 0 else math.nan
        )
    return b, c


def _two_sides(rows: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    by_side: dict[int, dict[str, Any]] = {int(r.pop("side")): r for r in rows}
    return by_side.get(0, {}), by_side.get(1, {})


def request_sides(source: Reader, baseline: TimeRange, current: TimeRange) -> tuple[dict, dict]:
    """Per-side request aggregates; `seconds` and `rate_rps` added from the window lengths."""
    b, c = _two_sides(source.query(queries.REQUEST_SIDES, side_params(baseline, current)).dicts())
    for side, window in ((b, baseline), (c, current)):
        for k, v in list(side.items()):
            side[k] = num(v)
        side.setdefault("requests", 0.0)
        # Arrivals count each stored request `sample_weight` times: a kept span stands for the requests
        # head sampling dropped, and slow ones kept anyway count once (so a TTFT regression under
        # tail-keeping sampling does not read as more arrivals).
        arrivals = num(side.get("arrivals"))
        side["arrivals"] = arrivals if math.isfinite(arrivals) else side["requests"]
        side["seconds"] = window.seconds
        side["rate_rps"] = side["arrivals"] / window.seconds
        side["output_tokens_per_s"] = num(side.get("output_tokens_sum", 0.0)) / window.seconds
    return b, c


def request_sample(
    source: Reader, baseline: TimeRange, current: TimeRange, n_b: float, n_c: float, per_side: int
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Up to `per_side` requests per side, picked by span-id hash, as numeric columns."""

    def cut(n: float) -> int:
        share = 1.0 if n <= 0 else min(1.0, 2.0 * per_side / n)
        return min(2**64 - 1, int(share * (2**64 - 1)))

    params = side_params(baseline, current) | {"cut_b": cut(n_b), "cut_c": cut(n_c), "n": per_side}
    result = source.query(queries.REQUEST_SAMPLE, params)
    cols = result.columns
    out: tuple[dict[str, list[float]], dict[str, list[float]]] = ({}, {})
    for row in result.rows:
        side = out[int(row[0])]
        for name, value in zip(cols[1:], row[1:], strict=True):
            side.setdefault(name, []).append(num(value))
    empty = {name: np.array([]) for name in cols[1:]}
    return tuple(empty | {k: np.asarray(v, dtype=float) for k, v in s.items()} for s in out)  # type: ignore[return-value]


def step_sides(
    source: Reader,
    baseline: TimeRange,
    current: TimeRange,
    intervals: tuple[StepFrame, tuple[int, int, int]] | None = None,
) -> tuple[tuple[dict, dict] | None, list[dict[str, float]]]:
    """Per-side step aggregates (None when neither side has any step) and the shape table. `intervals` is
    (the series' step frame, (first, split, end) interval indices) when the sides are whole intervals: the
    sums then come from that frame and only the quantiles are read again; else one frame by side."""
    params = side_params(baseline, current)
    if intervals is not None:
        frame, (lo, split, hi) = intervals
        masks = ((frame.key >= lo) & (frame.key < split), (frame.key >= split) & (frame.key < hi))
    else:
        frame = StepFrame.from_result(source.query(queries.STEP_FRAME_BY_SIDE, params))
        masks = (frame.key == 0, frame.key == 1)
    b, c = (frame.side(mask) for mask in masks)
    if not b and not c:
        return None, []
    qb, qc = _two_sides(source.query(queries.STEP_SIDE_QUANTILES, params).dicts())
    for side, quantiles, window in ((b, qb, baseline), (c, qc, current)):
        if side:
            side |= {k: num(v) for k, v in quantiles.items()}
        side.setdefault("steps", 0.0)
        side.setdefault("weight_dtype_top", "")
        cpus = num(side.get("host_cpus"))
        side["host_load_per_cpu"] = num(side.get("host_load_1m")) / cpus if cpus > 0 else math.nan
        side["seconds"] = window.seconds
    return (b, c), [row for s, mask in enumerate(masks) for row in frame.shape(mask, s)]


def num(value: Any) -> float:
    """A query value as float; NULL, NaN (the API's null) and non-numbers read as NaN."""
    if value is None:
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan
