"""`stepscope eval`: run the fault scenarios of a grid, diagnose each run, and score the diagnosis.

    stepscope eval --grid quick --out /tmp/eval-quick                   # one case per fault + 2 healthy runs
    stepscope eval --grid full --split holdout --out /tmp/eval          # the holdout half of the full grid
    stepscope eval --grid full --out /tmp/eval --resume                 # continue a partial grid, merge
    stepscope eval --only overload long_prompts --out /tmp/eval-two     # a subset (faults or causes)
    stepscope eval --rediagnose /tmp/eval                               # re-score stored runs, no rerun
    stepscope eval --split dev --out /tmp/eval-dev --merge RESULT.json  # + an earlier sitting's rows
    stepscope eval --without-rule compute_slowdown --out /tmp/eval-wr   # its cases: `unexplained`, no other

The grids, the splits and the draws are `scenarios.protocol`'s; the rows and the summary
`scenarios.scoring`'s; the directory's layout `scenarios.evaldir`'s. Each case is one `run_scenario` in
`DIR/runs/<case>/` (its `case.json`, `truth.json` and chDB store kept), then two diagnoses of its store in
a child process (chDB allows one data directory per process): the headline one over the whole run with
no baseline, and one with the baseline given as [start, onset). A case whose row (`result.json`) exists
is not run again. DIR also gets `cases.jsonl` (one row per case), `summary.json` and `summary.md` over
every row in DIR, so sittings merge; the summary goes to
`benchmarks/results/<date>-<commit>-eval-<grid>.json` as well (`stepscope.results`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from scenarios import evaldir
from scenarios.protocol import GRIDS, SPLITS, Case
from stepscope.cli import UsageError

MAX_DURATION_S = 240  # the stretch for a slow (busy) machine stops here; the eval must end
HEALTHY = "healthy"  # `--only healthy`: the healthy runs alone
LOAD_SAMPLE_S = 5.0  # how often the load average is sampled during a run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `stepscope eval`."""
    parser.add_argument("--grid", choices=GRIDS, default="full", help="the grid (default: %(default)s)")
    parser.add_argument(
        "--quick", dest="grid", action="store_const", const="quick", help="the same as --grid quick"
    )
    parser.add_argument(
        "--split", choices=(*SPLITS, "all"), default="all", help="the cases to run (default: %(default)s)"
    )
    parser.add_argument(
        "--only", nargs="+", metavar="CAUSE",
        help="only these faults (a fault's name or the cause it should produce), with the healthy runs "
        "under their workloads; `healthy`: only the healthy runs, under every workload; default: all",
    )  # fmt: skip
    parser.add_argument("--faults", metavar="A,B", help=argparse.SUPPRESS)  # the older spelling of --only
    parser.add_argument(
        "--out", metavar="DIR",
        help="the eval's directory: runs, rows, summary (default: /tmp/stepscope-eval-GRID)",
    )  # fmt: skip
    parser.add_argument("--resume", action="store_true", help="continue the grid in --out, merging rows")
    parser.add_argument(
        "--rediagnose", metavar="DIR", help="re-score the stored runs in DIR with the current rules, no rerun"
    )
    parser.add_argument(
        "--merge", metavar="RESULT_JSON", action="append", default=[],
        help="take the rows of an earlier sitting's result file of the same grid (another machine's or "
        "clone's: its stores stay there) into --out, then run the cases it lacks; repeatable",
    )  # fmt: skip
    parser.add_argument(
        "--without-rule", metavar="CAUSE",
        help="run the cases of CAUSE with its rule switched off: each must come out `unexplained`, not "
        "as another cause (no healthy runs)",
    )  # fmt: skip
    parser.add_argument(
        "--duration", metavar="SECONDS",
        help="per run, before a case's stretch to enough requests (default: quick 60, full 80)",
    )  # fmt: skip
    parser.add_argument("--model", default="small", help="engine model (default: %(default)s)")
    parser.add_argument(
        "--capacity",
        choices=("per-eval", "per-case", "cached"),
        default="per-eval",
        help="when to probe the engine's capacity: once per engine and workload in this eval (default), "
        "before every case (a machine whose neighbours come and go), or from the 2 h file cache",
    )
    parser.add_argument(
        "--results-dir", metavar="DIR", help="where the dated result file goes (default: benchmarks/results)"
    )


