"""Scoring the eval: one row per case from its diagnoses, and the summary of a set of rows.

A fault case is right (top-1) when the top finding names the expected cause, top-3 when one of the first
three does; a healthy run is a false positive when it has any finding. The onset error is |the top
finding's onset - the true onset| of the fault cases whose top finding is right. The headline figures
are the holdout split's, in the headline mode (no baseline given: the change point must be found);
`baseline_mode` has the same figures with the baseline given as [start, onset).
"""

from __future__ import annotations

import math
from typing import Any

from scenarios.protocol import SPLITS, Case, expected_scope

MODES = ("no_baseline", "baseline")
HEADLINE_MODE = "no_baseline"
TOP = 3


def score(case: Case, truth: dict[str, Any] | None, diagnoses: dict[str, Any]) -> dict[str, Any]:
    """One case's row (`truth` None: the run failed; `diagnoses` then holds its `error`)."""
    truth = truth or {}
    row: dict[str, Any] = {
        "case": case.name, "fault": case.fault, "workload": case.workload, "magnitude": case.value,
        "magnitude_index": case.index, "seed": case.seed, "split": case.split,
        "traffic_seed": case.run_seed,
        "onset_fraction": case.onset_fraction, "onset": truth.get("onset"),
        "load_fraction": case.load_fraction, "expected": case.expected, "without_rule": case.without_rule,
        "duration_s": truth.get("duration_s"), "requests_stored": truth.get("requests_stored"),
    }  # fmt: skip
    if "error" in diagnoses:
        row["error"] = diagnoses["error"]
    for mode in MODES:
        row[mode] = _score_mode(case, truth.get("onset"), diagnoses.get(mode, {}))
    head = row[HEADLINE_MODE]
    return (
        row
        | {k: head[k] for k in ("top3", "predicted", "confidence", "correct", "top3_correct")}
        | {
            "onset_error_s": head["onset_error_s"],
            "symptoms_regressed": head["symptoms_regressed"],
        }
    )


def _score_mode(case: Case, onset: float | None, diagnosis: dict[str, Any]) -> dict[str, Any]:
    findings = diagnosis.get("findings", [])
    top = findings[0] if findings else None
    onset_error = None
    if top and top.get("onset") is not None and onset is not None:
        onset_error = round(abs(top["onset"] - onset), 2)
    top3 = [{"cause": f["cause"], "confidence": f.get("confidence")} for f in findings[:TOP]]
    return {
        "top3": top3,
        "predicted": top["cause"] if top else None,
        "confidence": top.get("confidence") if top else None,
        "findings": len(findings),
        "scope": top.get("scope") if top else None,
        "correct": case.fault is not None
        and (top["cause"] if top else None) == case.expected
        and _scope_ok(case, top),
        "top3_correct": case.fault is not None and case.expected in [f["cause"] for f in top3],
        "onset_error_s": onset_error,
        "symptoms_regressed": [r.get("metric", r.get("name")) for r in diagnosis.get("regressions", [])],
    }


def _scope_ok(case: Case, top: dict[str, Any] | None) -> bool:
    """A fleet fault's top finding names where: the targeted instance alone, or the fleet."""
    kind = expected_scope(case.fault)
    if kind is None or top is None:
        return True
    scope = top.get("scope") or {}
    return scope.get("kind") == kind and (kind == "fleet" or len(scope.get("instances") or []) == 1)


