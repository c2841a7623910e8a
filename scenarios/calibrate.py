"""Size a scenario's load to this machine: measure the engine's capacity once, cache it.

The probe starts `stepscope serve` with the scenario's engine, traced into its own `stepscope collector` as
the run's engine is (a traced fleet of tiny replicas on two cores spends a large share of them on its
spans: an untraced probe overstated its capacity), runs the scenario's two
streams in a closed loop at `max_num_seqs` requests in flight for `PROBE_S` seconds (the batch kept
full: the engine's saturated throughput), and counts the requests completed after its first quarter
(the ramp while the batch fills).
Scenarios then run an open loop at a fraction of it. The result is cached in
`~/.cache/stepscope/capacity.json` under the model, the engine options, the workload version and the
host, for `CACHE_MAX_AGE_S`; `STEPSCOPE_CAPACITY_RPS` overrides it (a known value, or tests).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import socket
import time
from dataclasses import replace
from pathlib import Path

from loadgen.runner import LoadSpec, RunOptions, run_load
from scenarios.config import ScenarioConfig, fault_workload, workloads
from scenarios.procs import (
    COLLECTOR_START_S,
    harness_nice,
    isolate_harness,
    isolates,
    launch_collector,
    start_server,
    warm_up,
)
from stepscope.procs import Proc, free_port

PROBE_S = 20.0
WARM_SHARE = 0.25  # the probe's first quarter fills the batch; completions are counted after it
CACHE_MAX_AGE_S = 2 * 3600  # neighbours' load on a shared machine changes capacity several-fold
WORKLOAD_VERSION = 2  # bump when `scenarios.config.workloads` changes
PROBE_VERSION = 2  # bump when the probe's method changes (2: traced as the run is)
CACHE_FILE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "stepscope" / "capacity.json"
CAPACITY_ENV = "STEPSCOPE_CAPACITY_RPS"


def cache_key(cfg: ScenarioConfig) -> str:
    """What the capacity depends on: host, model and engine options, workload, the probe's method and what
    the run traces."""
    workload = sorted((k, str(v)) for k, v in fault_workload(cfg).items())  # a fault's own workload
    host, engine = [socket.gethostname(), os.cpu_count()], cfg.engine_args()
    isolated = isolates(cfg)
    return json.dumps(
        [*host, engine, WORKLOAD_VERSION, workload, PROBE_VERSION, cfg.step_spans, cfg.scrape, isolated]
    )


def capacity(cfg: ScenarioConfig, refresh: bool = False) -> float:
    """Completed requests/s of the scenario's engine and workload at a full batch (cached)."""
    if os.environ.get(CAPACITY_ENV):
        return float(os.environ[CAPACITY_ENV])
    key = cache_key(cfg)
    cache = _read_cache()
    hit = cache.get(key)
    if hit and not refresh and time.time() - hit["at"] < CACHE_MAX_AGE_S:
        return float(hit["capacity_rps"])
    value = probe(cfg)
    cache[key] = {"capacity_rps": value, "at": time.time()}
    CACHE_FILE.parent.mkdir(parents=True, exist_ok=True)
    CACHE_FILE.write_text(json.dumps(cache, indent=1))
    cfg.log(f"calibrate: cached in {CACHE_FILE} for {CACHE_MAX_AGE_S // 3600} h")
    return value


def probe(cfg: ScenarioConfig, duration_s: float = PROBE_S, traced: bool = True) -> float:
    """Measure the saturated throughput (requests/s) with a short closed-loop run, traced (and scraped)
    into a collector of its own as the run is (`traced=False`: the engine alone)."""
    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    cfg.log(f"calibrate: probing capacity for {duration_s:g}s{'' if traced else ', untraced'}")
    store = out / "calibrate-store"
    store.mkdir(exist_ok=True)
    procs: list[Proc] = []
    isolate = isolates(cfg)
    unpin = isolate_harness(isolate)  # as the run is: the collector on the harness cores, or niced
    try:
        otlp, port, collector = None, free_port(), None
        if traced:
            collector, otlp = launch_collector(
                store,
                out / "calibrate-collector.log",
                port if cfg.scrape else None,
                cfg.scrape_interval_s,
                nice=harness_nice(isolate),
            )
            procs.append(collector)
        server, url = start_server(cfg, out / "calibrate.log", secrets.token_hex(8), otlp, port)
        procs.append(server)
        if collector is not None:
            collector.wait_http(otlp + "/health", COLLECTOR_START_S)
        warm_up(url, cfg.model)  # a fresh process's first steps are slow: keep them out of the figure
        seqs = int(cfg.max_num_seqs) * cfg.replicas  # a fleet's batches all kept full
        c_shared = max(1, round(seqs * cfg.shared_fraction))
        mixed, shared = workloads(10_000 + int(cfg.seed), (), fault_workload(cfg))
        opts = RunOptions(model=cfg.model, drain_timeout_s=0.1, first_index=5_000_000)

        async def both() -> list:
            return await asyncio.gather(
                run_load(url, mixed, LoadSpec(concurrency=seqs - c_shared, duration_s=duration_s), opts),
                run_load(
                    url, shared, LoadSpec(concurrency=c_shared, duration_s=duration_s),
                    replace(opts, first_index=6_000_000),
                ),
            )  # fmt: skip

        results = asyncio.run(both())
    finally:
        for p in reversed(procs):
            p.stop()
        unpin()
        shutil.rmtree(store, ignore_errors=True)  # the probe's spans are nobody's evidence
    ends = [r.end_s for res in results for r in res.records if r.ok and r.end_s is not None]
    value = steady_rate(ends, duration_s)
    cfg.log(f"calibrate: {len(ends)} requests in {duration_s:g}s: capacity {value:.2f} requests/s")
    return value


def steady_rate(ends: list[float], duration_s: float, warm_share: float = WARM_SHARE) -> float:
    """Completions per second after the ramp: a closed loop that starts empty completes nothing for a
    request's latency, and counting from zero read 1-4 requests/s for the same engine (12 s probes)."""
    warm = duration_s * warm_share
    done = sum(1 for end in ends if warm <= end <= duration_s)
    return max(done / (duration_s - warm), 0.05)


def _read_cache() -> dict[str, dict[str, float]]:
    try:
        return json.loads(CACHE_FILE.read_text())
    except (OSError, ValueError):
        return {}