# -- choosing the cases ---------------------------------------------------------------------------
def select(args: argparse.Namespace) -> tuple[list[str], tuple[str, ...], bool]:
    """(faults, splits, healthy only) of the options; UsageError on bad input, before anything is written."""
    from scenarios.faults import FAULTS
    from scenarios.protocol import resolve_only

    names = list(args.only or [])
    if args.faults:
        names += [f.strip() for f in args.faults.split(",") if f.strip()]
    names = [n for raw in names for n in raw.split(",") if n]
    healthy_only = HEALTHY in names and all(n == HEALTHY for n in names)
    if HEALTHY in names and not healthy_only:
        raise UsageError("--only: `healthy` runs alone (the healthy runs of every workload)")
    names = [n for n in names if n != HEALTHY]
    try:
        faults = resolve_only(names) if names else list(FAULTS)
    except ValueError as e:
        raise UsageError(f"--only: {e}") from None
    splits = SPLITS if args.split == "all" else (args.split,)
    if args.grid == "quick" and "dev" not in splits:
        raise UsageError("--split holdout: the quick grid has dev cases only; use --grid full")
    if args.without_rule:
        check_rule(args.without_rule, faults, healthy_only)
    return faults, splits, healthy_only


def check_rule(cause: str, faults: list[str], healthy_only: bool) -> None:
    """UsageError unless `--without-rule CAUSE` names a rule's cause that one of `faults` injects."""
    from diagnosis import rules
    from scenarios.protocol import expected_cause

    known = rules.RULE_CAUSES
    if cause not in known:
        raise UsageError(f"--without-rule: unknown cause {cause!r}; choose from {', '.join(known)}")
    if healthy_only:
        raise UsageError("--without-rule runs fault cases; --only healthy has none")
    if not any(expected_cause(f) == cause for f in faults):
        raise UsageError(f"--without-rule: no fault of the chosen ones injects {cause}")


def without_rule_cases(cases: list[Case], cause: str) -> list[Case]:
    """The fault cases whose expected cause is `cause`, with its rule switched off (`check_rule` has made
    sure there are some)."""
    return [dataclasses.replace(c, without_rule=cause) for c in cases if c.fault and c.expected == cause]


# -- the command ----------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    """Run (or re-diagnose) the grid, write the rows and the summary, print the summary."""
    if args.rediagnose and args.merge:
        raise UsageError("--merge adds rows to a sitting; --rediagnose re-scores the stored runs alone")
    if args.rediagnose:
        return rediagnose(Path(args.rediagnose), args)
    from scenarios.config import ScenarioConfig
    from scenarios.protocol import PROTOCOL_VERSION, grid

    faults, splits, healthy_only = select(args)
    duration = _duration(args.duration or str(DEFAULT_DURATION_S[args.grid]))
    out = Path(args.out or f"/tmp/stepscope-eval-{args.grid}").resolve()
    protocol = {"grid": args.grid, "duration_s": duration, "model": args.model, "protocol": PROTOCOL_VERSION}
    merges = [read_merge(Path(p), protocol) for p in args.merge]
    if merges and args.without_rule:
        raise UsageError("--merge takes a grid's own rows; --without-rule runs have none to merge")
    evaldir.claim(out, protocol, args.resume or bool(merges))
    for rows, cases_by_name, source in merges:
        n = evaldir.merge_rows(out, rows, cases_by_name, source)
        print(f"eval: merged {n} of {len(rows)} rows from {source['file']} (scored at {source['commit']})",
              file=sys.stderr)  # fmt: skip
    cases = grid(faults, args.grid, splits)
    if healthy_only:
        cases = [c for c in cases if c.fault is None]
    if args.without_rule:
        cases = without_rule_cases(cases, args.without_rule)
    base = ScenarioConfig(out=out / "calibrate", duration_s=duration, model=args.model)
    capacities = Capacities(args.capacity)
    load_before = os.getloadavg()
    t0 = time.monotonic()
    interrupt_on_sigterm()
    ran = 0
    print(f"eval: {args.grid} grid, {len(cases)} cases in {out}", file=sys.stderr)
    try:
        for i, case in enumerate(cases, 1):
            row = evaldir.read_json(out / "runs" / case.name / case.result_file)
            if isinstance(row, dict) and "error" not in row:
                continue  # done in an earlier sitting (a failed run is tried again)
            print(
                f"eval: [{i}/{len(cases)}] {case.name} ({time.monotonic() - t0:.0f}s so far)", file=sys.stderr
            )
            run_case(case, out / "runs", base, capacities)
            ran += 1
    finally:  # an interrupted sitting counts its time too; --resume continues it
        evaldir.log_sitting(out, {"ran": ran, "wall_s": round(time.monotonic() - t0, 1),
                           "arguments": _arguments(args), "capacity_rps": capacities.measured})  # fmt: skip
    if args.resume and ran < len(cases):
        print(f"eval: resumed in {out}: {len(cases) - ran} of {len(cases)} cases were done", file=sys.stderr)
    return finish(out, args, load_before, args.without_rule)


