"""What a fault did to the real system: before/after figures of one scenario run, from its store.

    stepscope scenario facts DIR        # or: measure(Path(DIR)) -> {"before": {...}, "after": {...}}

Read from the `requests` and `steps` tables (never from the load generator), split at the onset of
`truth.json` (a healthy run at half the duration), so docs/faults.md can say what each fault changed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from collector.client import open_reader
from collector.sqlfn import QUANTILE

_REQUESTS = f"""
SELECT count() AS requests,
       {QUANTILE}(0.5)(ttft_s) AS ttft_p50, {QUANTILE}(0.99)(ttft_s) AS ttft_p99,
       {QUANTILE}(0.5)(tpot_s) AS tpot_p50, {QUANTILE}(0.99)(tpot_s) AS tpot_p99,
       {QUANTILE}(0.99)(tpot_max_s) AS itl_max_p99,
       {QUANTILE}(0.99)(queue_s) AS queue_p99, avg(input_tokens) AS prompt_mean,
       sum(cached_tokens) / greatest(sum(input_tokens), 1) AS cached_share,
       sum(preemptions) AS preemptions, countIf(is_error = 1) AS errors,
       avg(rpc_delay_s) AS rpc_delay_mean, {QUANTILE}(0.99)(rpc_delay_max_s) AS rpc_delay_max_p99
FROM requests
WHERE time >= fromUnixTimestamp64Nano({{lo:Int64}}) AND time < fromUnixTimestamp64Nano({{hi:Int64}})
"""
_STEPS = f"""
SELECT count() AS steps, avg(batch_size) AS batch_mean, max(batch_size) AS batch_max,
       avg(duration_s) AS step_mean_s, {QUANTILE}(0.99)(duration_s) AS step_p99_s,
       {QUANTILE}(0.5)(gap_s) AS gap_p50_s, {QUANTILE}(0.99)(gap_s) AS gap_p99_s,
       max(prefill_tokens) AS prefill_tokens_max, sum(preemptions) AS step_preemptions,
       max(max_num_seqs) AS max_num_seqs, min(chunked_prefill) AS chunked_prefill_min,
       max(kv_blocks_total) AS kv_blocks_total_max, min(kv_blocks_total) AS kv_blocks_total_min,
       sum(prefix_hit_tokens) AS prefix_hit_tokens
FROM steps
WHERE time >= fromUnixTimestamp64Nano({{lo:Int64}}) AND time < fromUnixTimestamp64Nano({{hi:Int64}})
"""


def measure(run_dir: Path, url: str | None = None) -> dict[str, Any]:
    """Before/after figures of the run in `run_dir` (its store, or a collector serving it at `url`)."""
    truth = json.loads((run_dir / "truth.json").read_text())
    onset = truth["onset"] or (truth["start"] + truth["end"]) / 2
    reader = open_reader(url=url) if url else open_reader(store=truth["store"])
    try:
        out: dict[str, Any] = {"fault": truth["fault"], "value": truth["value"]}
        for name, lo, hi in (("before", truth["start"], onset), ("after", onset, truth["end"] + 60)):
            params = {"lo": int(lo * 1e9), "hi": int(hi * 1e9)}
            row: dict[str, Any] = {}
            for sql in (_REQUESTS, _STEPS):
                res = reader.query(sql, params)
                row |= {c: _round(v) for c, v in zip(res.columns, res.rows[0], strict=True)}
            out[name] = row
        return out
    finally:
        reader.close()


def _round(v: object) -> object:
    if isinstance(v, float):
        return None if v != v else round(v, 4)
    return v
