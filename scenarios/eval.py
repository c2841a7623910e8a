"""`stepscope eval`: run every fault scenario, diagnose each run, and score the diagnosis.

    stepscope eval --quick --out eval.json                  # one magnitude x one seed + 2 healthy runs
    stepscope eval --faults overload,scheduler_stall        # a subset, full grid (2 magnitudes x 3 seeds)

Each case is one `run_scenario` (scenarios/runner.py) in `--runs-dir/<case>/`, then two diagnoses of
its store: the headline one over the whole run window with no baseline (the change point must be found),
and one with the baseline given as [start, onset) (a healthy run: the first half). A case is correct when
the top finding names the injected cause; a healthy run counts as a false positive when it has any
finding. Cases whose `result.json` exists are skipped, so an interrupted eval resumes where it stopped.
Each diagnosis runs in a child process (chDB allows one data directory per process).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepscope.cli import UsageError

# The rule that should win for each injected fault (the queueing rule is named for what it sees).
EXPECTED_CAUSE = {"overload": "queueing_overload"}
QUICK_HEALTHY_RUNS, FULL_HEALTHY_RUNS = 2, 3
FULL_SEEDS = (1, 2, 3)
MAX_DURATION_S = 240  # the stretch for a slow (busy) machine stops here; the eval must end


@dataclass(frozen=True, slots=True)
class Case:
    """One scenario run of the grid."""

    fault: str | None
    value: float | None
    seed: int

    @property
    def name(self) -> str:
        value = "" if self.value is None else f"-{self.value:g}"
        return f"{self.fault or 'healthy'}{value}-s{self.seed}"

    @property
    def expected(self) -> str | None:
        return None if self.fault is None else EXPECTED_CAUSE.get(self.fault, self.fault)


def grid(faults: list[str], quick: bool) -> list[Case]:
    """Every fault x magnitudes x seeds, plus healthy runs (quick: default magnitude, one seed)."""
    from scenarios.faults import FAULTS

    seeds = FULL_SEEDS[:1] if quick else FULL_SEEDS
    cases = []
    for name in faults:
        f = FAULTS[name]
        values = (f.default,) if quick else tuple(dict.fromkeys(f.magnitudes))
        cases += [Case(name, v, s) for v in values for s in seeds]
    healthy = QUICK_HEALTHY_RUNS if quick else FULL_HEALTHY_RUNS
    return cases + [Case(None, None, 100 + i) for i in range(healthy)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `stepscope eval`."""
    parser.add_argument("--quick", action="store_true", help="one magnitude x one seed per fault, 2 healthy")
    parser.add_argument(
        "--out", default="eval.json", metavar="FILE", help="scoreboard JSON (default: %(default)s)"
    )
    parser.add_argument("--faults", metavar="A,B", help="only these faults (default: all)")
    parser.add_argument(
        "--runs-dir", default="/tmp/stepscope-eval", metavar="DIR",
        help="where each case's run directory goes (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--duration", default="80", metavar="SECONDS", help="per run (default: %(default)s)")
    parser.add_argument("--model", default="small", help="engine model (default: %(default)s)")
    parser.add_argument(
        "--capacity",
        choices=("per-eval", "per-case", "cached"),
        default="per-eval",
        help="when to probe the engine's capacity: once per engine and workload in this eval (default), "
        "before every case (a machine whose neighbours come and go), or from the 2 h file cache",
    )