def read_merge(
    path: Path, protocol: dict[str, Any]
) -> tuple[list[dict[str, Any]], dict[str, Case], dict[str, Any]]:
    """The rows of an eval result file for --merge, each checked against the grid's case of its name (the
    same draws: magnitude, onset, load and traffic seed) and the file against `protocol`; UsageError
    before anything is written."""
    from scenarios.faults import FAULTS
    from scenarios.protocol import grid

    document = evaldir.read_json(path)
    result = document.get("result") if isinstance(document, dict) else None
    if not isinstance(result, dict) or not isinstance(result.get("rows"), list):
        raise UsageError(f"--merge: {path} is not an eval result file (no result rows)")
    held = {"grid": result.get("grid"), "duration_s": result.get("duration_s"), "model": result.get("model")}
    if held != {k: protocol[k] for k in held}:
        raise UsageError(f"--merge: {path} is another eval ({held}); this one is {protocol}")
    if result.get("without_rule"):
        raise UsageError(f"--merge: {path} holds --without-rule rows, not the grid's own")
    cases = {c.name: c for c in grid(list(FAULTS), protocol["grid"], SPLITS)}
    for row in result["rows"]:
        case = cases.get(row.get("case")) if isinstance(row, dict) else None
        if case is None or not _same_draws(case, row):
            name = row.get("case") if isinstance(row, dict) else row
            raise UsageError(f"--merge: {path}: row {name!r} is not a case of this grid as drawn now")
    rows = [r for r in result["rows"] if "error" not in r]
    source = {
        "file": path.name,
        "commit": str(document.get("commit")),
        "wall_s": float(result.get("wall_s") or 0.0),
        "sittings": int(result.get("sittings") or 1),
    }
    return rows, cases, source


def _same_draws(case: Case, row: dict[str, Any]) -> bool:
    return (
        row.get("magnitude") == case.value
        and row.get("onset_fraction") == case.onset_fraction
        and row.get("load_fraction") == case.load_fraction
        and row.get("traffic_seed") == case.run_seed
        and row.get("workload") == case.workload
    )


