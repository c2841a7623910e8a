"""How long does `diagnose()` take on a big window? 1M requests and 10M engine steps (16 instances, or
`--instances N`, one hour)
are synthesized by ClickHouse itself (INSERT ... SELECT FROM numbers(), straight into `requests` and
`steps`) in an embedded chDB store, with a prefix-cache-miss fault from the middle on; then the window is
diagnosed without a baseline (change point, every query, every rule). Target: `seconds` <= 5.

    .venv/bin/python benchmarks/diagnosis_latency.py [--requests N] [--steps N] [--instances 16] [--runs 3]
                                                     [--compare-instances 256] [--dir DIR]

`--dir DIR` keeps the store (and reuses it when it already holds rows: no second insert). Prints a one-line
summary, then JSON as the last line: requests, step_rows, seconds (the diagnosis's wall time, best of
`--runs`), cpu_seconds (this process's CPU time during that run, chDB's threads included: the figure that
does not depend on what else the machine runs), the per-run lists, `phases` (wall and CPU seconds per query
of the run with the least CPU, by its name in diagnosis/queries.py, plus `python`: everything between the
queries), load_avg_1m (the machine's load when the runs ended), steps_parts, insert_seconds (the insert and
its merges are waited for before the runs: they run in this process), top_cause, fleet_seconds (the
instance comparison's queries). `--compare-instances N` diagnoses the same hour spread over N instances in
a fresh store as well: its figures go under `compared`, and `fleet_ratio` (target <= 2) is its wall
seconds over the first's, `fleet_cpu_ratio` the same in CPU seconds (what localization costs as a fleet
grows: 256 instances against 16).
The same goes to `benchmarks/results/<date>-<commit>-diagnosis_latency.json` with the CPU model, core count,
load average before and after, and the arguments (stepscope/results.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from collector.client import StoreReader
from collector.store import QueryResult, Store
from diagnosis import TimeRange, diagnose, queries
from stepscope import results

T0 = 1_760_000_000
SPAN_S = 3600

_U = "(cityHash64(number, {k}) / 18446744073709551615.0)"  # a uniform in [0, 1] per row and stream k

REQUESTS = f"""
INSERT INTO requests (time, end_time, trace_id, span_id, service, instance, role, model, request_id, ttft_s,
    tpot_s, tpot_max_s, e2e_s, queue_s, prefill_s, kv_transfer_s, decode_s, input_tokens, output_tokens,
    cached_tokens, prefix_key, finish_reason, rpc_delay_s, rpc_delay_max_s)
SELECT t, t + toIntervalMillisecond(toInt64(e2e * 1000)),
       hex(cityHash64(number, 9)), hex(cityHash64(number, 8)),
       'engine', concat('engine-', toString(number % {{instances:UInt64}})), 'colocated', 'small',
       toString(number),
       queue + prefill + 0.001, tpot, tpot * 3, queue + prefill + 0.001 + tpot * 63, queue, prefill, 0,
       tpot * 63, 480, 64, if(miss, 0, 448), if(miss, hex(number), 'sys0'), 'length', 0.0004, 0.002
FROM (
    SELECT number,
           fromUnixTimestamp64Nano(toInt64({T0}e9 + number * ({SPAN_S}e9 / {{n:UInt64}}))) AS t,
           number >= {{n:UInt64}} / 2 AND {_U.format(k=1)} < 0.6 AS miss,
           0.004 + 0.01 * {_U.format(k=2)} AS queue,
           (if(miss, 0.08, 0.015)) * (0.6 + 0.8 * {_U.format(k=3)}) AS prefill,
           0.013 * (0.8 + 0.4 * {_U.format(k=4)}) * if(number >= {{n:UInt64}} / 2, 1.15, 1.0) AS tpot,
           queue + prefill + 0.001 + tpot * 63 AS e2e
    FROM numbers({{n:UInt64}})
)
"""

STEPS = f"""
INSERT INTO steps (time, duration_s, service, instance, role, model, step_id, num_running, num_waiting,
    batch_size, prefill_tokens, decode_tokens, kv_blocks_used, kv_blocks_free, kv_blocks_total, preemptions,
    weight_dtype, kv_dtype, chunked_prefill, max_num_seqs, gap_s, bytes_read)
SELECT fromUnixTimestamp64Nano(toInt64({T0}e9 + number * ({SPAN_S}e9 / {{n:UInt64}}))),
       (0.0065 + 0.0012 * batch + 0.00012 * prefill) * (0.85 + 0.3 * {_U.format(k=5)}),
       'engine', concat('engine-', toString(number % {{instances:UInt64}})), 'colocated', 'small',
       intDiv(number, 16), batch, 0,
       batch, prefill, batch, 20 * batch, 4096 - 20 * batch, 4096, 0, 'int8', 'fp32', 1, 16,
       0.0004 * (0.5 + {_U.format(k=6)}), 34000000 + 4096 * 300 * batch
FROM (
    SELECT number, 1 + toUInt32(8 * {_U.format(k=7)}) AS batch,
           if({_U.format(k=8)} < if(number >= {{n:UInt64}} / 2, 0.5, 0.2), 256, 0) AS prefill
    FROM numbers({{n:UInt64}})
)
"""


_QUERY_NAMES = {sql: name for name, sql in vars(queries).items() if name.isupper() and isinstance(sql, str)}


class TimedSource(StoreReader):
    """A StoreReader that records wall and CPU seconds of every query, by its name in diagnosis.queries."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.phases: dict[str, list[float]] = {}

    def query(self, sql: str, params: dict[str, Any] | None = None) -> QueryResult:
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return super().query(sql, params)
        finally:
            spent = self.phases.setdefault(_QUERY_NAMES.get(sql, "other"), [0.0, 0.0])
            spent[0] += time.perf_counter() - start
            spent[1] += time.process_time() - cpu


