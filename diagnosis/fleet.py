"""Fleets: filter the diagnosis to some services or instances, and localize a regression to instances.

    scoped = ScopedReader(source, instances=["r0"])        # every query reads r0's rows only
    loc = localize(source, facts)                            # fleet-wide, or concentrated on a subset?

Localization compares the instances over the same two windows. For the regressed symptom (TTFT, TPOT or
E2E), an instance's *lift* is the log of its mean's ratio to its own baseline mean, and its part of the
regression is its current requests times the rise (seconds). A subset is named when it holds
`localize_share` of the regression and its lowest lift is `localize_lift_gap` times the highest among the
rest (at least a tenth): one slow replica of three rose x1.75 while its peers rose x1.03-1.13; a
fleet-wide rise lifts every instance alike. An instance that served in the baseline and (almost) stopped
in the current window is lost capacity, whatever the symptoms.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from collector.client import Reader
from collector.timerange import TimeRange
from diagnosis import queries, stats
from diagnosis.facts import num, span_params
from diagnosis.records import Regression

_TABLES = re.compile(r"\bFROM (requests|steps)\b")
_LATENCY = ("ttft", "tpot", "e2e")


class ScopedReader:
    """A Reader whose reads of `requests` and `steps` see only the given services and instances."""

    def __init__(self, source: Reader, services: list[str] | None = None, instances: list[str] | None = None):
        self.inner = source
        self.services, self.instances = list(services or []), list(instances or [])
        self.description = source.description

    def query(self, sql: str, params: dict[str, Any] | None = None) -> Any:
        sql = _TABLES.sub(lambda m: "FROM " + queries.SCOPED_TABLE.replace("{table}", m.group(1)), sql)
        scope = {"scope_services": self.services, "scope_instances": self.instances}
        return self.inner.query(sql, {**(params or {}), **scope})

    def close(self) -> None:
        self.inner.close()


def scoped(source: Reader, services: list[str] | None, instances: list[str] | None) -> Reader:
    """`source` filtered to these services and instances (itself when neither is given)."""
    return ScopedReader(source, services, instances) if services or instances else source


@dataclass(frozen=True, slots=True)
class Localization:
    """Where a regression is: `kind` fleet or instances, the instances, their share of the regression."""

    kind: str  # fleet | instances
    instances: tuple[str, ...]
    share: float  # of the regression's tail on `instances`
    metric: str = ""  # the symptom localized (ttft, tpot, e2e)
    lost: tuple[str, ...] = ()  # served in the baseline, not in the current window
    spread: tuple[float, float] = (math.nan, math.nan)  # instances per shared prefix (baseline, current)
    affinity: tuple[float, float] = (math.nan, math.nan)  # repeated prefixes where they went last (same)
    rows: dict[str, tuple[dict[str, float], dict[str, float]]] = field(default_factory=dict)  # per instance
    # the whole fleet's (baseline, current) request aggregates: what a subset's rows cannot say about the
    # fleet (its distinct prefixes per request, its prompt mix; a router's switch moves a subset's mix alone)
    whole: tuple[dict[str, float], dict[str, float]] = field(default_factory=lambda: ({}, {}))

    def scope(self) -> dict[str, Any]:
        """The `scope` object of a finding (docs/diagnosis.md)."""
        share = round(self.share, 3) if math.isfinite(self.share) else None
        return {"kind": self.kind, "instances": list(self.instances), "share_of_regression": share}

    def fleet_scope(self) -> dict[str, Any]:
        """The `scope` of a finding about the whole fleet (a router's cause), wherever the symptoms are."""
        return {"kind": "fleet", "instances": sorted(self.rows), "share_of_regression": 1.0}

    def side(self, instance: str, i: int, key: str) -> float:
        return num(self.rows.get(instance, ({}, {}))[i].get(key))

    def fleet_pair(self, key: str) -> tuple[float, float]:
        """(baseline, current) of the whole fleet's request aggregate `key` (NaN when not gathered)."""
        return num(self.whole[0].get(key)), num(self.whole[1].get(key))

    def fleet_ratio(self, key: str, default: float) -> float:
        """The whole fleet's current over baseline request aggregate; `default` when the baseline is not
        positive (or was not gathered)."""
        base, cur = self.fleet_pair(key)
        return cur / base if base > 0 else default

    def stopped(self) -> float:
        """Unix seconds just after the last request of the earliest-stopping lost instance (NaN without)."""
        last = [max(self.side(n, 0, "last_ns"), _nan0(self.side(n, 1, "last_ns"))) for n in self.lost]
        return min(last) / 1e9 + 1e-3 if last else math.nan


def instance_rows(
    source: Reader, baseline: TimeRange, current: TimeRange
) -> dict[str, tuple[dict[str, float], dict[str, float]]]:
    """Per instance: (baseline, current) aggregates of INSTANCE_SIDES."""
    params = {"b0": int(baseline.start * 1e9), "b1": int(baseline.end * 1e9)}
    params |= {"c0": int(current.start * 1e9), "c1": int(current.end * 1e9)}
    rows: dict[str, tuple[dict[str, float], dict[str, float]]] = {}
    result = source.query(queries.INSTANCE_SIDES, params)
    for row in result.rows:
        rec = dict(zip(result.columns, row, strict=True))
        pair = rows.setdefault(str(rec["instance"]), ({}, {}))
        pair[int(num(rec["side"]))].update(rec)
    return rows


def prefix_spread(source: Reader, baseline: TimeRange, current: TimeRange) -> tuple[float, float]:
    """(baseline, current) mean number of instances a shared prompt prefix landed on."""
    return _per_side(source, queries.SHARED_PREFIX_SPREAD, "instances_per_prefix", baseline, current)


def prefix_affinity(source: Reader, baseline: TimeRange, current: TimeRange) -> tuple[float, float]:
    """(baseline, current) share of repeated prompt prefixes that landed on the instance they went to last
    (queries.PREFIX_AFFINITY)."""
    return _per_side(source, queries.PREFIX_AFFINITY, "affinity", baseline, current)


def _per_side(
    source: Reader, sql: str, column: str, baseline: TimeRange, current: TimeRange
) -> tuple[float, float]:
    """`column` of a query that returns one row per side (0 baseline, 1 current); NaN for a missing side."""
    params = {"b0": int(baseline.start * 1e9), "b1": int(baseline.end * 1e9)}
    params |= {"c0": int(current.start * 1e9), "c1": int(current.end * 1e9)}
    result = source.query(sql, params)
    out = [math.nan, math.nan]
    for row in result.rows:
        rec = dict(zip(result.columns, row, strict=True))
        out[int(num(rec["side"]))] = num(rec[column])
    return out[0], out[1]


def localize(source: Reader, facts: Any) -> Localization:
    """Fleet-wide or on some instances: see the module docstring. `facts`: the whole scope's Facts."""
    cfg = facts.config
    metric = next((r.family for r in facts.regressions if r.family in _LATENCY), "e2e")
    rows = instance_rows(source, facts.baseline, facts.window)
    names = sorted(rows)
    lost = tuple(n for n in names if _lost(rows[n], facts, cfg.lost_instance_share))
    spread = affinity = (math.nan, math.nan)
    if len(names) > 1:
        spread = prefix_spread(source, facts.baseline, facts.window)
        affinity = prefix_affinity(source, facts.baseline, facts.window)
    fleet = Localization("fleet", tuple(names), 1.0, metric, lost, spread, affinity, rows, facts.req)
    serving = [n for n in names if n not in lost and _nan0(num(rows[n][1].get("requests"))) > 0]
    if len(serving) < 2 or not facts.regressions:
        return fleet
    fleet_base = facts.req_baseline(f"{metric}_mean")
    lift, part = {}, {}
    for n in serving:
        (b, c), key = rows[n], f"{metric}_mean"
        own = num(b.get(key)) if _nan0(num(b.get("requests"))) >= cfg.localize_min_requests else math.nan
        base = own if own > 0 else fleet_base
        now = _nan0(num(c.get(key)))
        rise = max(now - base, 0.0) if base > 0 else 0.0
        lift[n] = math.log(now / base) if base > 0 and now > base else 0.0
        part[n] = rise * num(c.get("requests"))
    total = sum(part.values())
    if not total > 0:
        return fleet
    order = sorted(serving, key=lambda n: -lift[n])
    for k in range(1, len(order)):
        top, rest = order[:k], order[k:]
        share = sum(part[n] for n in top) / total
        floor = math.log1p(cfg.localize_min_lift)
        gap = min(lift[n] for n in top) / max(max(lift[n] for n in rest), floor)
        if share >= cfg.localize_share and gap >= cfg.localize_lift_gap:
            return replace(fleet, kind="instances", instances=tuple(sorted(top)), share=share)
    return fleet


def stopped_at(source: Reader, window: TimeRange, cfg: Any) -> float | None:
    """When an instance stopped serving inside `window` while its peers kept on (unix s just after its
    last request; the earliest such instance), else None. It stopped when it served at least
    `min_requests_p50` / 3 requests and its own rate before its last one makes the silence after it
    improbable (no arrival in that time has a Poisson chance under `alpha`), the silence is at least
    `min_segment_share` of the window, and a peer served later in that silence. The split a change point
    finds follows the symptoms, and a fleet that absorbs a lost replica shows none: this is the change."""
    rows = source.query(queries.INSTANCE_SPAN, span_params(window)).dicts()
    if len(rows) < 2:
        return None
    spans = {
        str(r["instance"]): (num(r["requests"]), num(r["first_ns"]) / 1e9, num(r["last_ns"]) / 1e9)
        for r in rows
    }
    stops = []
    for name, (n, first, last) in spans.items():
        silence = window.end - last
        if (
            n < cfg.min_requests_p50 / 3
            or not last > first
            or silence < cfg.min_segment_share * window.seconds
        ):
            continue
        expected = (n - 1) / (last - first) * silence
        peer_later = any(other[2] > last + silence / 2 for peer, other in spans.items() if peer != name)
        if expected >= -math.log(cfg.alpha) and peer_later:
            stops.append(last + 1e-3)
    return min(stops) if stops else None


def _nan0(x: float) -> float:
    return x if math.isfinite(x) else 0.0


def _lost(pair: tuple[dict, dict], facts: Any, min_share: float) -> bool:
    """Served in the baseline at a rate the current window fell to `min_share` of (or below)."""
    b, c = num(pair[0].get("requests")), num(pair[1].get("requests"))
    if not b >= facts.config.min_requests_p50 / 3:
        return False
    rate_b = b / max(facts.baseline.seconds, 1e-9)
    rate_c = (c if math.isfinite(c) else 0.0) / max(facts.window.seconds, 1e-9)
    return rate_c <= min_share * rate_b


def peer_step_ratio(source: Reader, current: TimeRange, subset: tuple[str, ...]) -> float:
    """The subset's decode step time over its peers' at equal batch size, in the current window (NaN
    without steps on both): sum over batch sizes of the subset's steps x (its mean / the peers' mean)."""
    params = {"c0": int(current.start * 1e9), "c1": int(current.end * 1e9), "subset": list(subset)}
    result = source.query(queries.PEER_STEPS, params)
    sub: dict[int, tuple[float, float]] = {}
    peers: dict[int, float] = {}
    for row in result.rows:
        rec = dict(zip(result.columns, row, strict=True))
        b = int(num(rec["batch_size"]))
        if int(num(rec["in_subset"])):
            sub[b] = (num(rec["steps"]), num(rec["duration_mean"]))
        else:
            peers[b] = num(rec["duration_mean"])
    num_, den = 0.0, 0.0
    for b, (n, d) in sub.items():
        if b in peers and peers[b] > 0:
            num_ += n * d
            den += n * peers[b]
    return num_ / den if den > 0 else math.nan


def peer_regressions(fleet: Reader, instance: str, facts: Any) -> list[Regression]:
    """`instance`'s TTFT and TPOT medians against its peers': each of its requests over the peers' median in
    the same `sample_block_s` block of time, current window against baseline, with the latency tests'
    autocorrelation-aware rank test (`against="peers"`). Load the whole fleet shares (the host's other
    work, the collector's inserts) moves every instance alike and cancels; one replica held to a share of
    the CPU does not. `facts`: the instance's own Facts (its windows and config)."""
    cfg = facts.config
    params = {"b0": int(facts.baseline.start * 1e9), "b1": int(facts.baseline.end * 1e9)}
    params |= {"c0": int(facts.window.start * 1e9), "c1": int(facts.window.end * 1e9)}
    result = fleet.query(queries.PEER_LATENCY, params | {"instance": instance, "n": cfg.peer_sample_rows})
    if not result.rows:
        return []
    col = {name: i for i, name in enumerate(result.columns)}
    rows = list(zip(*result.rows, strict=True))
    side = np.asarray(rows[col["side"]], dtype=int)
    own = np.asarray(rows[col["own"]], dtype=bool)
    t = np.asarray(rows[col["t"]], dtype=float)
    block = np.floor((t - facts.baseline.start) / cfg.sample_block_s).astype(int)
    out = []
    for name, column in (("ttft_p50", "ttft_s"), ("tpot_p50", "tpot_s")):
        x = np.asarray([np.nan if v is None else v for v in rows[col[column]]], dtype=float)
        rel, keep = _over_peers(x, own, block)
        xb, xc = rel[keep & (side == 0)], rel[keep & (side == 1)]
        if min(len(xb), len(xc)) < cfg.min_requests_p50:
            continue
        base, cur = float(np.exp(np.median(xb))), float(np.exp(np.median(xc)))
        r = stats.ratio(cur, base)
        if not r >= cfg.min_ratio_p50:
            continue
        times = (t[keep & (side == 1)], t[keep & (side == 0)])
        p = stats.mann_whitney_greater(xc, xb, times, cfg.sample_block_s, cfg.inflation_from_baseline)
        if p < cfg.alpha:
            out.append(Regression(name, base, cur, r, p, len(xb), len(xc), against="peers"))
    return out


def _over_peers(x: np.ndarray, own: np.ndarray, block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, log(x / the peers' median x in the row's block), and which own rows have one (a block
    needs `_MIN_PEERS` peer values)."""
    rel = np.full(len(x), np.nan)
    valid = np.isfinite(x) & (x > 0)
    for b in np.unique(block[own & valid]):
        here = block == b
        peers = x[here & ~own & valid]
        if len(peers) >= _MIN_PEERS:
            mine = here & own & valid
            rel[mine] = np.log(x[mine] / np.median(peers))
    return rel, np.isfinite(rel)


_MIN_PEERS = 3  # peer requests in a block for its median to stand for the fleet's load there


def request_shares(loc: Localization, serving_only: bool = False) -> dict[str, tuple[float, float]]:
    """Per instance: (baseline, current) share of the fleet's requests (of the still serving instances'
    with `serving_only`)."""
    names = [n for n in loc.rows if not (serving_only and n in loc.lost)]
    totals = [sum(_count(loc, n, i) for n in names) for i in (0, 1)]
    return {n: tuple(_count(loc, n, i) / totals[i] if totals[i] else math.nan for i in (0, 1)) for n in names}


def _count(loc: Localization, name: str, side: int) -> float:
    n = loc.side(name, side, "requests")
    return n if math.isfinite(n) else 0.0
