"""One scenario run's configuration and its steady workload: what `run`, `calibrate` and the demo share.

`ScenarioConfig` holds every default of `stepscope scenario run`; `workloads()` builds the two streams of
the steady mix; `fault_workload`/`fault_clients` read the fault's own workload and closed loop from the
fault table (`scenarios.faults`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from loadgen.runner import LoadSpec
from loadgen.workloads import LengthDist, Workload, WorkloadConfig, WorkloadShift
from scenarios.faults import FAULTS


@dataclass(slots=True)
class ScenarioConfig:
    """One scenario run. Every default lives here; `stepscope scenario run` is built from it."""

    out: Path
    fault: str | None = None
    value: float | None = None
    duration_s: float = 80.0
    onset_s: float | None = None  # None: `onset_fraction` of the duration
    onset_fraction: float = 0.5
    seed: int = 0
    model: str = "small"
    rate: float | None = None  # requests/s in all; None: load_fraction x calibrated capacity
    load_fraction: float = 0.35  # of the capacity measured by `calibrate` (below the knee)
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256  # chunks of at most 128 prompt tokens per step
    num_kv_blocks: int = 768  # 12k tokens: a healthy run never preempts
    num_threads: int = 1  # torch threads of the core: 2 shared cores, steadier with one
    # The engine's core processes on cores of their own, the collector, load generator and front ends on
    # the rest (scenarios/procs.py, `core_split`): the harness is not the engine's noisy neighbour.
    isolate_cores: bool = True
    disagg: bool = False  # serve disaggregated (router + 1 prefill + 1 decode worker, docs/disagg.md)
    step_spans: bool = True  # False: request spans only, as vLLM and SGLang emit
    scrape: bool = False  # the collector scrapes the engine's /metrics (its vLLM names) into engine_samples
    scrape_interval_s: float = 1.0  # a few dozen samples a side in a minute-long run
    replicas: int = 1  # > 1: a fleet of replicas behind the prefix-aware router (docs/fleet.md)
    fault_instance: int = 0  # a fleet fault's replica (its index)
    drain_timeout_s: float = 20.0
    shared_fraction: float = 0.4  # of requests from the shared-system-prompt stream
    # A healthy run (no fault) under this fault's workload, demand and engine settings, with no switch:
    # where a fault's setting alone could trigger a finding (`stepscope eval`'s healthy runs).
    workload_of: str | None = None
    log: Callable[[str], None] = field(default=lambda s: print(s, file=sys.stderr, flush=True))

    @property
    def onset(self) -> float:
        return self.duration_s * self.onset_fraction if self.onset_s is None else self.onset_s

    @property
    def setting(self) -> str | None:
        """The fault whose workload, demand and engine settings the run has: its fault, or `workload_of`."""
        return self.fault or self.workload_of

    def engine_args(self) -> list[str]:
        """`stepscope serve` options of the scenario's engine."""
        return [
            "--model", self.model,
            "--max-num-seqs", str(self.max_num_seqs),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--num-kv-blocks", str(self.num_kv_blocks),
            "--num-threads", str(self.num_threads),
            *(FAULTS[self.workload_of].serve_args if self.workload_of in FAULTS and not self.fault else ()),
            *(FAULTS[self.fault].serve_args if self.fault in FAULTS else ()),
            *(("--disagg",) if self.disagg and self.fault != "kv_transfer_slow" else ()),
            *(("--replicas", str(self.replicas)) if self.replicas > 1 else ()),
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
    base = replace(base, **_with_lengths(overrides or {}))
    return Workload.load("mixed", base), Workload.load("shared-prefix", replace(base, seed=seed + 7919))


def fault_workload(cfg: ScenarioConfig) -> dict[str, Any]:
    """The WorkloadConfig overrides of the run's fault or `workload_of` ({} for the default workload),
    lengths as `LengthDist`."""
    if cfg.setting not in FAULTS:
        return {}
    return _with_lengths(FAULTS[cfg.setting].workload)


def _with_lengths(overrides: dict[str, Any]) -> dict[str, Any]:
    """WorkloadConfig overrides with the fault table's length tuples as `LengthDist`."""
    return {k: LengthDist(*v) if isinstance(v, tuple) else v for k, v in overrides.items()}


def fault_clients(cfg: ScenarioConfig) -> int | None:
    """Closed-loop clients of the run's fault or `workload_of` (None: the open-loop rate)."""
    return FAULTS[cfg.setting].clients if cfg.setting in FAULTS else None


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
