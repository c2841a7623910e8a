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
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from diagnosis.scenario_procs import Proc, start_collector, start_server, wait_flushed
from loadgen.runner import LoadSpec, RunOptions, RunResult, run_load
from loadgen.workloads import LengthDist, Workload, WorkloadConfig, WorkloadShift

Limits = dict[str, object]
# The diagnosis tests a P99 only with 50 requests on each side of the change (diagnosis/config.py): a run
# should bring a few more than that to each side of its onset.
MIN_REQUESTS_PER_SIDE = 55


def min_duration_s(rate: float, onset_share: float = 0.5) -> float:
    """The shortest run whose both sides of the onset get `MIN_REQUESTS_PER_SIDE` requests at `rate`."""
    return MIN_REQUESTS_PER_SIDE / rate / min(onset_share, 1 - onset_share)


@dataclass(frozen=True, slots=True)
class Fault:
    """One scenario fault: how its value turns into a workload shift, runtime limits or engine faults."""

    name: str
    help: str
    default: float | None  # None: the fault takes no value
    magnitudes: tuple[float | None, ...]  # the eval grid's two magnitudes
    shift: Callable[[float], dict[str, float]] | None = None  # -> WorkloadShift fields
    limits: Callable[[float, Limits], Limits] | None = None  # (value, current limits) -> changes
    engine: Callable[[float], dict[str, object]] | None = None  # -> /admin/faults body
    serve_args: tuple[str, ...] = ()  # `stepscope serve` options the run needs from its start
    # The workload the fault needs to show, in both halves (WorkloadConfig fields over `workloads()`).
    workload: dict[str, Any] = field(default_factory=dict)
    # Closed-loop clients in all (both streams) instead of the open-loop rate: demand that queues.
    clients: int | None = None


FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        Fault(
            "prefix_cache_miss",
            "a fraction F of requests get a changed system prompt",
            0.9,
            (0.6, 0.9),
            shift=lambda v: {"prefix_change_fraction": v},
            # An application's long system prompt (instructions, tools, few-shot examples): a miss then
            # costs 1k tokens of prefill. With the default 384 tokens TTFT P50 moved x2 and no test could
            # tell it from noise at ~50 requests a side.
            workload={"system_prompt_tokens": 1024},
        ),
        Fault(
            "long_prompts",
            "prompt lengths times K",
            3.0,
            (2.5, 4.0),
            shift=lambda v: {"prompt_len_factor": v},
        ),
        # at 35% of capacity, K = 3 lands at 1.05x: within the calibration's noise of the knee
        Fault("overload", "arrival rate times K", 4.0, (3.5, 5.0), shift=lambda v: {"rate_factor": v}),
        Fault(
            "oversized_batch",
            "max_num_seqs raised to N",
            48,
            (32, 64),
            limits=lambda v, cur: {"max_num_seqs": int(v)},
            # Demand that queues at the old cap (a batch pipeline keeping 24 requests in flight): only
            # then does a higher cap change the batch. Open-loop arrivals below the knee keep the batch
            # at arrivals x latency (Little's law) whatever the cap.
            clients=24,
        ),
        Fault(
            "prefill_interference",
            "chunked prefill turned off while long prompts arrive among chat traffic",
            None,
            (None, None),
            # As vLLM requires with chunking off, the token budget covers a whole prompt: documents are
            # prefilled in one step together with the running decodes (with the 256-token budget a long
            # prompt would instead wait for the batch to empty and run alone).
            limits=lambda v, cur: {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096},
            # Longer documents and chat answers, and six clients keeping requests in flight (below the
            # cap of 8: no queueing at it), so that long prefills land among running decodes whatever
            # the machine's speed.
            workload={
                "summarize_prompt": LengthDist(1536, 0.25, 1024, 2048),
                "chat_output": LengthDist(48, 0.3, 24, 96),
            },
            clients=6,
        ),
        Fault(
            "kv_cache_pressure",
            "the KV block pool cut to a fraction F",
            0.1,
            (0.15, 0.1),
            # 768 -> 76 blocks at 0.1 (115 at 0.15; the longest prompt needs 65): a full batch of 8
            # (about 100-150 blocks) no longer fits, so running sequences are preempted. Once decode got
            # cheaper (session 3), 0.15's 33 preemptions moved ITL max P99 x1.7 and TTFT P99 x1.4: past
            # the significance bar in one quiet run of two.
            limits=lambda v, cur: {"num_kv_blocks": max(int(int(cur["num_kv_blocks"]) * v), 1)},  # type: ignore[call-overload]
            # A busy engine, the batch kept at its cap of 8 by closed-loop clients: at 35% of capacity
            # on an open loop the batch was ~1 and even 76 blocks preempted once in a run.
            clients=8,
        ),
        Fault(
            "scheduler_stall",
            "a thread holds the step loop's lock for MS ms every 100-250 ms",
            100,
            (60, 150),
            engine=lambda v: {"scheduler_stall_ms": float(v)},
        ),
        Fault(
            "rpc_overhead",
            "the front-end/core channel switched to a codec K times slower",
            # At 400 a quiet run's RPC delay grew 1.1 -> 6.5 ms a token against a 24 ms TPOT: TPOT P50
            # x1.15, under the regression bar. 1000 makes the channel the bottleneck it is meant to be.
            1000,
            (600, 1500),
            engine=lambda v: {"rpc_codec": f"slow:{int(v)}"},
        ),
        Fault(
            "kv_transfer_slow",
            "disaggregated serving: the prefill -> decode KV link throttled to MB/s (docs/disagg.md)",
            20,
            (30, 10),
            engine=lambda v: {"kv_transfer_mbps": float(v)},
            serve_args=("--disagg",),  # 1 prefill + 1 decode worker on the same cores
        ),
        Fault(
            "weight_quant_off",
            "an int8-weight engine switched to full-precision weights (the wrong checkpoint)",
            None,
            (None, None),
            engine=lambda v: {"weight_quant_off": True},
            serve_args=("--weight-dtype", "int8"),  # healthy half int8, the fault half fp32
        ),
    )
}


