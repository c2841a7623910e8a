"""The step frame: one pass over `steps` (queries.STEP_FRAME_*) grouped by a key (an interval of the series,
or a side) and by step shape (batch size, has prefill, has decode), each group as sums. The
step series, the per-side step aggregates and the per-side shape table are all sums over its rows, so a
diagnosis whose sides are whole intervals (the change point's) reads the 10M-row table once, not three
times. Quantiles cannot be summed: they come from one more pass (queries.STEP_SIDE_QUANTILES).

    key  batch_size has_prefill has_decode  weight_dtype steps duration_sum gap_sum ... (one row per group)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from collector.store import QueryResult

SHAPE_KEYS = ("batch_size", "has_prefill", "has_decode")
SHAPE_SUMS = ("steps", "duration_sum", "gap_sum", "bytes_sum", "cpu_sum", "cpu_wall_sum", "cpu_n")
COLUMNS = (
    *SHAPE_KEYS,
    "weight_dtype",
    *SHAPE_SUMS,
    "prefill_max",
    "preemptions",
    "kv_usage_sum",
    "kv_usage_n",
    "kv_blocks_total_sum",
    "chunked_sum",
    "max_num_seqs_sum",
    "max_num_seqs_max",
    "budget_sum",
    "budget_max",
    "tokens_sum",
    "waiting_sum",
    "load_sum",
    "load_n",
)


@dataclass(frozen=True, slots=True)
class StepFrame:
    """Rows of (key, shape) groups as columns; `key` is the interval index or the side (0/1)."""

    key: np.ndarray  # [R] int
    cols: dict[str, np.ndarray]  # name -> [R]; weight_dtype is an object array, the rest floats

    @classmethod
    def from_result(cls, result: QueryResult) -> StepFrame:
        """One query row per key, each column an array over that key's groups (the API's row cap counts
        keys, not groups), flattened to one row per group."""
        lengths = [len(row[1]) for row in result.rows]
        key = np.repeat(np.array([int(row[0]) for row in result.rows], dtype=np.int64), lengths)
        cols: dict[str, np.ndarray] = {}
        for name in COLUMNS:  # an empty answer may come without column names
            j = result.columns.index(name) if result.rows else -1
            values = [v for row in result.rows for v in row[j]]
            cols[name] = np.array(values, dtype=object if name == "weight_dtype" else float)
        return cls(key, cols)

    def series(self, m: int) -> dict[str, np.ndarray]:
        """Step series over intervals 0..m-1 (NaN, or "" for the dtype, where an interval has no step)."""
        ok = (self.key >= 0) & (self.key < m)
        idx, c = self.key[ok], {k: v[ok] for k, v in self.cols.items()}

        def total(x: np.ndarray) -> np.ndarray:
            return np.bincount(idx, weights=x.astype(float), minlength=m).astype(float)

        n = total(c["steps"])
        decode = c["has_decode"] > 0
        mixed_max = np.zeros(m)
        np.maximum.at(mixed_max, idx, np.where(decode, c["prefill_max"], 0.0))
        with np.errstate(invalid="ignore", divide="ignore"):
            out = {
                "steps": n,
                "step_mean": total(c["duration_sum"]) / n,
                "work_gap_mean": total(c["gap_sum"] * decode) / total(c["steps"] * decode),
                "batch_mean": total(c["batch_size"] * c["steps"]) / n,
                "preemptions": total(c["preemptions"]),
                "kv_usage": total(c["kv_usage_sum"]) / total(c["kv_usage_n"]),
                "chunked_share": total(c["chunked_sum"]) / n,
                "mixed_prefill_max": mixed_max,
                "bytes_mean": total(c["bytes_sum"]) / n,
                "kv_blocks_total_mean": total(c["kv_blocks_total_sum"]) / n,
                "max_num_seqs": total(c["max_num_seqs_sum"]) / n,
                "max_num_batched_tokens": total(c["budget_sum"]) / n,
                "waiting_mean": total(c["waiting_sum"]) / n,
                # the stepping thread's CPU time over its wall time: falls when it waits for a core
                "cpu_share": total(c["cpu_sum"]) / total(c["cpu_wall_sum"]),
                "host_load_1m": total(c["load_sum"]) / total(c["load_n"]),
            }
        empty = n == 0
        for v in out.values():
            v[empty] = np.nan
        dtypes = np.unique(c["weight_dtype"]) if len(idx) else np.array([], dtype=object)
        counts = np.array([total(c["steps"] * (c["weight_dtype"] == d)) for d in dtypes]).reshape(-1, m)
        top = dtypes[counts.argmax(axis=0)] if len(dtypes) else np.full(m, "", dtype=object)
        out["weight_dtype"] = np.where(empty, "", top).astype(object)
        return out

    def side(self, rows: np.ndarray) -> dict[str, Any]:
        """Step aggregates over the groups selected by the boolean mask `rows` ({} when they hold no step)."""
        c = {k: v[rows] for k, v in self.cols.items()}
        n = float(c["steps"].sum())
        if n == 0:
            return {}
        decode, prefill = c["has_decode"] > 0, c["has_prefill"] > 0
        decode_steps = float(c["steps"][decode].sum())
        work_gap = float(c["gap_sum"][decode].sum())
        kv_n = float(c["kv_usage_n"].sum())
        dtypes, inverse = np.unique(c["weight_dtype"], return_inverse=True)
        return {
            "steps": n,
            "busy_s": float(c["duration_sum"].sum()),
            "work_gap_s": work_gap,
            "idle_gap_s": float(c["gap_sum"][~decode].sum()),
            "decode_steps": decode_steps,
            "work_gap_mean": work_gap / decode_steps if decode_steps else np.nan,
            "step_mean": float(c["duration_sum"].sum()) / n,
            "batch_mean": float((c["batch_size"] * c["steps"]).sum()) / n,
            "preemptions": float(c["preemptions"].sum()),
            "kv_usage_mean": float(c["kv_usage_sum"].sum()) / kv_n if kv_n else np.nan,
            "kv_blocks_total_mean": float(c["kv_blocks_total_sum"].sum()) / n,
            "waiting_mean": float(c["waiting_sum"].sum()) / n,
            "chunked_share": float(c["chunked_sum"].sum()) / n,
            "mixed_steps": float(c["steps"][decode & prefill].sum()),
            "mixed_prefill_max": float(c["prefill_max"][decode].max(initial=0.0)),
            "weight_dtype_top": str(dtypes[np.bincount(inverse, weights=c["steps"]).argmax()]),
            "max_num_seqs_mean": float(c["max_num_seqs_sum"].sum()) / n,
            "max_num_seqs_max": float(c["max_num_seqs_max"].max()),
            # the token budget (0 where steps do not record it) and the tokens of the steps that carry a
            # prefill: a budget that binds is filled by them
            "max_num_batched_tokens_mean": float(c["budget_sum"].sum()) / n,
            "max_num_batched_tokens_max": float(c["budget_max"].max()),
            "prefill_step_tokens_mean": _ratio(
                float(c["tokens_sum"][prefill].sum()), float(c["steps"][prefill].sum())
            ),
            "cpu_share": _ratio(float(c["cpu_sum"].sum()), float(c["cpu_wall_sum"].sum())),
        }

    def shape(self, rows: np.ndarray, side: int) -> list[dict[str, float]]:
        """The shape table of one side: sums per (batch_size, has_prefill, has_decode), in that order."""
        c = {k: self.cols[k][rows] for k in SHAPE_KEYS + SHAPE_SUMS}
        code = c["batch_size"].astype(np.int64) * 4 + c["has_prefill"].astype(np.int64) * 2 + c["has_decode"]
        codes, inverse = np.unique(code.astype(np.int64), return_inverse=True)
        sums = {k: np.bincount(inverse, weights=c[k], minlength=len(codes)) for k in SHAPE_SUMS}
        return [
            {"side": float(side), "batch_size": float(code // 4), "has_prefill": float(code // 2 % 2)}
            | {"has_decode": float(code % 2)}
            | {k: float(sums[k][i]) for k in SHAPE_SUMS}
            for i, code in enumerate(codes)
        ]


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else np.nan
