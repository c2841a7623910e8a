"""`diagnose()`: window -> change point (or the given baseline) -> facts -> regressions -> decomposition ->
rules -> ranked findings. The order of docs/diagnosis.md, "How it reasons"."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import numpy as np

from collector import histograms
from collector.client import Reader
from collector.timerange import TimeRange
from diagnosis import facts as F
from diagnosis import stats, unexplained
from diagnosis.config import DiagnosisConfig
from diagnosis.decompose import decompose
from diagnosis.fleet import (
    Localization,
    ScopedReader,
    localize,
    peer_regressions,
    peer_step_ratio,
    stopped_at,
)
from diagnosis.records import Diagnosis, Evidence, Finding, NotEnoughData
from diagnosis.regress import detect, num0, slo, slo_met
from diagnosis.rules import RULE_CAUSES, RULES

# Series the change point looks at when no baseline is given: symptoms (log scale) and the evidence that
# usually moves first. A healthy run's split lands anywhere; the regression tests then find nothing.
_SPLIT_LOG = (
    "ttft_p90",
    "tpot_p90",
    "itl_max_p90",
    "e2e_mean",
    "queue_mean",
    "step_mean",
    "work_gap_mean",
    "rpc_delay_mean",
    "bytes_mean",
    "kv_transfer_mean",
    "frontend_mean",
)
_SPLIT_LINEAR = (
    "arrivals",
    "cached_share",
    "input_mean",
    "batch_mean",
    "kv_usage",
    "preemptions",
    "chunked_share",
    "max_num_seqs",
    "kv_blocks_total_mean",
    "weight_dtype_is_last",
    "output_mean",
    "cpu_share",
)


def _interval(span: TimeRange, cfg: DiagnosisConfig) -> float:
    return max(cfg.min_interval_s, span.seconds / cfg.target_intervals)


def split_window(series: F.Series, window: TimeRange, cfg: DiagnosisConfig) -> int | None:
    """The interval index of the change point inside `window` (None when the window is too short to
    split): the baseline is the intervals before it, the current side the intervals from it on."""
    lo, hi = series.index_of(window.start), series.index_of(window.end - 1e-9) + 1
    columns = []
    for name in _SPLIT_LOG + _SPLIT_LINEAR:
        x = series.get(name)[lo:hi]
        if name in _SPLIT_LOG:
            x = np.log(np.where(x > 0, x, np.nan))
        elif name == "arrivals":
            x = np.nan_to_num(x)  # an interval without a request had zero arrivals
        columns.append(x)
    min_size = max(3, int((hi - lo) * cfg.min_segment_share))
    allowed = testable_splits(series.get("requests")[lo:hi], cfg)
    k = setting_step(series, lo, hi, min_size, allowed, cfg)
    if k is None:
        k = stats.change_point(columns, min_size, allowed)
    return None if k is None else lo + k


def setting_step(
    series: F.Series, lo: int, hi: int, min_size: int, allowed: np.ndarray | None, cfg: DiagnosisConfig
) -> int | None:
    """The split (relative to `lo`) where one of the engine's settings stepped cleanly inside [lo, hi),
    or None. A configuration change has an exact time and the symptoms follow it, each at its own pace:
    the split goes where the setting changed, not where the sum of the drifting symptom series peaks
    (which can be seconds later and put the first affected requests into the baseline)."""
    best, best_share = None, cfg.setting_step_share
    for name in sorted(F.SETTINGS):
        share = stats.shift_shares(series.get(name)[lo:hi], min_size)
        if share is None:
            continue  # the setting did not change
        if allowed is not None:
            share = np.where(allowed, share, np.nan)
        if np.all(np.isnan(share)):
            continue  # it changed where no split is allowed
        k = int(np.nanargmax(share))
        if share[k] >= best_share:
            best, best_share = k, float(share[k])
    return best


def testable_splits(requests: np.ndarray, cfg: DiagnosisConfig) -> np.ndarray | None:
    """Split indices that leave enough requests on both sides for the regression tests: the P99 tests'
    minimum when the window holds twice that, else the medians' (None when not even that: any split).
    A split where one side is too small to test cannot show a regression, however sharp the change
    there (a burst of queueing in the last seconds of a run, the drain after the load stops)."""
    n = np.nan_to_num(np.asarray(requests, dtype=float))
    before = np.concatenate([[0.0], np.cumsum(n)[:-1]])  # requests in the intervals before index k
    total = float(n.sum())
    need = cfg.min_requests_p99 if total >= 2 * cfg.min_requests_p99 else cfg.min_requests_p50
    if total < 2 * need:
        return None
    return (before >= need) & (total - before >= need)


def diagnose(
    source: Reader,
    window: TimeRange | None = None,
    baseline: TimeRange | None = None,
    config: DiagnosisConfig | None = None,
    without_rules: tuple[str, ...] = (),
    against_peers: tuple[Reader, str] | None = None,
) -> Diagnosis:
    """Diagnose `window` (everything stored when None) against `baseline` (found by a change point inside
    the window when None). Read-only; a handful of queries, each aggregated in ClickHouse.
    `without_rules`: causes whose rules are switched off (what the diagnosis says when a cause is not
    known to it: `unexplained`, never the closest wrong label). ValueError for an unknown cause.
    `against_peers`: (the fleet's reader, the instance `source` holds): when nothing regressed against the
    instance's own baseline, its latency is tested against its peers' (`fleet.peer_regressions`)."""
    cfg = config or DiagnosisConfig()
    unknown = sorted(set(without_rules) - set(RULE_CAUSES))
    if unknown:
        raise ValueError(f"unknown cause {', '.join(unknown)}; choose from {', '.join(RULE_CAUSES)}")
    asked = (window, baseline)
    found = F.bounds(source, window)
    if not found["requests"]:
        return Diagnosis(window, baseline, notes=("no requests in the window",), data={"requests": 0})
    if window is None:
        window = TimeRange(found["first_ns"] / 1e9, found["last_ns"] / 1e9 + 1e-3)
    span = window
    if baseline is not None:
        span = TimeRange(min(baseline.start, window.start), max(baseline.end, window.end))
    series = F.series(source, span, _interval(span, cfg))
    source_kind = "given"
    current = window
    intervals = None  # (first, split, end) interval indices when the sides are whole intervals
    if baseline is None:
        stop = stopped_at(source, window, cfg)
        # a silent instance's last interval stays in the baseline; else the symptoms' change point
        k = series.index_of(stop) + 1 if stop is not None else split_window(series, window, cfg)
        if k is None:
            note = "the window is too short to find a change point; give a baseline window"
            return Diagnosis(window, None, notes=(note,), data={"requests": found["requests"]})
        split = series.time_of(k)
        baseline, current, source_kind = (
            TimeRange(window.start, split),
            TimeRange(split, window.end),
            "change_point",
        )
        intervals = (series.index_of(window.start), k, len(series))
    facts = gather(source, baseline, current, series, cfg, intervals)
    regressions = tuple(detect(facts))
    if not regressions and against_peers is not None:
        regressions = tuple(peer_regressions(*against_peers, facts))
    facts = dataclasses.replace(facts, regressions=regressions, decomposition=decompose(facts))
    loc = localize(source, facts)
    facts = dataclasses.replace(facts, fleet=loc)
    scope_facts = _scope_facts(source, facts, loc, span, cfg) if loc.kind == "instances" else facts
    findings: list[Finding] = []
    lacking: list[NotEnoughData] = []
    if regressions or loc.lost:
        for rule in RULES:
            if rule.CAUSE in without_rules:
                continue
            out = rule.evaluate(scope_facts)
            if isinstance(out, Finding):
                findings.append(_scoped(out, loc, source, facts.window, cfg))
            elif isinstance(out, NotEnoughData):
                lacking.append(out)
    if not findings and not regressions and not loc.lost and len(loc.rows) > 1:
        alone = _instances_alone(source, *asked, cfg, without_rules, loc)
        if alone is not None:
            return alone
    findings.sort(key=lambda f: -f.confidence)
    notes = list(_untested(facts, cfg))
    if regressions and not findings:
        if explained := unexplained.load_explains(facts) or unexplained.host_explains(facts):
            notes.append(explained)
        else:
            notes.append(unexplained.NOTE)
            findings.append(unexplained.explain(facts))
    return Diagnosis(
        window=current,
        baseline=baseline,
        regressions=regressions,
        findings=tuple(findings),
        not_enough_data=tuple(lacking),
        decomposition=facts.decomposition,
        baseline_source=source_kind,
        data=_data(facts, span) | _histogram_percentiles(source, facts),
        notes=tuple(notes),
    )


def _untested(facts: F.Facts, cfg: DiagnosisConfig) -> Iterator[str]:
    """What the sample sizes left untested: a side with too few requests shows no regression, however
    large the change, and the diagnosis says so rather than stay silent."""
    n = min(num0(facts.req_baseline("requests")), num0(facts.req_current("requests")))
    if n < cfg.min_requests_p50:
        yield (
            f"{n:.0f} requests on the smaller side: under the {cfg.min_requests_p50} a side needs, no "
            f"latency percentile was tested; widen the window or give a baseline with more traffic"
        )
    elif n < cfg.min_requests_p99:
        yield (
            f"{n:.0f} requests on the smaller side: under the {cfg.min_requests_p99} a side needs, P99s and "
            f"goodput were not tested (medians were)"
        )


def _scope_facts(
    source: Reader, facts: F.Facts, loc: Localization, span: TimeRange, cfg: DiagnosisConfig
) -> F.Facts:
    """The rules' facts on the localized instances: the same two windows, their rows alone, compared
    with their own baseline (the fleet's facts when the subset shows no regression of its own)."""
    sub = ScopedReader(source, instances=list(loc.instances))
    series = F.series(sub, span, facts.series.interval_s)
    sub_facts = gather(sub, facts.baseline, facts.window, series, cfg)
    regressions = tuple(detect(sub_facts))
    if not regressions:
        return facts
    sub_facts = dataclasses.replace(sub_facts, regressions=regressions, fleet=loc)
    return dataclasses.replace(sub_facts, decomposition=decompose(sub_facts))


def _instances_alone(
    source: Reader,
    window: TimeRange | None,
    baseline: TimeRange | None,
    cfg: DiagnosisConfig,
    without_rules: tuple[str, ...],
    loc: Localization,
) -> Diagnosis | None:
    """The fleet's symptoms held, but one instance's may have regressed on its own, diluted in the fleet's
    average (one replica held to a third of the time while its peers, given the cores it left, sped up).
    The instances whose mean TTFT, TPOT or E2E rose by `localize_min_lift` over the fleet's two windows
    (one query for all of them, in `loc`), on their own or against their peers' means, are diagnosed
    alone, the `alone_max_instances` that rose most, at `alpha` over the number of instances (each with its
    own change point, and tested against its peers when its own baseline shows nothing: load the whole
    fleet shared can swing a baseline and place the fleet's change point elsewhere). A diagnosis scoped to
    the instances that regressed, or None when none did, or all did (then it is the fleet's)."""
    instances = sorted(loc.rows)
    rose = {n: max(_mean_lift(loc, n), _peer_lift(loc, n, instances)) for n in instances}
    floor = math.log1p(cfg.localize_min_lift)
    chosen = sorted((n for n in instances if rose[n] >= floor), key=lambda n: -rose[n])
    if not chosen:
        return None
    strict = dataclasses.replace(cfg, alpha=cfg.alpha / len(instances))
    alone = {
        n: diagnose(ScopedReader(source, instances=[n]), window, baseline, strict, without_rules, (source, n))
        for n in chosen[: cfg.alone_max_instances]
    }
    hit = {n: d for n, d in alone.items() if d.regressions}
    if not hit or len(hit) == len(instances):
        return None
    order = sorted(hit, key=lambda n: -max((f.confidence for f in hit[n].findings), default=0.0))
    findings = []
    routed = []  # instances whose regression a router's cause explains, fleet-wide
    for n in order:
        d = hit[n]
        if behind := _router_cause(source, d, cfg, without_rules):
            if behind.cause not in {f.cause for f in findings}:  # one router, one finding for its replicas
                findings.append(behind)
            routed.append(n)
            continue
        loc = Localization("instances", (n,), 1.0, d.regressions[0].family)
        cut = TimeRange(d.window.start, d.window.end) if d.window else window
        findings += [_scoped(dataclasses.replace(f, scope=None), loc, source, cut, cfg) for f in d.findings]
    findings.sort(key=lambda f: -f.confidence)
    worst = hit[order[0]]
    peers = [n for n in order if any(r.against == "peers" for r in hit[n].regressions)]
    note = (
        f"the fleet's symptoms held; {', '.join(order)} regressed on its own (diagnosed alone: "
        f"{len(alone)} of {len(instances)} instances, alpha {strict.alpha:g})"
        + (f"; {', '.join(peers)} against its peers in the same time blocks" if peers else "")
        + (f"; the fleet's router evidence in {', '.join(routed)}'s windows explains it" if routed else "")
    )
    notes = tuple(m for m in worst.notes if not (routed and m == unexplained.NOTE))
    return dataclasses.replace(worst, findings=tuple(findings), notes=(note, *notes))


# Causes of the router, seen in evidence that is the fleet's by nature (every replica's cache reuse, where
# shared prefixes and requests land), whose latency can surface on one replica before the fleet's; and what
# each looks like from that replica alone: scattered prompts bring it prefixes it never held (its distinct
# keys per request rise, as when the prompts change), a skewed router more arrivals.
ROUTER_LOOK_ALIKES = {
    "cache_affinity_lost": ("prefix_cache_miss", unexplained.CAUSE),
    "routing_imbalance": ("queueing_overload", unexplained.CAUSE),
}


def _router_cause(
    source: Reader, alone: Diagnosis, cfg: DiagnosisConfig, without_rules: tuple[str, ...]
) -> Finding | None:
    """The router's cause behind an instance's regression, when the instance alone shows only its look-
    alike or nothing a rule explains: the router's rules over the whole fleet's evidence, in the instance's
    two windows and with its symptoms. The fleet tells them apart (docs/diagnosis.md): the same prompts
    scattered keep the fleet's distinct keys per request; a router's skew keeps the fleet's arrivals. A dev
    fleet run: prefix aware -> round robin at a light load moved the cached share 48% -> 18% on every
    replica, and TTFT rose significantly only on the replica that had held the most reuse."""
    top = alone.findings[0].cause if alone.findings else unexplained.CAUSE
    wanted = [c for c, like in ROUTER_LOOK_ALIKES.items() if top in like and c not in without_rules]
    if not wanted or alone.baseline is None or alone.window is None:
        return None
    span = TimeRange(alone.baseline.start, alone.window.end)
    series = F.series(source, span, _interval(span, cfg))
    facts = dataclasses.replace(
        gather(source, alone.baseline, alone.window, series, cfg), regressions=alone.regressions
    )
    facts = dataclasses.replace(facts, decomposition=decompose(facts))
    facts = dataclasses.replace(facts, fleet=localize(source, facts))
    for rule in RULES:
        if rule.CAUSE in wanted:
            out = rule.evaluate(facts)
            if isinstance(out, Finding):
                return _scoped(out, facts.fleet, source, facts.window, cfg)
    return None


def _mean_lift(loc: Localization, instance: str) -> float:
    """The largest log ratio of an instance's current to baseline mean TTFT, TPOT and E2E (0 without)."""
    lifts = [0.0]
    for key in ("ttft_mean", "tpot_mean", "e2e_mean"):
        b, c = loc.side(instance, 0, key), loc.side(instance, 1, key)
        if b > 0 and c > 0:
            lifts.append(math.log(c / b))
    return max(lifts)


def _peer_lift(loc: Localization, instance: str, instances: list[str]) -> float:
    """The largest log ratio of an instance's current to baseline mean TTFT, TPOT and E2E over the same
    ratio of its peers' request-weighted means (0 without)."""
    lifts = [0.0]
    peers = [n for n in instances if n != instance]
    for key in ("ttft_mean", "tpot_mean", "e2e_mean"):
        b, c = loc.side(instance, 0, key), loc.side(instance, 1, key)
        pb, pc = (_weighted_mean(loc, peers, side, key) for side in (0, 1))
        if all(x > 0 for x in (b, c, pb, pc)):  # NaN (no requests on a side) fails
            lifts.append(math.log((c / b) / (pc / pb)))
    return max(lifts)


def _weighted_mean(loc: Localization, names: list[str], side: int, key: str) -> float:
    """The request-weighted mean of `key` over `names` on one side (NaN without requests)."""
    pairs = [(loc.side(n, side, "requests"), loc.side(n, side, key)) for n in names]
    pairs = [(w, x) for w, x in pairs if w > 0 and math.isfinite(x)]
    total = sum(w for w, _ in pairs)
    return sum(w * x for w, x in pairs) / total if total > 0 else math.nan


def _scoped(
    finding: Finding, loc: Localization, source: Reader, window: TimeRange, cfg: DiagnosisConfig
) -> Finding:
    """The finding with its scope; on a subset, with its step time against its healthy peers' at equal
    batch size in the same window."""
    if finding.scope is not None:
        return finding
    if loc.kind != "instances":
        return dataclasses.replace(finding, scope=loc.scope())
    ratio = peer_step_ratio(source, window, loc.instances)
    if not math.isfinite(ratio):
        return dataclasses.replace(finding, scope=loc.scope())
    summary = finding.summary
    if not 1 / cfg.min_ratio_p99 < ratio < cfg.min_ratio_p99:  # worth saying
        summary += f"; {', '.join(loc.instances)}'s step time at equal batch is {ratio:.1f}x its peers'"
    evidence = (*finding.evidence, Evidence("step_time_vs_peers_at_equal_batch", 1.0, ratio))
    return dataclasses.replace(finding, scope=loc.scope(), summary=summary, evidence=evidence)


def gather(
    source: Reader,
    baseline: TimeRange,
    current: TimeRange,
    series: F.Series,
    cfg: DiagnosisConfig,
    intervals: tuple[int, int, int] | None = None,
) -> F.Facts:
    """Run the per-side queries and assemble the Facts the rules read. With `intervals` (the sides are
    whole intervals of `series`), step sums come from the series' step frame instead of another pass."""
    req = F.request_sides(source, baseline, current)
    sample = F.request_sample(
        source, baseline, current, req[0].get("requests", 0), req[1].get("requests", 0), cfg.sample_per_side
    )
    frame = (series.steps, intervals) if intervals is not None and series.steps is not None else None
    steps, shape = F.step_sides(source, baseline, current, frame)
    engine = F.engine_sides(source, baseline, current)
    return F.Facts(current, baseline, req, sample, steps, shape, series, cfg, engine=engine)


def _histogram_percentiles(source: Reader, facts: F.Facts) -> dict[str, object]:
    """TTFT, ITL and E2E P50/P99 per side from the engines' scraped latency histograms (bucket
    interpolation), next to the request spans' own; {} without scraped samples."""
    if facts.engine is None:
        return {}
    out: dict[str, object] = {"source": "metrics"}
    for metric in ("ttft_s", "itl_s", "e2e_s"):
        sides = {
            label: histograms.percentiles(source, metric, side.start, side.end)
            for label, side in (("baseline", facts.baseline), ("current", facts.window))
        }
        if any(s["count"] > 0 for s in sides.values()):
            out[metric] = sides
    return {"histogram_percentiles": out} if len(out) > 1 else {}


def _data(facts: F.Facts, span: TimeRange) -> dict[str, object]:
    ttft_slo, tpot_slo = slo(facts)
    out: dict[str, object] = {
        "analysed": span.to_json(),
        "interval_s": facts.series.interval_s,
        "requests": {"baseline": facts.req_baseline("requests"), "current": facts.req_current("requests")},
        "steps": {"baseline": facts.step_baseline("steps"), "current": facts.step_current("steps")},
        "engine_samples": {
            "baseline": facts.metric_pair("samples")[0],
            "current": facts.metric_pair("samples")[1],
        },
        "engine_evidence": facts.evidence_source(),
        "slo": {"ttft_s": ttft_slo, "tpot_s": tpot_slo},
    }
    goodput = {}
    for label, sample, get in (
        ("baseline", facts.sample[0], facts.req_baseline),
        ("current", facts.sample[1], facts.req_current),
    ):
        met, n = slo_met(sample, ttft_slo, tpot_slo)
        goodput[label] = get("rate_rps") * met / n if n else math.nan
    out["goodput_rps"] = goodput
    return out