def settle(store: Store, limit_s: float = 300.0) -> None:
    """Wait for the background merges of the insert: they run in this process, so their CPU would count
    as the diagnosis's (a store that has been running a while has merged its parts)."""
    deadline = time.monotonic() + limit_s
    while store.query("SELECT count() FROM system.merges").rows[0][0] and time.monotonic() < deadline:
        time.sleep(0.5)


def run_once(store: Store) -> tuple[float, float, dict[str, list[float]], Any]:
    """One diagnosis of the whole window: (wall s, CPU s, per-query [wall, CPU], result)."""
    source = TimedSource(store)
    start, cpu = time.perf_counter(), time.process_time()
    result = diagnose(source, window=TimeRange(T0, T0 + SPAN_S))
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    phases = dict(source.phases)
    phases["python"] = [
        seconds - sum(w for w, _ in phases.values()),
        cpu_seconds - sum(c for _, c in phases.values()),
    ]
    return seconds, cpu_seconds, {k: [round(w, 3), round(c, 3)] for k, (w, c) in phases.items()}, result


def measure(instances: int, args: argparse.Namespace, path: str | None) -> tuple[dict[str, Any], Any]:
    """Fill a store (or reuse `path`'s rows) with the hour spread over `instances`, diagnose it `--runs`
    times; (figures, the least-CPU run's result)."""
    path = path or tempfile.mkdtemp(prefix="stepscope-diag-bench-")
    insert_s = 0.0
    try:
        with Store.open(f"chdb://{path}") as store:
            if not store.query("SELECT count() FROM requests").rows[0][0]:
                start = time.perf_counter()
                store.command(REQUESTS, {"n": args.requests, "instances": instances})
                store.command(STEPS, {"n": args.steps, "instances": instances})
                insert_s = time.perf_counter() - start
            settle(store)
            counts = store.query(
                "SELECT (SELECT count() FROM requests), (SELECT count() FROM steps),"
                " (SELECT count() FROM system.parts WHERE active AND table = 'steps'),"
                " (SELECT uniqExact(instance) FROM requests)"
            ).rows[0]
            runs = [run_once(store) for _ in range(max(1, args.runs))]
    finally:
        if not args.dir:
            shutil.rmtree(path, ignore_errors=True)
    seconds = min(r[0] for r in runs)
    _, cpu_seconds, phases, result = min(runs, key=lambda r: r[1])
    out = {
        "instances": int(counts[3]),
        "requests": int(counts[0]),
        "step_rows": int(counts[1]),
        "seconds": round(seconds, 3),
        "cpu_seconds": round(cpu_seconds, 3),  # chDB runs in this process: its threads count here
        "seconds_runs": [round(r[0], 3) for r in runs],
        "cpu_seconds_runs": [round(r[1], 3) for r in runs],
        "phases": phases,
        # comparing instances over the two windows (diagnosis/fleet.py): its queries' wall seconds
        "fleet_seconds": round(sum(phases.get(k, [0.0])[0] for k in ("INSTANCE_SIDES", "PEER_STEPS")), 3),
        "load_avg_1m": round(os.getloadavg()[0], 1),
        "steps_parts": int(counts[2]),
        "insert_seconds": round(insert_s, 1),
        "top_cause": result.findings[0].cause if result.findings else None,
        "regressions": [r.metric for r in result.regressions],
    }
    return out, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=10_000_000)
    parser.add_argument("--instances", type=int, default=16, help="the rows spread over this many instances")
    parser.add_argument(
        "--compare-instances", type=int, metavar="N",
        help="also diagnose the same hour spread over N instances (a fresh store): `fleet_ratio`",
    )  # fmt: skip
    parser.add_argument("--runs", type=int, default=3, help="diagnoses of the same store; best is reported")
    parser.add_argument("--dir", help="chDB directory, kept (default: a temporary one, removed after)")
    args = parser.parse_args()
    if args.dir and args.compare_instances:
        parser.error("--dir holds one store: give it or --compare-instances, not both")
    load_before = os.getloadavg()
    out, _ = measure(args.instances, args, args.dir)
    summary = (
        f"diagnosed {out['requests']:,} requests, {out['step_rows']:,} steps over {out['instances']} "
        f"instances: {out['seconds']:.2f} s wall, {out['cpu_seconds']:.2f} CPU-s "
        f"(best of {len(out['seconds_runs'])}, load {out['load_avg_1m']}) ({out['top_cause']})"
    )
    if args.compare_instances:
        other, _ = measure(args.compare_instances, args, None)
        out["compared"] = other
        out["fleet_ratio"] = round(other["seconds"] / out["seconds"], 3)  # target: <= 2
        out["fleet_cpu_ratio"] = round(other["cpu_seconds"] / out["cpu_seconds"], 3)
        summary += (
            f"; over {other['instances']} instances {other['seconds']:.2f} s wall, "
            f"{other['cpu_seconds']:.2f} CPU-s: x{out['fleet_ratio']:.2f} wall, "
            f"x{out['fleet_cpu_ratio']:.2f} CPU ({other['top_cause']})"
        )
    print(summary)
    print(f"wrote {results.write('diagnosis_latency', out, vars(args), load_before)}", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