def parse_fault(text: str) -> tuple[str, float | None]:
    """`NAME` or `NAME=VALUE` -> (name, value with the default filled in); ValueError when bad."""
    name, _, raw = text.partition("=")
    fault = FAULTS.get(name)
    if fault is None:
        raise ValueError(f"unknown fault {name!r}; choose one of {', '.join(FAULTS)}")
    if not raw:
        return name, fault.default
    if fault.default is None:
        raise ValueError(f"fault {name} takes no value")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"fault {name}: expected a number, got {raw!r}") from None
    if value <= 0 or (name in ("prefix_cache_miss", "kv_cache_pressure") and value > 1):
        raise ValueError(f"fault {name}: value out of range: {raw}")
    return name, value


@dataclass(slots=True)
class ScenarioConfig:
    """One scenario run. Every default lives here; `stepscope scenario run` is built from it."""

    out: Path
    fault: str | None = None
    value: float | None = None
    duration_s: float = 80.0
    onset_s: float | None = None  # None: half the duration
    seed: int = 0
    model: str = "small"
    rate: float | None = None  # requests/s in all; None: load_fraction x calibrated capacity
    load_fraction: float = 0.35  # of the capacity measured by `calibrate` (below the knee)
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256  # chunks of at most 128 prompt tokens per step
    num_kv_blocks: int = 768  # 12k tokens: a healthy run never preempts
    num_threads: int = 1  # torch threads of the core: 2 shared cores, steadier with one
    disagg: bool = False  # serve disaggregated (router + 1 prefill + 1 decode worker, docs/disagg.md)
    drain_timeout_s: float = 20.0
    shared_fraction: float = 0.4  # of requests from the shared-system-prompt stream
    log: Callable[[str], None] = field(default=lambda s: print(s, file=sys.stderr, flush=True))

    @property
    def onset(self) -> float:
        return self.duration_s / 2 if self.onset_s is None else self.onset_s

    def engine_args(self) -> list[str]:
        """`stepscope serve` options of the scenario's engine."""
        return [
            "--model", self.model,
            "--max-num-seqs", str(self.max_num_seqs),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--num-kv-blocks", str(self.num_kv_blocks),
            "--num-threads", str(self.num_threads),
            *(FAULTS[self.fault].serve_args if self.fault in FAULTS else ()),
            *(("--disagg",) if self.disagg and self.fault != "kv_transfer_slow" else ()),
        ]  # fmt: skip


def workloads(
    seed: int, shifts: tuple[WorkloadShift, ...] = (), overrides: dict[str, Any] | None = None
) -> tuple[Workload, Workload]:
    """The steady mix: chat with some long documents (`mixed`), and chat behind one shared system
    prompt (`shared-prefix`, where the prefix cache pays). Outputs are short so a CPU run is quick.
    `overrides` (WorkloadConfig fields) is a fault's own workload (`Fault.workload`)."""
    base = WorkloadConfig(
        seed=seed,
        chat_prompt=LengthDist(64, 0.5, 16, 256),
        chat_output=LengthDist(16, 0.3, 8, 32),
        summarize_prompt=LengthDist(640, 0.25, 320, 1024),
        summarize_output=LengthDist(6, 0.3, 4, 12),
        summarize_fraction=0.25,
        system_prompt_tokens=384,
        shared_user_prompt=LengthDist(32, 0.5, 8, 128),
        shared_output=LengthDist(16, 0.3, 8, 32),
        max_prompt_tokens=3500,
        shifts=shifts,
    )
    base = replace(base, **(overrides or {}))
    return Workload.load("mixed", base), Workload.load("shared-prefix", replace(base, seed=seed + 7919))


# -- the run --------------------------------------------------------------------------------------
def fault_workload(cfg: ScenarioConfig) -> dict[str, Any]:
    """The WorkloadConfig overrides of the run's fault ({} for a healthy run)."""
    return dict(FAULTS[cfg.fault].workload) if cfg.fault in FAULTS else {}


