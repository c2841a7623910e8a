"""Fault scenarios: a real engine, a real collector and the load generator, with one fault switched on.

    cfg = ScenarioConfig(out=Path("/tmp/run"), fault="overload", value=3.0, duration_s=80, seed=1)
    truth = run_scenario(cfg)          # DIR/truth.json; DIR itself is the chDB store holding the spans

Timeline: collector and `stepscope serve` start as subprocesses (each in its own session, so a Ctrl-C
here stops them through our own `finally`), two warm-up requests, then `start`; the load generator
runs a steady mixed workload below the knee; at `onset` the fault goes on (a workload shift from
that second, an `/admin/limits` change, or an `/admin/faults` change); at `start + duration`
issuing stops and requests in flight drain; the server is stopped (its telemetry flushes), the
collector's `requests` count is polled until it stops growing, the collector is stopped.

Each fault changes the real system; none writes a span, a timing or an attribute (docs/faults.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx

from loadgen.runner import RunOptions, RunResult, run_load
from loadgen.workloads import WorkloadShift
from scenarios import fleet
from scenarios.calibrate import capacity
from scenarios.config import ScenarioConfig, fault_clients, fault_workload, load_specs, workloads
from scenarios.faults import FAULTS, MIN_REQUESTS_PER_SIDE, Fault, min_duration_s
from scenarios.procs import (
    COLLECTOR_START_S,
    Proc,
    engine_cores,
    harness_nice,
    isolate_harness,
    isolates,
    launch_collector,
    start_neighbours,
    start_server,
    stop_neighbours,
    wait_flushed,
    warm_up,
)
from stepscope.procs import free_port

Undo = Callable[[], None]


# -- the run --------------------------------------------------------------------------------------
async def _admin(url: str, path: str, token: str, body: dict[str, object] | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
        r = await (
            client.get(url + path, headers=headers)
            if body is None
            else client.post(url + path, json=body, headers=headers)
        )
    if r.status_code != 200:
        raise RuntimeError(f"{path} refused {body}: {r.status_code} {r.text[:300]}")
    return r.json()


def _fleet_fault(cfg: ScenarioConfig, fault: Fault, url: str, token: str, undo: list[Undo]) -> None:
    """A fleet fault on replica `cfg.fault_instance`: the router's own faults, or a process action."""
    replica = fleet.replica_ids(url)[cfg.fault_instance]
    if fault.router is not None:
        body = fault.router(cfg.value or 0.0) | {"instance": replica["instance"]}
        cfg.log(f"scenario: onset: router /admin/faults {body}")
        asyncio.run(_admin(url, "/admin/faults", token, body))
    if fault.action == "kill":
        cfg.log(f"scenario: onset: killing replica {replica['instance']} (pid {replica['pid']})")
        fleet.kill_replica(replica)
    if fault.action == "throttle":
        pids = fleet.tree(int(replica["pid"]))
        share = f"1/{cfg.value:g}"
        cfg.log(f"scenario: onset: replica {replica['instance']} (pids {pids}) held to {share} of the time")
        undo.append(fleet.Throttle(pids, cfg.value or 0.0).start().stop)


def undo_all(undo: list[Undo]) -> None:
    """Take back what the fault started (busy processes, a throttle), latest first."""
    while undo:
        undo.pop()()


async def _switch_at(
    cfg: ScenarioConfig, url: str, token: str, t0: float, stop: asyncio.Event, undo: list[Undo]
) -> float | None:
    """At the onset, apply the fault's limits or engine faults; returns the unix time it went on."""
    fault = FAULTS[cfg.fault] if cfg.fault else None
    if fault is None:
        return None
    delay = cfg.onset - (time.perf_counter() - t0)
    if delay > 0:
        try:
            await asyncio.wait_for(stop.wait(), delay)
            return None  # stopped before the onset
        except TimeoutError:
            pass
    onset = time.time()
    if fault.limits is not None:
        current = await _admin(url, "/admin/limits", token)
        changes = fault.limits(cfg.value or 0.0, current)
        cfg.log(f"scenario: onset: /admin/limits {changes}")
        await _admin(url, "/admin/limits", token, changes)
    if fault.engine is not None:
        body = fault.engine(cfg.value or 0.0)
        cfg.log(f"scenario: onset: /admin/faults {body}")
        await _admin(url, "/admin/faults", token, body)
    if fault.neighbours is not None:
        n = fault.neighbours(cfg.value or 0.0)
        cfg.log(f"scenario: onset: {n} busy processes on the engine's cores")
        busy = start_neighbours(n, engine_cores() if isolates(cfg) else None)
        undo.append(lambda: stop_neighbours(busy))
    if fault.fleet:
        await asyncio.to_thread(_fleet_fault, cfg, fault, url, token, undo)
    if fault.shift is not None:
        cfg.log(f"scenario: onset: workload shift {fault.shift(cfg.value or 0.0)}")
    return onset


async def drive(
    cfg: ScenarioConfig,
    url: str,
    token: str,
    rate: float | None,
    stop: asyncio.Event,
    undo: list[Undo],
) -> dict[str, Any]:
    """Run both streams with the fault's shift from the onset, and switch the fault's knobs at the onset
    (what it starts, busy processes or a throttle, is added to `undo`, for the caller to take back)."""
    fault = FAULTS[cfg.fault] if cfg.fault else None
    shifts = (WorkloadShift(cfg.onset, **fault.shift(cfg.value or 0.0)),) if fault and fault.shift else ()
    mixed, shared = workloads(cfg.seed, shifts, fault_workload(cfg))
    load_a, load_b = load_specs(rate, cfg)
    opts = RunOptions(model=cfg.model, timeout_s=300, drain_timeout_s=cfg.drain_timeout_s, seed=cfg.seed)
    t0, start = time.perf_counter(), time.time()
    runs = asyncio.gather(
        run_load(url, mixed, load_a, opts, stop=stop),
        run_load(url, shared, load_b, replace(opts, first_index=1_000_000), stop=stop),
        _switch_at(cfg, url, token, t0, stop, undo),
    )
    a, b, onset = await runs
    if (
        fault is not None
        and fault.limits is None
        and fault.engine is None
        and fault.neighbours is None
        and not fault.fleet
    ):
        onset = start + cfg.onset  # a pure workload shift starts on the load generator's clock
    return {"start": start, "end": time.time(), "onset": onset, "summary": _summary([a, b])}