def run(args: argparse.Namespace) -> int:
    """Run the grid, print the scoreboard, write the JSON."""
    from scenarios.config import ScenarioConfig
    from scenarios.faults import FAULTS

    faults = list(FAULTS) if not args.faults else [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        raise UsageError(f"--faults: unknown {', '.join(unknown)}; choose from {', '.join(FAULTS)}")
    try:
        duration = float(args.duration)
    except ValueError:
        raise UsageError(f"--duration: expected seconds, got {args.duration!r}") from None
    if duration < 10:
        raise UsageError("--duration: at least 10 seconds")
    runs_dir = Path(args.runs_dir).resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    base = ScenarioConfig(out=runs_dir / "calibrate", duration_s=duration, model=args.model)
    capacities = Capacities(args.capacity)
    cases = grid(faults, args.quick)
    results = []
    t0 = time.monotonic()
    interrupt_on_sigterm()
    for i, case in enumerate(cases, 1):
        print(f"eval: [{i}/{len(cases)}] {case.name} ({time.monotonic() - t0:.0f}s so far)", file=sys.stderr)
        results.append(run_case(case, runs_dir, base, capacities))
    board = scoreboard(results)
    board["config"] = {"quick": args.quick, "duration_s": duration, "model": args.model,
                       "capacity": args.capacity, "capacity_rps": capacities.measured,
                       "runs_dir": str(runs_dir), "wall_s": round(time.monotonic() - t0, 1)}  # fmt: skip
    Path(args.out).write_text(json.dumps(board, indent=2) + "\n")
    print(render(board))
    return 0


def interrupt_on_sigterm() -> None:
    """SIGTERM (and SIGINT, even if the launching shell ignored it) unwind as Ctrl-C does, through the
    `finally` that stops every process started."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)


class Capacities:
    """The engine's capacity for each case: probed once per engine and workload (`per-eval`), before
    every case (`per-case`), or read from calibrate's file cache (`cached`)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.measured: dict[str, float] = {}  # case name -> requests/s it ran against
        self._by_key: dict[str, float] = {}  # calibrate.cache_key -> requests/s (per-eval)

    def __call__(self, case: Case, cfg: Any) -> float:
        from scenarios.calibrate import cache_key, capacity, probe

        if self.mode == "cached":
            value = capacity(cfg)
        else:
            key = cache_key(cfg)
            value = self._by_key.get(key) if self.mode == "per-eval" else None
            if value is None:
                value = self._by_key[key] = probe(dataclasses.replace(cfg, out=cfg.out.parent / "calibrate"))
        self.measured[case.name] = value
        return value


def run_case(case: Case, runs_dir: Path, base: Any, capacities: Capacities) -> dict[str, Any]:
    """Run (unless done) and diagnose one case; the result is kept in `<case>/result.json`. The run is
    stretched until both sides of the onset get enough requests at the case's capacity."""
    import shutil

    from scenarios.config import fault_clients
    from scenarios.faults import min_duration_s
    from scenarios.runner import run_scenario

    out = runs_dir / case.name
    done = out / "result.json"
    if done.exists():
        return json.loads(done.read_text())
    if not (out / "truth.json").exists():
        shutil.rmtree(out, ignore_errors=True)  # a run cut short: start it again
        cfg = dataclasses.replace(base, out=out, fault=case.fault, value=case.value, seed=case.seed)
        try:
            cap = capacities(case, cfg)
            clients = fault_clients(cfg)  # a closed loop completes about its share of the full batch's rate
            share = cfg.load_fraction if clients is None else min(1.0, clients / cfg.max_num_seqs)
            needed = math.ceil(min_duration_s(share * cap))
            cfg.duration_s = min(max(cfg.duration_s, needed), MAX_DURATION_S)
            run_scenario(cfg, cap)
        except RuntimeError as e:  # a process that would not start: score it as missed, retry on resume
            return score_case(case, None, {"error": str(e)})
    result = score_case(case, out, _diagnose_in_child(out))
    done.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _diagnose_in_child(run_dir: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "scenarios.eval", str(run_dir)], capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-2000:]}
    return json.loads(proc.stdout)


def diagnose_run(run_dir: Path) -> dict[str, Any]:
    """Both diagnoses of one run: `{"no_baseline": Diagnosis JSON, "baseline": Diagnosis JSON}`."""
    from collector.client import open_reader
    from collector.timerange import TimeRange
    from diagnosis.pipeline import diagnose

    truth = json.loads((run_dir / "truth.json").read_text())
    start, end = truth["start"], truth["end"]
    split = truth["onset"] or (start + end) / 2
    source = open_reader(store=truth["store"])
    try:
        whole = diagnose(source, window=TimeRange(start, end))
        given = diagnose(source, window=TimeRange(split, end), baseline=TimeRange(start, split))
        return {"no_baseline": whole.to_json(), "baseline": given.to_json()}
    finally:
        source.close()