def fault_clients(cfg: ScenarioConfig) -> int | None:
    """Closed-loop clients of the run's fault (None: the open-loop rate)."""
    return FAULTS[cfg.fault].clients if cfg.fault in FAULTS else None


def load_specs(rate: float | None, cfg: ScenarioConfig) -> tuple[LoadSpec, LoadSpec]:
    """Open-loop Poisson loads of the two streams, `rate` requests/s in all (or the fault's closed loop
    of clients, split between the streams as the rate is)."""
    clients = fault_clients(cfg)
    if clients is not None:
        shared_c = max(1, round(clients * cfg.shared_fraction))
        return (
            LoadSpec(concurrency=clients - shared_c, duration_s=cfg.duration_s),
            LoadSpec(concurrency=shared_c, duration_s=cfg.duration_s),
        )
    assert rate is not None
    shared = rate * cfg.shared_fraction
    return (
        LoadSpec(rate=rate - shared, duration_s=cfg.duration_s),
        LoadSpec(rate=shared, duration_s=cfg.duration_s),
    )


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


async def _switch_at(
    cfg: ScenarioConfig, url: str, token: str, t0: float, stop: asyncio.Event
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
    if fault.shift is not None:
        cfg.log(f"scenario: onset: workload shift {fault.shift(cfg.value or 0.0)}")
    return onset


async def drive(
    cfg: ScenarioConfig, url: str, token: str, rate: float | None, stop: asyncio.Event
) -> dict[str, Any]:
    """Run both streams with the fault's shift from the onset, and switch the fault's knobs at the onset."""
    fault = FAULTS[cfg.fault] if cfg.fault else None
    shifts = (WorkloadShift(cfg.onset, **fault.shift(cfg.value or 0.0)),) if fault and fault.shift else ()
    mixed, shared = workloads(cfg.seed, shifts, fault_workload(cfg))
    load_a, load_b = load_specs(rate, cfg)
    opts = RunOptions(model=cfg.model, timeout_s=300, drain_timeout_s=cfg.drain_timeout_s, seed=cfg.seed)
    t0, start = time.perf_counter(), time.time()
    runs = asyncio.gather(
        run_load(url, mixed, load_a, opts, stop=stop),
        run_load(url, shared, load_b, replace(opts, first_index=1_000_000), stop=stop),
        _switch_at(cfg, url, token, t0, stop),
    )
    a, b, onset = await runs
    if fault is not None and fault.limits is None and fault.engine is None:
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
    from diagnosis.calibrate import capacity

    if cfg.fault is not None and cfg.fault not in FAULTS:
        raise ValueError(f"unknown fault {cfg.fault!r}")
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
    try:
        # DIR itself is the chDB data directory, so `stepscope collector --store chdb://DIR` reopens a run.
        collector, collector_url = start_collector(cfg.out, cfg.out / "collector.log")
        procs.append(collector)
        server, url = start_server(cfg, cfg.out / "server.log", token, collector_url)
        procs.append(server)
        warm_up(url, cfg.model)
        cfg.log(
            f"scenario: {cfg.fault or 'healthy'}={cfg.value} "
            f"{f'{fault_clients(cfg)} clients' if closed else f'rate {rate}/s'} "
            f"for {cfg.duration_s:g}s, onset {cfg.onset:g}s"
        )
        run = asyncio.run(_drive_until_interrupted(cfg, url, token, rate))
        server.stop()
        n = wait_flushed(collector_url)
        cfg.log(f"scenario: {n} requests stored; issued {run['summary']['issued']}")
    finally:
        for p in reversed(procs):
            p.stop()
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
        "workload": {k: str(v) for k, v in fault_workload(cfg).items()},  # the fault's, over the default
        "clients": fault_clients(cfg),  # closed loop instead of the rate
        "duration_s": cfg.duration_s,
        "onset_s": cfg.onset if cfg.fault else None,
        "store": f"chdb://{cfg.out}",
        "requests_stored": n,
        "client": run["summary"],
        "loadavg_1m": {"start": round(load_before, 2), "end": round(os.getloadavg()[0], 2)},  # neighbours
    }
    (cfg.out / "truth.json").write_text(json.dumps(truth, indent=2) + "\n")
    return truth


async def _drive_until_interrupted(
    cfg: ScenarioConfig, url: str, token: str, rate: float | None
) -> dict[str, Any]:
    stop = asyncio.Event()
    try:
        return await drive(cfg, url, token, rate, stop)
    except asyncio.CancelledError:
        stop.set()
        raise


def warm_up(url: str, model: str) -> None:
    """Two short requests before the run: the first steps of a fresh process are slow."""
    for prompt in ("warm up " * 40, "hello"):
        body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        httpx.post(url + "/v1/completions", json=body, timeout=120, trust_env=False)


def config_dict(cfg: ScenarioConfig) -> dict[str, Any]:
    """The config as JSON (the log callable left out)."""
    d = asdict(cfg)
    d.pop("log", None)
    d["out"] = str(cfg.out)
    return d