def summarize(rows: list[dict[str, Any]], grid: str, **extra: Any) -> dict[str, Any]:
    """The summary of `rows`: the headline keys (holdout, no baseline) first, then per split and mode,
    healthy false positives per workload, the confusion matrix; `extra` (wall time, flags) is added.
    With `without_rule` in `extra` the cases are that cause's, its rule off, and the headline is the share
    that came out `unexplained` (`unexplained_dev`, `unexplained_holdout`) and what the others were named
    (`named_instead`): it is no scoreboard, so it has no top-1 or false-positive keys."""
    if extra.get("without_rule"):
        return _without_rule_summary(rows, grid, extra)
    head = _figures(rows, HEADLINE_MODE)
    healthy = [r for r in rows if r["fault"] is None and "error" not in r]
    by_workload: dict[str, dict[str, Any]] = {}
    for r in healthy:
        w = by_workload.setdefault(r["workload"], {"runs": 0, "false_positives": 0})
        w["runs"] += 1
        w["false_positives"] += bool(r[HEADLINE_MODE]["findings"])
    for w in by_workload.values():
        w["rate"] = round(w["false_positives"] / w["runs"], 3)
    return {
        "grid": grid,
        "mode": HEADLINE_MODE,
        "top1_dev": head["dev"]["top1"],
        "top1_holdout": head["holdout"]["top1"],
        "top3_dev": head["dev"]["top3"],
        "top3_holdout": head["holdout"]["top3"],
        "healthy_false_positives": sum(w["false_positives"] for w in by_workload.values()),
        "healthy_runs": len(healthy),
        "unexplained_rate": head["holdout"]["unexplained_rate"],
        "onset_error_p50_s": head["holdout"]["onset_error_p50_s"],
        "onset_error_p90_s": head["holdout"]["onset_error_p90_s"],
        "cases": len(rows),
        "fault_cases": sum(r["fault"] is not None for r in rows),
        "failed_runs": sum("error" in r for r in rows),
        **extra,
        "healthy_false_positives_by_workload": dict(sorted(by_workload.items())),
        "by_split": head,
        "baseline_mode": _figures(rows, "baseline"),
        "confusion": confusion(rows, HEADLINE_MODE),
        "confusion_by_split": {
            s: confusion([r for r in rows if r["split"] == s], HEADLINE_MODE) for s in SPLITS
        },
    }


def _without_rule_summary(rows: list[dict[str, Any]], grid: str, extra: dict[str, Any]) -> dict[str, Any]:
    head = _figures(rows, HEADLINE_MODE)
    return {
        "grid": grid,
        "mode": HEADLINE_MODE,
        "without_rule": extra["without_rule"],
        # `unexplained` anywhere: where a regression sits is not the question here
        "unexplained_dev": head["dev"]["unexplained_rate"],
        "unexplained_holdout": head["holdout"]["unexplained_rate"],
        "named_instead": {
            r["case"]: r[HEADLINE_MODE]["predicted"]
            for r in rows
            if r[HEADLINE_MODE]["predicted"] != "unexplained"
        },
        "cases": len(rows),
        "fault_cases": sum(r["fault"] is not None for r in rows),
        "failed_runs": sum("error" in r for r in rows),
        **extra,
        "by_split": head,
        "baseline_mode": _figures(rows, "baseline"),
        "confusion": confusion(rows, HEADLINE_MODE),
    }


def _figures(rows: list[dict[str, Any]], mode: str) -> dict[str, dict[str, Any]]:
    """Per split: top-1, top-3, unexplained rate and onset error of the fault cases; healthy findings."""
    out = {}
    for split in SPLITS:
        faulty = [r for r in rows if r["split"] == split and r["fault"] is not None]
        healthy = [r for r in rows if r["split"] == split and r["fault"] is None and "error" not in r]
        errors = sorted(
            r[mode]["onset_error_s"]
            for r in faulty
            if r[mode]["correct"] and r[mode]["onset_error_s"] is not None
        )
        out[split] = {
            "fault_cases": len(faulty),
            "top1": _share(sum(r[mode]["correct"] for r in faulty), len(faulty)),
            "top3": _share(sum(r[mode]["top3_correct"] for r in faulty), len(faulty)),
            "unexplained_rate": _share(
                sum(r[mode]["predicted"] == "unexplained" for r in faulty), len(faulty)
            ),
            "onset_error_p50_s": percentile(errors, 50),
            "onset_error_p90_s": percentile(errors, 90),
            "healthy_runs": len(healthy),
            "healthy_false_positives": sum(bool(r[mode]["findings"]) for r in healthy),
        }
    return out


def confusion(rows: list[dict[str, Any]], mode: str) -> dict[str, dict[str, int]]:
    """Rows: the expected cause (`healthy` for healthy runs); columns: the top finding (`none`)."""
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        cell = out.setdefault(r["expected"] or "healthy", {})
        col = r[mode]["predicted"] or "none"
        cell[col] = cell.get(col, 0) + 1
    return out


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile of `values`, linear between closest ranks (None when empty)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return round(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo), 2)


def _share(n: int, total: int) -> float | None:
    return round(n / total, 3) if total else None


def _merged_line(merged_from: dict[str, int]) -> list[str]:
    if not merged_from:
        return []
    files = ", ".join(f"{n} from {name}" for name, n in sorted(merged_from.items()))
    return ["", f"Rows merged from earlier sittings' result files (their stores are not here): {files}."]


