"""`stepscope bench` results.json files (docs/loadgen.md, "Output"): found, read, checked, flattened.

Pure: no Streamlit. A file that is not a bench result raises `BenchFileError` with the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

_REQUIRED = ("steps", "knee", "load_kind")


class BenchFileError(ValueError):
    """Not a readable `stepscope bench` results.json."""


@dataclass(frozen=True, slots=True)
class BenchResults:
    """One results.json: where it came from and its parsed body."""

    source: str
    body: dict[str, Any]

    @property
    def load_kind(self) -> str:
        return str(self.body.get("load_kind", "load"))

    @property
    def load_unit(self) -> str:
        """The x-axis title for this run's loads."""
        return {"concurrency": "concurrency (requests in flight)", "rate": "offered rate (requests/s)"}.get(
            self.load_kind, self.load_kind
        )

    @property
    def knee(self) -> dict[str, Any]:
        return self.body.get("knee") or {}

    @property
    def slo(self) -> dict[str, Any]:
        return self.body.get("slo") or {}


def parse(text: str | bytes, source: str) -> BenchResults:
    """Read one results.json body; BenchFileError when it is not one."""
    try:
        body = json.loads(text)
    except ValueError as e:
        raise BenchFileError(f"{source} is not JSON: {e}") from None
    if not isinstance(body, dict) or any(k not in body for k in _REQUIRED):
        raise BenchFileError(
            f"{source} is not a `stepscope bench` results.json (needs {', '.join(_REQUIRED)})"
        )
    if not isinstance(body["steps"], list) or not body["steps"]:
        raise BenchFileError(f"{source} has no steps")
    return BenchResults(source, body)


def load(path: str | Path) -> BenchResults:
    """Read a results.json from disk."""
    p = Path(path)
    try:
        return parse(p.read_bytes(), str(p))
    except OSError as e:
        raise BenchFileError(f"cannot read {p}: {e.strerror or e}") from None


def find(directory: str | Path, limit: int = 200) -> list[Path]:
    """results files under `directory` (newest first): JSON files that parse as bench results."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    candidates = sorted(root.rglob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for p in candidates[:limit]:
        try:
            load(p)
        except BenchFileError:
            continue
        found.append(p)
    return found


def steps_frame(results: BenchResults) -> pd.DataFrame:
    """One row per step: load, throughputs, attainment, P50/P99 latencies in ms, cost."""
    rows = []
    for step in results.body["steps"]:
        row = {
            "load": step.get("load"),
            "completed": step.get("completed"),
            "error_rate": step.get("error_rate"),
            "requests_per_s": step.get("request_throughput_rps"),
            "goodput_per_s": step.get("goodput_rps"),
            "output_tokens_per_s": step.get("output_token_throughput_tps"),
            "slo_attainment": step.get("slo_attainment"),
            "cost_per_1k_requests": step.get("cost_per_1k_requests"),
        }
        for metric in ("ttft", "tpot", "e2e"):
            figures = step.get(f"{metric}_s") or {}
            for q in ("p50", "p99"):
                value = figures.get(q)
                row[f"{q}_{metric}_ms"] = None if value is None else value * 1000
        rows.append(row)
    return pd.DataFrame(rows)
