"""An eval's directory: what `stepscope eval --out DIR` keeps, and reading it back for --resume and
--rediagnose.

    DIR/protocol.json            grid, duration and model: a later sitting must match it
    DIR/sittings.jsonl           one line per sitting: cases run, wall seconds, arguments, capacities
    DIR/runs/<case>/case.json    the case and its draws (`scenarios.protocol.Case`)
    DIR/runs/<case>/truth.json   the run (`scenarios.runner`); the directory is its chDB store
    DIR/runs/<case>/result.json  the case's row (`scenarios.scoring.score`); result-without-CAUSE.json too
                                 (a row merged from a result file has `merged_from` and no store)
    DIR/cases.jsonl, DIR/summary.json, DIR/summary.md   every row, and their summary
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from scenarios.protocol import Case
from stepscope.cli import UsageError


def claim(out: Path, protocol: dict[str, Any], resume: bool) -> None:
    """Make `out` this eval's directory: new, or (with --resume) one holding the same protocol."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out: {out} exists and is not a directory")
    held = read_protocol(out)
    if held is not None and not resume:
        raise UsageError(
            f"--out: {out} holds an eval already; add --resume to continue it, or choose a new one"
        )
    if held is not None and held != protocol:
        raise UsageError(f"--resume: {out} holds a different eval ({held}); this one is {protocol}")
    out.mkdir(parents=True, exist_ok=True)
    if held is None:
        (out / "protocol.json").write_text(json.dumps(protocol, indent=2) + "\n")


def read_protocol(out: Path) -> dict[str, Any] | None:
    """DIR/protocol.json, or None where there is no eval."""
    return read_json(out / "protocol.json")


def read_json(path: Path) -> Any:
    """A JSON file's value, or None when it is missing or unreadable (a run cut short)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def log_sitting(out: Path, sitting: dict[str, Any]) -> None:
    """Append one sitting to DIR/sittings.jsonl."""
    with (out / "sittings.jsonl").open("a") as f:
        f.write(json.dumps({"at": time.strftime("%Y-%m-%dT%H:%M:%S"), **sitting}) + "\n")


def sittings(out: Path) -> list[dict[str, Any]]:
    """Every sitting logged in DIR."""
    try:
        lines = (out / "sittings.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def stored_cases(out: Path) -> list[Case]:
    """The cases with a run directory in `out` (from each one's case.json), in name order."""
    cases = []
    for path in sorted((out / "runs").glob("*/case.json")):
        data = read_json(path)
        if isinstance(data, dict):
            cases.append(dataclasses.replace(Case.from_json(data), without_rule=None))
    return cases


def load_rows(out: Path, without_rule: str | None = None) -> list[dict[str, Any]]:
    """Every row in `out` (`result.json` of each run; `result-without-CAUSE.json` with `without_rule`)."""
    name = f"result-without-{without_rule}.json" if without_rule else "result.json"
    rows = [read_json(p) for p in sorted((out / "runs").glob(f"*/{name}"))]
    return [r for r in rows if isinstance(r, dict)]


def write_row(case: Case, run_dir: Path, row: dict[str, Any]) -> dict[str, Any]:
    """Keep `row` as the case's result file in its run directory."""
    (run_dir / case.result_file).write_text(json.dumps(row, indent=2) + "\n")
    return row


def merge_rows(out: Path, rows: list[dict[str, Any]], cases: dict[str, Case], source: dict[str, Any]) -> int:
    """Keep each of `rows` (checked against `cases` by `scenarios.eval`) as its case's row in `out`, marked
    with the file it came from; a case that has a row of its own keeps it. How many were merged."""
    merged = 0
    for row in rows:
        case = cases[row["case"]]
        run_dir = out / "runs" / case.name
        if read_json(run_dir / case.result_file) is not None:
            continue
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "case.json").write_text(json.dumps(case.to_json(), indent=2) + "\n")
        write_row(case, run_dir, {**row, "merged_from": source["file"], "scored_at": source["commit"]})
        merged += 1
    if merged:  # the source's sittings count once, however often it is named
        log_sitting(out, {"ran": 0, "merged": merged, "merged_from": source["file"],
                          "wall_s": source["wall_s"], "sittings": source["sittings"]})  # fmt: skip
    return merged
