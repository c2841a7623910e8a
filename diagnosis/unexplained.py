"""`unexplained`: a symptom regressed significantly and no rule's evidence explains it. Never silent, never
the closest wrong label: the finding says which part of TTFT, of the decode step period and of the step
loop's time grew, which series moved most at the change point (before and after), and which named query
to run next. Its confidence is the share of the symptom's change the decomposition accounts for.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

import numpy as np

from diagnosis import queries
from diagnosis.facts import Facts
from diagnosis.records import Evidence, Finding
from diagnosis.rules import base

CAUSE = "unexplained"
NOTE = "symptoms regressed but no rule's evidence explains them"  # the diagnosis's note beside the finding
# Series compared across the split, with the unit their name carries; the ones that moved most are
# reported (each scored by its shift in pooled standard deviations across the intervals).
SERIES = (
    "ttft_mean", "tpot_mean", "e2e_mean", "queue_mean", "prefill_mean", "frontend_mean", "requests",
    "input_mean", "output_mean", "cached_share", "rpc_delay_mean", "loop_lag_mean", "step_mean",
    "work_gap_mean", "batch_mean", "waiting_mean", "kv_usage", "preemptions", "cpu_share", "max_num_seqs",
    "max_num_batched_tokens", "chunked_share", "bytes_mean", "kv_transfer_mean", "host_load_1m",
)  # fmt: skip
TOP_SERIES = 5


def grown_parts(facts: Facts) -> list[tuple[str, float, float, float]]:
    """(part, baseline, current, share of its symptom's change) of every decomposition part that grew."""
    out = []
    ttft = facts.decomposition.get("ttft", {})
    if ttft.get("available"):
        mean = ttft["mean"]
        for part, share in mean["share"].items():
            if mean["delta"][part] > 0:
                out.append((f"ttft.{part}_s", mean["baseline"][part], mean["current"][part], share))
    period = facts.decomposition.get("step_period", {})
    if period.get("available"):
        for part, share in period["share"].items():
            if period["delta"][part] > 0 and part != "residual":
                out.append((f"step_period.{part}_s", 0.0, period["delta"][part], share))
    loop = facts.decomposition.get("throughput", {})
    if "busy_share" in loop.get("current", {}):
        for part in ("busy_share", "waiting_gap_share", "idle_share"):
            b, c = loop["baseline"][part], loop["current"][part]
            if c - b > 0.05:
                out.append((f"step_loop.{part}", b, c, math.nan))
    return sorted(out, key=lambda p: -(p[3] if math.isfinite(p[3]) else 0.0))


def moved_series(facts: Facts) -> list[tuple[str, float, float, float]]:
    """(series, baseline mean, current mean, score) of the series that moved most across the split."""
    s = facts.series
    t = s.start + np.arange(len(s)) * s.interval_s
    before = (t >= facts.baseline.start) & (t < facts.baseline.end)
    after = (t >= facts.window.start) & (t < facts.window.end)
    out = []
    for name in SERIES:
        x = s.get(name)
        if name == "requests":
            x = np.nan_to_num(x)
        xb, xc = x[before & np.isfinite(x)], x[after & np.isfinite(x)]
        if len(xb) < 3 or len(xc) < 3:
            continue
        mb, mc = float(xb.mean()), float(xc.mean())
        spread = math.sqrt((float(xb.var()) + float(xc.var())) / 2)
        if mb == mc:
            continue
        score = abs(mc - mb) / spread if spread > 0 else math.inf
        out.append((name, mb, mc, score))
    out.sort(key=lambda r: -r[3])
    return out[:TOP_SERIES]


def accounted(facts: Facts) -> float:
    """The share of the regressed symptom's change the decomposition accounts for (1 - its residual)."""
    shares = []
    if facts.regressed("ttft", "e2e", "goodput"):
        ttft = facts.decomposition.get("ttft", {})
        if ttft.get("available"):
            other = ttft["mean"]["share"].get("other", math.nan)
            if math.isfinite(other):
                shares.append(1 - abs(other))
    if facts.regressed("tpot", "itl_max", "throughput", "e2e", "goodput"):
        period = facts.decomposition.get("step_period", {})
        if period.get("available"):
            residual = period["share"].get("residual", math.nan)
            if math.isfinite(residual):
                shares.append(1 - abs(residual))
    return max(0.05, min(0.95, max(shares))) if shares else 0.05


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def lever(facts: Facts, parts: list[tuple[str, float, float, float]]) -> str:
    """Where to look next: the named query for the part that grew most."""
    top = parts[0][0] if parts else ""
    w = f"from={_iso(facts.baseline.start)} to={_iso(facts.window.end)}"
    if top.startswith("step_period.") or top.startswith("step_loop."):
        query = f"stepscope query step_time_by_batch {w}"
        where = "how step time and gaps per batch size moved"
    elif top in ("ttft.queue_s", "ttft.other_s", "ttft.frontend_s"):
        query = f"stepscope query slowest {w} metric=queue_s"
        where = "the requests that waited longest, then `stepscope query waterfall trace_id=...` on one"
    else:
        query = (
            f"stepscope query compare a_from={_iso(facts.baseline.start)} a_to={_iso(facts.baseline.end)} "
            f"b_from={_iso(facts.window.start)} b_to={_iso(facts.window.end)}"
        )
        where = "the two windows side by side"
    return (
        f"No known cause matches. Run `{query}` ({where}); check what changed at the onset (deploys, "
        "configuration, neighbours on the host, traffic mix)."
    )


def load_explains(facts: Facts) -> str | None:
    """A note when the regression is what a busier spell of the same demand does to an unchanged engine;
    None otherwise (then the regression is `unexplained`, or `host_explains` reads it).

    Poisson arrivals at one rate put ~20-40% more requests into one half of a short run than the other,
    and bunch within a window at the same count; more running sequences and more prefills riding in decode
    steps then raise TPOT and TTFT at the same engine speed. That is explained, by the load, when everything
    else held: arrivals held or rose but not past `arrival_ratio` with significance
    (`rules.base.demand_grew`, else it is demand growth: overload's domain), the batch grew, the step
    time at equal batch size held (below `equal_batch_ratio`), the growth of the step period is mostly
    batch size and prefill in decode steps (`load_share`), TTFT grew in queue and prefill only, throughput
    and errors held, the request mix, the configuration, the cache hit share, the gaps, the RPC delay, the
    front end and the KV transfer held. Needs step spans."""
    cfg = facts.config
    if not facts.step_ratio("batch_mean", 1.0) >= cfg.load_noise_ratio:
        return None
    period = _engine_held(facts, ("batch_size", "prefill_in_decode_steps"))
    if period is None:
        return None
    arrivals = facts.req_ratio("rate_rps", 1.0)
    bb, bc = facts.step_pair("batch_mean")
    return (
        f"the symptoms moved with a busier spell of the same demand: arrivals x{arrivals:.2f} (short of a "
        f"significant rise past x{cfg.arrival_ratio}), running batch {bb:.2f} -> {bc:.2f}, step time at "
        f"equal batch x{period['equal_batch_ratio']:.2f}{_cache_note(facts)}; prompt and output lengths, "
        "configuration and engine speed unchanged (no finding)"
    )


def host_explains(facts: Facts) -> str | None:
    """A note when the regression is what a busier host does to an unchanged engine serving the same
    demand, short of a compute slowdown; None otherwise (then the regression is `unexplained`).

    Processes that share the engine's cores (on a small host: the other replicas, the router, the load
    generator) come and go; while the host's load average is past `host_overload_per_cpu` runnable tasks a
    core and rising, every step and prefill takes a little longer. That is the host's, not a cause, when
    the step time at equal batch size rose but stayed below `equal_batch_ratio` (past it, it is
    `compute_slowdown`), the growth of the step period is that step time, the gaps between steps (the
    stepping thread waiting for a core) and what a busier spell brings (`load_share`), TTFT grew in queue
    and prefill, and everything `load_explains` needs held held. A dev fleet of three replicas with no
    fault: the host's load 1.39 -> 1.95 a core, step time at equal batch x1.12, prefill x1.19, TTFT P50
    5.7 -> 7.2 ms (p = 1e-5). On a host past its cores on both sides, tails that moved alone are the
    host's too (`_oversubscribed_tails`). Needs step spans."""
    cfg = facts.config
    load_b, load_c = facts.step_pair("host_load_per_cpu")
    if not (math.isfinite(load_b) and math.isfinite(load_c)):
        return None
    oversubscribed = min(load_b, load_c) >= cfg.host_overload_per_cpu and _tails_only(facts)
    busier = load_c > load_b and load_c >= cfg.host_overload_per_cpu
    if not (oversubscribed or busier):
        return None
    period = _engine_held(facts, ("equal_batch_step_time", "gaps", "batch_size", "prefill_in_decode_steps"))
    if period is None:
        return None
    if oversubscribed:
        return _oversubscribed_tails(facts, period, load_b, load_c)
    if not period.get("equal_batch_ratio", math.nan) > 1:
        return None
    speed, prefill = period["equal_batch_ratio"], facts.req_ratio("prefill_mean", math.nan)
    return (
        f"the symptoms moved with a busier host: its load average {load_b:.2f} -> {load_c:.2f} runnable "
        f"tasks a core, step time at equal batch x{speed:.2f} (short of a compute slowdown at "
        f"x{cfg.equal_batch_ratio}), prefill x{prefill:.2f}; demand, request mix and configuration "
        f"unchanged{_cache_note(facts)} (no finding)"
    )


def _tails_only(facts: Facts) -> bool:
    """Whether every regression is a latency tail (a P99), none a median, a rate or an error rate."""
    return bool(facts.regressions) and all(r.metric.endswith("_p99") for r in facts.regressions)


def _oversubscribed_tails(facts: Facts, period: dict[str, Any], load_b: float, load_c: float) -> str:
    """`host_explains`' note for tails that moved on a host oversubscribed on both sides of the split, with
    everything `_engine_held` needs held (`period`, its decomposition): a request's slowest token or step
    there waits for a core behind the host's other runnable tasks, however the engine does, so only its
    tails move, from spell to spell. A dev healthy fleet of three replicas at 3.0 -> 2.4 runnable tasks a
    core: ITL max P99 x1.46 over its last 15 s (p = 9e-5), its medians, step time at equal batch (x1.08) and
    arrivals (x1.04) unchanged."""
    tails = ", ".join(sorted({r.metric for r in facts.regressions}))
    speed = period.get("equal_batch_ratio", math.nan)
    return (
        f"only latency tails moved ({tails}) on a host past its cores throughout: its load average "
        f"{load_b:.2f} -> {load_c:.2f} runnable tasks a core, where a request's slowest token waits for a "
        f"core; medians, step time at equal batch (x{speed:.2f}), demand, "
        f"request mix and configuration unchanged (no finding)"
    )


def _engine_held(facts: Facts, period_parts: tuple[str, ...]) -> dict[str, Any] | None:
    """The step-period decomposition when the engine's speed, configuration and every cause's evidence held
    and the symptoms grew where `period_parts` (TPOT) and queue and prefill (TTFT) say; None otherwise."""
    cfg = facts.config
    if facts.regressed("throughput", "error_rate") or facts.steps is None or base.demand_grew(facts):
        return None
    if facts.req_ratio("rate_rps", 1.0) * cfg.load_noise_ratio < 1:
        return None  # demand fell: a slower engine serving fewer requests is no busier spell
    period = facts.decomposition.get("step_period", {})
    if not period.get("available") or not period.get("equal_batch_ratio", math.inf) < cfg.equal_batch_ratio:
        return None
    if facts.regressed("tpot", "itl_max") and not (base.period_share(facts, *period_parts) >= cfg.load_share):
        return None
    if facts.regressed("ttft") and not (base.ttft_share(facts, "queue", "prefill") >= cfg.load_share):
        return None
    held = (
        facts.req_ratio("input_mean", 1.0) < cfg.steady_prompt_ratio,
        facts.req_ratio("output_mean", 1.0) < cfg.steady_prompt_ratio,
        facts.step_ratio("max_num_seqs_mean", 1.0) < cfg.limit_raise_ratio,
        facts.step_ratio("max_num_seqs_mean", 1.0) > 1 / cfg.limit_raise_ratio,
        not base.chunking_turned_off(facts),
        period.get("bytes_ratio_equal_batch", 1.0) < cfg.bytes_ratio,
        not base.cache_share_fell(*facts.req_pair("cached_share"), cfg),
        not base.gaps_grew(facts),
        base.rpc_grew(facts) is not True,
        not base.frontend_grew(facts),
        base.ttft_share(facts, "kv_transfer") < cfg.kv_transfer_share_increase
        or not facts.req_current("with_kv_transfer") > 0,
    )
    return period if all(held) else None


def _cache_note(facts: Facts) -> str:
    """The note's words on a cached share that fell by `cache_share_drop` or more (short of a miss, or no
    note would be asked for); empty otherwise."""
    cb, cc = facts.req_pair("cached_share")
    if not cb - cc >= facts.config.cache_share_drop:
        return ""
    return f", cached share of prompt tokens {cb:.0%} -> {cc:.0%} (short of a prefix cache miss)"


def explain(facts: Facts) -> Finding:
    """The `unexplained` finding of a diagnosis with regressions and no finding."""
    parts = grown_parts(facts)
    moved = moved_series(facts)
    evidence = [Evidence(name, b, c) for name, b, c, _ in parts[:4]]
    evidence += [Evidence(f"series.{name}", b, c) for name, b, c, _ in moved]
    share = accounted(facts)
    span_start = min(facts.baseline.start, facts.window.start)
    iv = max(1, round(facts.series.interval_s))
    sql = queries.render(
        queries.EVIDENCE[CAUSE],
        {"iv": int(iv), "t0": int(span_start * 1e9), "t1": int(facts.window.end * 1e9)},
    )
    grew = ", ".join(p[0] for p in parts[:3]) or "no part of the decomposition"
    onset = facts.onset(moved[0][0]) if moved else facts.window.start
    symptoms = tuple(r.metric for r in facts.regressions)
    return Finding(
        cause=CAUSE,
        symptoms=symptoms,
        confidence=share,
        onset=onset,
        evidence=tuple(evidence),
        lever=lever(facts, parts),
        sql=sql,
        summary=f"{', '.join(symptoms[:3])} regressed and no rule explains it; grew: {grew}",
        share_explained=share,
    )