def rediagnose(out: Path, args: argparse.Namespace) -> int:
    """Re-score every stored run in `out` (or only --without-rule's cases) with the current rules."""
    load_before = os.getloadavg()
    protocol = evaldir.read_protocol(out)
    if protocol is None:
        raise UsageError(f"--rediagnose: {out} holds no eval (no protocol.json)")
    interrupt_on_sigterm()
    cases = evaldir.stored_cases(out)
    if args.without_rule:
        check_rule(args.without_rule, sorted({c.fault for c in cases if c.fault}), healthy_only=False)
        cases = without_rule_cases(cases, args.without_rule)
    n = 0
    for case in cases:
        run_dir = out / "runs" / case.name
        if not (run_dir / "truth.json").exists():
            continue
        old = evaldir.read_json(run_dir / case.result_file) or {}
        row = score_run(case, run_dir, {k: old[k] for k in ("run_s", "loadavg") if k in old})
        row["rediagnosed"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        evaldir.write_row(case, run_dir, row)
        n += 1
    print(
        f"eval: re-diagnosed {n} stored runs in {out} with the current rules (no run repeated)",
        file=sys.stderr,
    )
    args.grid = protocol["grid"]
    return finish(out, args, load_before, args.without_rule, rediagnosed=True)


def finish(
    out: Path, args: argparse.Namespace, load_before: tuple[float, float, float], without_rule: str | None,
    rediagnosed: bool = False,
) -> int:  # fmt: skip
    """Summarize every row in `out`, write cases.jsonl, summary.json/.md and the dated result; print."""
    from scenarios.faults import FAULTS
    from scenarios.protocol import grid
    from scenarios.scoring import markdown, summarize
    from stepscope import results

    protocol = evaldir.read_protocol(out) or {}
    rows = evaldir.load_rows(out, without_rule)
    wanted = grid(list(FAULTS), protocol.get("grid", args.grid), SPLITS)
    if without_rule:
        wanted = [
            dataclasses.replace(c, without_rule=without_rule) for c in wanted if c.expected == without_rule
        ]
    have = {r["case"] for r in rows}
    sittings = evaldir.sittings(out)
    summary = summarize(
        rows,
        protocol.get("grid", args.grid),
        complete=all(c.name in have for c in wanted),
        rediagnosed=rediagnosed,
        without_rule=without_rule,
        wall_s=round(sum(s.get("wall_s", 0.0) for s in sittings), 1),
        run_s=round(sum(r.get("run_s") or 0.0 for r in rows), 1),
        sittings=sum(int(s.get("sittings", 1)) for s in sittings if s.get("ran") or s.get("merged")),
        merged_from=_merged_from(rows),
        duration_s=protocol.get("duration_s"),
        model=protocol.get("model"),
        out=str(out),
    )
    suffix = f"-without-{without_rule}" if without_rule else ""
    (out / f"cases{suffix}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / f"summary{suffix}.json").write_text(json.dumps(summary, indent=2) + "\n")
    page = markdown(summary, rows)
    (out / f"summary{suffix}.md").write_text(page)
    name = f"eval-{summary['grid']}{'' if summary['complete'] else '-partial'}{suffix}"
    name += "-rediagnosed" if rediagnosed else ""
    directory = Path(args.results_dir) if getattr(args, "results_dir", None) else results.DIRECTORY
    document = {**summary, "out": results.portable(summary["out"]), "rows": rows}
    path = results.write(name, document, _arguments(args), load_before, directory)
    print(page)
    print(f"eval: {len(rows)} rows; {out}/summary{suffix}.json, {path}", file=sys.stderr)
    return 0


def _merged_from(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Rows taken from other sittings' result files (--merge), counted by file."""
    return dict(Counter(r["merged_from"] for r in rows if r.get("merged_from")))


def _arguments(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k != "command" and not callable(v)}


# Seconds per run unless --duration says otherwise. The quick grid is the smoke run of every fault (20
# cases within 30 minutes on 2 cores); the full grid's longer runs give its tests more requests a side.
DEFAULT_DURATION_S = {"quick": 60, "full": 80}


def _duration(raw: str) -> float:
    try:
        duration = float(raw)
    except ValueError:
        raise UsageError(f"--duration: expected seconds, got {raw!r}") from None
    if duration < 10:
        raise UsageError("--duration: at least 10 seconds")
    return duration


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


# -- one case -------------------------------------------------------------------------------------
def case_config(case: Case, base: Any, out: Path) -> Any:
    """The `ScenarioConfig` of `case` over the eval's `base`."""
    from scenarios.protocol import DEFAULT_WORKLOAD, FLEET, is_fleet

    changes: dict[str, Any] = {
        "out": out, "fault": case.fault, "value": case.value, "seed": case.run_seed,
        "onset_fraction": case.onset_fraction,
        "workload_of": None if case.fault or case.workload == DEFAULT_WORKLOAD else case.workload,
    }  # fmt: skip
    if case.load_fraction is not None:
        changes["load_fraction"] = case.load_fraction
    if is_fleet(case.fault) or (case.fault is None and is_fleet(case.workload)):
        changes |= FLEET  # a fleet fault's healthy runs: the same fleet, no switch
    return dataclasses.replace(base, **changes)


def run_case(case: Case, runs_dir: Path, base: Any, capacities: Capacities) -> dict[str, Any]:
    """Run (unless its run is stored) and diagnose one case; its row goes to `<case>/result.json`. The run
    is stretched until both sides of the onset get enough requests at the case's capacity."""
    import shutil

    from scenarios.config import fault_clients
    from scenarios.faults import min_duration_s
    from scenarios.runner import run_scenario

    out = runs_dir / case.name
    measured: dict[str, Any] = {}
    if not (out / "truth.json").exists():
        shutil.rmtree(out, ignore_errors=True)  # a run cut short: start it again
        out.mkdir(parents=True)
        (out / "case.json").write_text(
            json.dumps(dataclasses.replace(case, without_rule=None).to_json()) + "\n"
        )
        cfg = case_config(case, base, out)
        try:
            cap = capacities(case, cfg)
            clients = fault_clients(cfg)  # a closed loop completes about its share of the full batch's rate
            share = cfg.load_fraction if clients is None else min(1.0, clients / cfg.max_num_seqs)
            needed = math.ceil(min_duration_s(share * cap, case.onset_fraction))
            cfg.duration_s = min(max(cfg.duration_s, needed), MAX_DURATION_S)
            with LoadSampler() as load:
                t0 = time.monotonic()
                run_scenario(cfg, cap)
            measured = {"run_s": round(time.monotonic() - t0, 1), "loadavg": load.figures()}
        except RuntimeError as e:  # a process that would not start: a missed case, run again on resume
            from scenarios.scoring import score

            return evaldir.write_row(case, out, score(case, None, {"error": str(e)}))
    return evaldir.write_row(case, out, score_run(case, out, measured))


def score_run(case: Case, run_dir: Path, measured: dict[str, Any]) -> dict[str, Any]:
    """Diagnose a stored run and score it (`measured`: run seconds and load average, kept in the row)."""
    from scenarios.scoring import score

    truth = json.loads((run_dir / "truth.json").read_text())
    t0 = time.monotonic()
    row = score(case, truth, _diagnose_in_child(run_dir, case.without_rule))
    if "loadavg" not in measured and truth.get("loadavg_1m"):
        measured = {**measured, "loadavg": truth["loadavg_1m"]}
    return row | {"run_s": measured.get("run_s"), "loadavg": measured.get("loadavg"),
                  "diagnose_s": round(time.monotonic() - t0, 1)}  # fmt: skip


class LoadSampler:
    """The 1-minute load average sampled every `LOAD_SAMPLE_S` in a thread while a run goes on."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            self.samples.append(os.getloadavg()[0])
            if self._stop.wait(LOAD_SAMPLE_S):
                return

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])

    def figures(self) -> dict[str, float]:
        s = self.samples
        return {"start": round(s[0], 2), "end": round(s[-1], 2), "mean": round(sum(s) / len(s), 2),
                "max": round(max(s), 2)}  # fmt: skip


def _diagnose_in_child(run_dir: Path, without_rule: str | None = None) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "scenarios.eval", str(run_dir), *([without_rule] if without_rule else [])],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-2000:]}
    return json.loads(proc.stdout)


def diagnose_run(run_dir: Path, without_rule: str | None = None) -> dict[str, Any]:
    """Both diagnoses of one run: `{"no_baseline": Diagnosis JSON, "baseline": Diagnosis JSON}`, with the
    rule of cause `without_rule` switched off when given. The baseline mode splits at the true onset (a
    healthy run: at its case's onset fraction)."""
    from collector.client import open_reader
    from collector.timerange import TimeRange
    from diagnosis.pipeline import diagnose

    truth = json.loads((run_dir / "truth.json").read_text())
    case = evaldir.read_json(run_dir / "case.json") or {}
    start, end = truth["start"], truth["end"]
    split = truth["onset"] or start + (end - start) * float(case.get("onset_fraction", 0.5))
    off = {"without_rules": (without_rule,)} if without_rule else {}
    source = open_reader(store=truth["store"])
    try:
        whole = diagnose(source, window=TimeRange(start, end), **off)
        given = diagnose(source, window=TimeRange(split, end), baseline=TimeRange(start, split), **off)
        return {"no_baseline": whole.to_json(), "baseline": given.to_json()}
    finally:
        source.close()


if __name__ == "__main__":  # the child process of `_diagnose_in_child`
    print(json.dumps(diagnose_run(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)))
