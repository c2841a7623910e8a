"""A bench: one run per load value (a step), then the knee, the recommendation and the cost.

`run_bench` drives the steps; `build_results` turns the steps' records into the results.json dict and is a
pure function (tests feed it hand-made records).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from opentelemetry.trace import Tracer

from loadgen.knee import KneeConfig, cost_per_1k_requests, find_knee, recommended_load, throughput_at
from loadgen.metrics import SLO, step_figures
from loadgen.runner import LoadSpec, Progress, RunOptions, RunResult, make_client, run_load
from loadgen.workloads import RequestSpec, Workload

LOAD_KINDS = ("concurrency", "rate", "replay")


@dataclass(slots=True)
class BenchConfig:
    """One bench: where, what, which loads, for how long, judged against which SLOs."""

    url: str
    model: str
    workload: Workload
    loads: list[float]
    load_kind: str = "concurrency"
    arrival: str = "poisson"
    burstiness: float = 1.0
    duration_s: float | None = None
    num_requests: int | None = None
    max_concurrency: int | None = None
    slo: SLO = field(default_factory=SLO)
    knee: KneeConfig = field(default_factory=KneeConfig)
    cost_per_hour: float | None = None
    seed: int = 0
    timeout_s: float = 300.0
    drain_timeout_s: float = 60.0
    warmup_requests: int = 2
    tracer: Tracer | None = None

    def __post_init__(self) -> None:
        if self.load_kind not in LOAD_KINDS:
            raise ValueError(f"load kind must be one of {LOAD_KINDS}")
        if not self.loads:
            raise ValueError("no load values")
        if self.cost_per_hour is not None and self.cost_per_hour < 0:
            raise ValueError("cost per hour must be >= 0")

    def load_spec(self, load: float) -> LoadSpec:
        """The `LoadSpec` of the step at `load`."""
        common = dict(
            arrival=self.arrival,
            burstiness=self.burstiness,
            duration_s=self.duration_s,
            num_requests=self.num_requests,
            max_concurrency=self.max_concurrency,
        )
        if self.load_kind == "concurrency":
            return LoadSpec(concurrency=int(load), **common)  # type: ignore[arg-type]
        if self.load_kind == "rate":
            return LoadSpec(rate=load, **common)  # type: ignore[arg-type]
        return LoadSpec(replay=True, **common)  # type: ignore[arg-type]


async def warm_up(client: httpx.AsyncClient, cfg: BenchConfig) -> None:
    """A few short sequential requests, not recorded: the first requests of a fresh server are not typical."""
    from loadgen.client import RequestRecord, send_request

    for i in range(cfg.warmup_requests):
        spec = RequestSpec(-1 - i, "warmup", 4, prompt="warm up " * 4)
        rec = RequestRecord(spec.index, spec.kind, spec.max_tokens, 0, 0.0)
        await send_request(
            client, cfg.url, spec, rec, model=cfg.model, t0=time.perf_counter(), timeout_s=30.0
        )


async def run_bench(
    cfg: BenchConfig,
    stop: asyncio.Event,
    *,
    on_step_start: Callable[[int, float], None] | None = None,
    progress: Callable[[Progress], None] | None = None,
    on_step_end: Callable[[int, RunResult], None] | None = None,
) -> list[RunResult]:
    """Run every step in order (each with fresh request indices); stop early when `stop` is set."""
    results: list[RunResult] = []
    async with make_client(cfg.timeout_s) as client:
        await warm_up(client, cfg)
        first_index = 0
        for i, load in enumerate(cfg.loads):
            if stop.is_set():
                break
            if on_step_start:
                on_step_start(i, load)
            opts = RunOptions(
                model=cfg.model,
                timeout_s=cfg.timeout_s,
                drain_timeout_s=cfg.drain_timeout_s,
                seed=cfg.seed,
                first_index=first_index,
                tracer=cfg.tracer,
            )
            res = await run_load(
                cfg.url, cfg.workload, cfg.load_spec(load), opts, stop=stop, progress=progress, client=client
            )
            results.append(res)
            first_index += len(res.records)
            if on_step_end:
                on_step_end(i, res)
    return results


def build_results(
    cfg: BenchConfig, runs: Sequence[RunResult], *, interrupted: bool = False
) -> dict[str, Any]:
    """The results.json dict: per-step figures, knee, recommended load, cost per 1k requests."""
    loads = [float(x) for x in cfg.loads[: len(runs)]]
    steps = []
    for load, res in zip(loads, runs, strict=True):
        # requests cut by Ctrl-C are the operator's doing, not the server's: left out of the figures
        records = [r for r in res.records if not (res.interrupted and r.error == "cancelled")]
        figs = step_figures(records, res.elapsed_s, cfg.slo, window_s=res.issue_s)
        step = {"load": load, cfg.load_kind: load, **figs, "interrupted": res.interrupted}
        if cfg.cost_per_hour is not None:
            step["cost_per_1k_requests"] = cost_per_1k_requests(
                cfg.cost_per_hour, figs["request_throughput_rps"]
            )
        steps.append(step)
    whole = [i for i, st in enumerate(steps) if not st["interrupted"]]  # a cut step cannot show a knee
    knee = find_knee([loads[i] for i in whole], [steps[i] for i in whole], cfg.slo, cfg.knee)
    rec = recommended_load([loads[i] for i in whole], knee, cfg.knee)
    cost = None
    if rec is not None and cfg.cost_per_hour is not None:
        thr = throughput_at(loads, [s["request_throughput_rps"] for s in steps], rec)
        cost = cost_per_1k_requests(cfg.cost_per_hour, thr)
    out: dict[str, Any] = {
        "url": cfg.url,
        "model": cfg.model,
        "workload": cfg.workload.config.name,
        "load_kind": cfg.load_kind,
        "loads": loads,
        "slo": dataclasses.asdict(cfg.slo),
        "knee_config": dataclasses.asdict(cfg.knee),
        "steps": steps,
        "knee": knee.to_json(),
        "recommended_load": rec,
        "cost_per_hour": cfg.cost_per_hour,
        "cost_per_1k_requests": cost,
        "interrupted": interrupted,
        "config": _config_json(cfg),
    }
    if cfg.load_kind == "concurrency" and rec is not None:
        out["recommended_concurrency"] = max(1, math.floor(rec))
    return out


def _config_json(cfg: BenchConfig) -> dict[str, Any]:
    wl = cfg.workload.config
    return {
        "arrival": cfg.arrival if cfg.load_kind == "rate" else None,
        "burstiness": cfg.burstiness if cfg.load_kind == "rate" else None,
        "duration_s": cfg.duration_s,
        "num_requests": cfg.num_requests,
        "max_concurrency": cfg.max_concurrency,
        "seed": cfg.seed,
        "timeout_s": cfg.timeout_s,
        "drain_timeout_s": cfg.drain_timeout_s,
        "chars_per_token": wl.chars_per_token,
        "max_prompt_tokens": wl.max_prompt_tokens,
        "shifts": [dataclasses.asdict(s) for s in wl.shifts],
    }