def markdown(summary: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The summary and the rows as a Markdown page."""
    s = summary
    if s.get("without_rule"):
        return _without_rule_markdown(s, rows)
    lines = [
        f"# stepscope eval: {s['grid']} grid",
        "",
        (
            "Headline: the holdout split"
            if s["by_split"]["holdout"]["fault_cases"]
            else "No holdout cases: dev only"
        )
        + f", diagnosed with no baseline given. {s['cases']} cases "
        f"({s['fault_cases']} fault, {s['healthy_runs']} healthy, {s['failed_runs']} failed runs)"
        + (", re-diagnosed from stored runs" if s.get("rediagnosed") else "")
        + (f", wall time {s['wall_s'] / 60:.1f} min" if s.get("wall_s") is not None else "")
        + ".",
        *_merged_line(s.get("merged_from") or {}),
        "",
        "| figure | dev | holdout |",
        "|---|---|---|",
    ]
    figures = (
        ("top-1", "top1"), ("top-3", "top3"), ("unexplained", "unexplained_rate"),
        ("onset error P50 (s)", "onset_error_p50_s"), ("onset error P90 (s)", "onset_error_p90_s"),
        ("healthy runs with a finding", "healthy_false_positives"),
    )  # fmt: skip
    dev, hold = s["by_split"]["dev"], s["by_split"]["holdout"]
    lines += [f"| {label} | {_cell(dev[key])} | {_cell(hold[key])} |" for label, key in figures]
    b = s["baseline_mode"]
    lines += [
        "",
        f"With the baseline given: top-1 dev {_cell(b['dev']['top1'])}, "
        f"holdout {_cell(b['holdout']['top1'])}; healthy runs with a finding "
        f"{b['dev']['healthy_false_positives'] + b['holdout']['healthy_false_positives']}.",
        "",
        "## Healthy runs: false positives per workload",
        "",
        "| workload | runs | with a finding | rate |",
        "|---|---|---|---|",
        *(
            f"| {w} | {v['runs']} | {v['false_positives']} | {v['rate']} |"
            for w, v in s["healthy_false_positives_by_workload"].items()
        ),
        "",
        "## Confusion (rows: injected, columns: top finding)",
        "",
        *_matrix(s["confusion"]),
        "",
        "## Cases",
        "",
        "| case | split | magnitude | onset | load | expected | top 3 | onset error (s) | regressed "
        "| run (s) | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: r["case"]):
        top3 = ", ".join(f"{t['cause']} {_cell(t['confidence'])}" for t in r["top3"]) or "-"
        if "error" in r:
            top3 = "run failed"
        load = (r.get("loadavg") or {}).get("mean")
        lines.append(
            f"| {r['case']} | {r['split']} | {_cell(r['magnitude'])} | {_cell(r['onset_fraction'])} | "
            f"{_cell(r['load_fraction'])} | {r['expected'] or '-'} | {top3} | {_cell(r['onset_error_s'])} | "
            f"{', '.join(r['symptoms_regressed']) or '-'} | {_cell(r.get('run_s'))} | {_cell(load)} |"
        )
    return "\n".join(lines) + "\n"


def _without_rule_markdown(s: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        f"# stepscope eval: {s['grid']} grid, the cases of `{s['without_rule']}` with its rule off",
        "",
        f"Each should come out `unexplained`, not another cause. {s['fault_cases']} cases"
        + (", re-diagnosed from stored runs" if s.get("rediagnosed") else "")
        + f": `unexplained` in {_cell(s['unexplained_dev'])} of dev, {_cell(s['unexplained_holdout'])} of "
        "holdout.",
        "",
        "| case | split | top finding |",
        "|---|---|---|",
        *(
            f"| {r['case']} | {r['split']} | {r[HEADLINE_MODE]['predicted'] or 'none'} |"
            for r in sorted(rows, key=lambda r: r["case"])
        ),
    ]
    return "\n".join(lines) + "\n"


def _matrix(conf: dict[str, dict[str, int]]) -> list[str]:
    cols = sorted({c for row in conf.values() for c in row})
    if not cols:
        return ["(no cases)"]
    out = ["| injected | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, row in sorted(conf.items()):
        out.append(f"| {name} | " + " | ".join(str(row.get(c, "")) for c in cols) + " |")
    return out


def _cell(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)
