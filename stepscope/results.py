"""Result files of benchmarks and of `stepscope eval`: one dated JSON file per run under benchmarks/results/,
with the machine it ran on, its load before and after, and the arguments, so that figures can be compared
later and the docs can link the latest one instead of narrating past runs.

    load_before = os.getloadavg()
    ...                                                   # the run
    path = results.write("ingest", result, vars(args), load_before)
    # benchmarks/results/2026-12-01-b80bebe-ingest.json

`benchmarks/results.py` re-exports this module for the benchmark scripts.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The checkout's benchmarks/results/ (the working directory's when the package runs installed elsewhere).
DIRECTORY = (ROOT if (ROOT / "benchmarks").is_dir() else Path.cwd()) / "benchmarks" / "results"


def cpu_model() -> str:
    """The CPU's model name (Linux), else what the platform reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def short_commit() -> str:
    """`$STEPSCOPE_COMMIT` when set (a copy of the tree run on another machine), else the checkout's short
    commit hash, with `+dirty` when it has uncommitted changes; "unknown" outside git."""
    if os.environ.get("STEPSCOPE_COMMIT"):
        return os.environ["STEPSCOPE_COMMIT"]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{commit}+dirty" if dirty else commit


def machine() -> dict[str, Any]:
    """The machine a run measured: CPU model, logical cores, platform, Python."""
    return {
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def portable(value: Any) -> Any:
    """A path argument as its last component: a result file says which directory, not where one machine
    keeps it. Other values as they are."""
    if isinstance(value, Path) or (isinstance(value, str) and os.path.isabs(value)):
        return Path(value).name
    return value


def write(
    name: str,
    result: dict[str, Any],
    arguments: dict[str, Any],
    load_before: tuple[float, float, float],
    directory: Path = DIRECTORY,
) -> Path:
    """Write `result` as `<YYYY-MM-DD>-<short commit>-<name>.json` in `directory` (a later run the same day
    on the same commit replaces it); returns the path."""
    now = datetime.datetime.now(datetime.UTC)
    commit = short_commit()
    document = {
        "benchmark": name,
        "date": now.isoformat(timespec="seconds"),
        "commit": commit,
        "machine": machine(),
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "arguments": {k: portable(v) for k, v in arguments.items()},
        "result": result,
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{now:%Y-%m-%d}-{commit}-{name}.json"
    path.write_text(json.dumps(document, indent=2) + "\n")
    return path


write_result = write