def _summary(results: list[RunResult]) -> dict[str, Any]:
    records = [r for res in results for r in res.records]
    ok = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for r in records:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "issued": len(records),
        "completed": len(ok),
        "errors": errors,
        "interrupted": any(r.interrupted for r in results),
    }


def run_scenario(cfg: ScenarioConfig, capacity_rps: float | None = None) -> dict[str, Any]:
    """Run one scenario end to end and write `cfg.out/truth.json`; returns the truth."""
    if cfg.fault is not None and cfg.fault not in FAULTS:
        raise ValueError(f"unknown fault {cfg.fault!r}")
    if cfg.fault in FAULTS and FAULTS[cfg.fault].fleet and not cfg.fault_instance < cfg.replicas > 1:
        raise ValueError(f"fault {cfg.fault} needs --replicas 2 or more and --fault-instance below it")
    cfg.out.mkdir(parents=True, exist_ok=True)
    rate = cfg.rate
    closed = fault_clients(cfg) is not None  # the fault's closed loop brings its own demand
    if rate is None and not closed:
        capacity_rps = capacity_rps or capacity(cfg)
        rate = round(cfg.load_fraction * capacity_rps, 3)
    if not closed and cfg.duration_s < min_duration_s(rate, cfg.onset / cfg.duration_s):
        cfg.log(
            f"scenario: warning: {rate}/s for {cfg.duration_s:g}s brings fewer than {MIN_REQUESTS_PER_SIDE} "
            f"requests to a side of the onset; the diagnosis may not test tail latencies"
        )
    token = secrets.token_hex(16)
    load_before = os.getloadavg()[0]
    procs: list[Proc] = []
    undo: list[Undo] = []  # busy processes of a cpu_contention run, a replica's throttle
    instance = None
    isolate = isolates(cfg)
    unpin = isolate_harness(isolate)  # before the collector starts: it runs on the harness cores
    try:
        # DIR itself is the chDB data directory, so `stepscope collector --store chdb://DIR` reopens a run.
        engine_port = free_port()
        collector, collector_url = launch_collector(
            cfg.out,
            cfg.out / "collector.log",
            engine_port if cfg.scrape else None,
            cfg.scrape_interval_s,
            nice=harness_nice(isolate),
        )
        procs.append(collector)
        server, url = start_server(cfg, cfg.out / "server.log", token, collector_url, engine_port)
        procs.append(server)
        collector.wait_http(collector_url + "/health", COLLECTOR_START_S)
        warm_up(url, cfg.model)
        cfg.log(
            f"scenario: {cfg.fault or 'healthy'}={cfg.value} "
            f"{f'under the {cfg.workload_of} workload, ' if cfg.workload_of else ''}"
            f"{f'{fault_clients(cfg)} clients' if closed else f'rate {rate}/s'} "
            f"for {cfg.duration_s:g}s, onset {cfg.onset:g}s"
        )
        if cfg.replicas > 1:
            instance = fleet.replica_ids(url)[cfg.fault_instance]["instance"]
        run = asyncio.run(_drive_until_interrupted(cfg, url, token, rate, undo))
        undo_all(undo)
        server.stop()
        n = wait_flushed(collector_url)
        cfg.log(f"scenario: {n} requests stored; issued {run['summary']['issued']}")
    finally:
        undo_all(undo)
        for p in reversed(procs):
            p.stop()
        unpin()
    truth = {
        "fault": cfg.fault,
        "value": cfg.value,
        "onset": run["onset"],
        "start": run["start"],
        "end": run["end"],
        "seed": cfg.seed,
        "load": {"rate_rps": rate, "capacity_rps": capacity_rps, "load_fraction": cfg.load_fraction},
        "model": cfg.model,
        "engine": cfg.engine_args(),
        "step_spans": cfg.step_spans,
        "scrape": cfg.scrape,
        "workload": {k: str(v) for k, v in fault_workload(cfg).items()},  # the fault's, over the default
        "clients": fault_clients(cfg),  # closed loop instead of the rate
        "workload_of": cfg.workload_of,  # a healthy run under this fault's workload, demand and engine
        "duration_s": cfg.duration_s,
        "onset_s": cfg.onset if cfg.fault else None,
        "replicas": cfg.replicas,
        "fault_instance": instance if cfg.fault in FAULTS and FAULTS[cfg.fault].fleet else None,
        "store": f"chdb://{cfg.out}",
        "requests_stored": n,
        "client": run["summary"],
        "loadavg_1m": {"start": round(load_before, 2), "end": round(os.getloadavg()[0], 2)},  # neighbours
    }
    (cfg.out / "truth.json").write_text(json.dumps(truth, indent=2) + "\n")
    return truth


async def _drive_until_interrupted(
    cfg: ScenarioConfig, url: str, token: str, rate: float | None, undo: list[Undo]
) -> dict[str, Any]:
    stop = asyncio.Event()
    try:
        return await drive(cfg, url, token, rate, stop, undo)
    except asyncio.CancelledError:
        stop.set()
        raise