def score_case(case: Case, run_dir: Path | None, diagnoses: dict[str, Any]) -> dict[str, Any]:
    """One case's line of the scoreboard, for both modes (`run_dir` None: the run failed)."""
    truth = json.loads((run_dir / "truth.json").read_text()) if run_dir else {"onset": None}
    result: dict[str, Any] = {
        "case": case.name, "fault": case.fault, "value": case.value, "seed": case.seed,
        "expected": case.expected, "run_dir": str(run_dir or ""), "onset": truth["onset"],
        "requests_stored": truth.get("requests_stored"),
    }  # fmt: skip
    if "error" in diagnoses:
        result["error"] = diagnoses["error"]
    for mode in ("no_baseline", "baseline"):
        findings = diagnoses.get(mode, {}).get("findings", [])
        top = findings[0] if findings else None
        onset_error = None
        if top and top.get("onset") is not None and truth["onset"] is not None:
            onset_error = round(abs(top["onset"] - truth["onset"]), 2)
        result[mode] = {
            "predicted": top["cause"] if top else None,
            "confidence": top["confidence"] if top else None,
            "causes": [f["cause"] for f in findings],
            "regressions": [
                r.get("metric", r.get("name")) for r in diagnoses.get(mode, {}).get("regressions", [])
            ],
            "onset_error_s": onset_error,
            "correct": (top["cause"] if top else None) == case.expected,
        }
    result |= {k: result["no_baseline"][k] for k in ("predicted", "confidence", "onset_error_s", "correct")}
    return result


def scoreboard(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Top-1 accuracy over fault runs, findings on healthy runs, onset error, confusion; per mode."""
    board: dict[str, Any] = {}
    for mode in ("no_baseline", "baseline"):
        faulty = [r for r in results if r["fault"] is not None]
        healthy = [r for r in results if r["fault"] is None]
        errors = [
            r[mode]["onset_error_s"]
            for r in faulty
            if r[mode]["correct"] and r[mode]["onset_error_s"] is not None
        ]
        confusion: dict[str, dict[str, int]] = {}
        for r in results:
            row = confusion.setdefault(r["expected"] or "healthy", {})
            col = r[mode]["predicted"] or "none"
            row[col] = row.get(col, 0) + 1
        board[mode] = {
            "top1_accuracy": round(sum(r[mode]["correct"] for r in faulty) / len(faulty), 3)
            if faulty
            else None,
            "healthy_false_positives": sum(bool(r[mode]["causes"]) for r in healthy),
            "healthy_runs": len(healthy),
            "fault_runs": len(faulty),
            "mean_onset_error_s": round(sum(errors) / len(errors), 2) if errors else None,
            "confusion": confusion,
        }
    head = board["no_baseline"]  # the headline: what a user gets first, with no baseline to give
    return {
        "top1_accuracy": head["top1_accuracy"],
        "healthy_false_positives": head["healthy_false_positives"],
        "mean_onset_error_s": head["mean_onset_error_s"],
        "mode": "no_baseline",
        "top1_accuracy_by_mode": {mode: board[mode]["top1_accuracy"] for mode in board},
        "healthy_false_positives_by_mode": {mode: board[mode]["healthy_false_positives"] for mode in board},
        **board,
        "cases": results,
    }


def render(board: dict[str, Any]) -> str:
    """The confusion matrix and the headline figures, as text."""
    lines = []
    for mode in ("no_baseline", "baseline"):
        b = board[mode]
        conf = b["confusion"]
        cols = sorted({c for row in conf.values() for c in row})
        width = max([len(c) for c in cols] + [8])
        lines.append(f"\n{mode}: rows = injected, columns = top finding")
        lines.append(" " * 22 + " ".join(c[:width].rjust(width) for c in cols))
        for name, row in conf.items():
            lines.append(name[:22].ljust(22) + " ".join(str(row.get(c, "")).rjust(width) for c in cols))
        lines.append(
            f"top-1 accuracy {b['top1_accuracy']} over {b['fault_runs']} fault runs; findings on healthy "
            f"runs {b['healthy_false_positives']}/{b['healthy_runs']}; "
            f"mean onset error {b['mean_onset_error_s']} s"
        )
    lines.append(
        f"\ntop1_accuracy (headline, no baseline) {board['top1_accuracy']}; with the baseline given "
        f"{board['baseline']['top1_accuracy']}"
    )
    return "\n".join(lines)


if __name__ == "__main__":  # the child process of `_diagnose_in_child`
    print(json.dumps(diagnose_run(Path(sys.argv[1]))))
