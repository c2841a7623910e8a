"""`stepscope bench`: load-test an OpenAI-compatible server, find its capacity knee, price 1,000 requests.

Bad input (an unreachable URL, an unparsable SLO or duration) raises `UsageError`: one line, exit code 2.
Ctrl-C stops the run and still writes the partial results (exit code 130).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import re
import signal
from pathlib import Path
from typing import Any

import httpx

from loadgen.arrivals import ARRIVALS
from loadgen.bench import BenchConfig, build_results, run_bench
from loadgen.knee import KneeConfig
from loadgen.metrics import SLO
from loadgen.progress import ProgressLine
from loadgen.report import table, write_json, write_plots
from loadgen.runner import Progress, RunResult
from loadgen.tracing import configured_endpoint, make_tracer
from loadgen.workloads import BUILTIN_WORKLOADS, Workload, WorkloadConfig, WorkloadShift
from stepscope.cli import UsageError

_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
DEFAULT_DURATION = "60s"


def parse_duration(text: str, what: str = "duration", allow_zero: bool = False) -> float:
    """Seconds from `200ms`, `2s`, `1.5m`, `1h` or a bare number of seconds; UsageError otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?\s*", text or "")
    if not m or (float(m.group(1)) <= 0 and not allow_zero):
        raise UsageError(
            f"bad {what} {text!r}: use a positive number with ms, s, m or h (e.g. 200ms, 2s, 1m)"
        )
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def parse_loads(text: str, integers: bool) -> list[float]:
    """`1,2,4,8` -> increasing positive loads (integers for concurrency)."""
    try:
        loads = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"bad --step-load {text!r}: use comma-separated numbers, e.g. 1,2,4,8") from None
    if not loads or any(x <= 0 for x in loads) or loads != sorted(set(loads)):
        raise UsageError(f"bad --step-load {text!r}: loads must be positive and increasing")
    if integers and any(x != int(x) for x in loads):
        raise UsageError(
            f"bad --step-load {text!r}: concurrency values are integers (use --rate-steps for rates)"
        )
    return loads


def parse_shift(text: str) -> WorkloadShift:
    """`at=30s,prompt_len=2,rate=1.5,prefix_change=0.3` -> WorkloadShift."""
    keys = {
        "prompt_len": "prompt_len_factor",
        "rate": "rate_factor",
        "prefix_change": "prefix_change_fraction",
    }
    fields: dict[str, float] = {}
    try:
        for part in text.split(","):
            k, v = (s.strip() for s in part.split("=", 1))
            if k == "at":
                fields["start_s"] = parse_duration(v, "shift start", allow_zero=True)
            else:
                fields[keys[k]] = float(v)
        return WorkloadShift(**fields)
    except (KeyError, ValueError, TypeError) as e:
        raise UsageError(
            f"bad --shift {text!r} ({e}): use at=DURATION plus any of prompt_len=K, rate=K, prefix_change=F"
        ) from None


def _bench_default(name: str) -> Any:
    """A BenchConfig default: the one place it lives."""
    return next(f.default for f in dataclasses.fields(BenchConfig) if f.name == name)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `bench` options (defaults live in the config dataclasses; these only parse)."""
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name to request (default: the first of GET /v1/models)")
    p.add_argument(
        "--workload",
        default=WorkloadConfig().name,
        help=f"{'|'.join(BUILTIN_WORKLOADS)} or a .jsonl replay file",
    )
    load = p.add_argument_group("load")
    load.add_argument("--rate", type=float, help="open loop: requests per second")
    load.add_argument(
        "--arrival", choices=ARRIVALS, default=_bench_default("arrival"), help="arrival process for --rate"
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=_bench_default("burstiness"),
        help="gamma shape: 1/CV^2 of gaps (1 = Poisson)",
    )
    load.add_argument("--concurrency", type=int, help="closed loop: requests in flight")
    load.add_argument("--max-concurrency", type=int, help="open loop: cap on requests in flight")
    load.add_argument(
        "--step-load", help="comma-separated loads, one step each (concurrency, or rates with --rate-steps)"
    )
    load.add_argument("--rate-steps", action="store_true", help="--step-load values are request rates")
    load.add_argument("--duration", help=f"per step, e.g. 30s or 2m (default {DEFAULT_DURATION})")
    load.add_argument("--num-requests", type=int, help="per step, instead of a duration")
    load.add_argument("--timeout", default=f"{_bench_default('timeout_s'):g}s", help="per-request timeout")
    load.add_argument(
        "--drain-timeout",
        default=f"{_bench_default('drain_timeout_s'):g}s",
        help="how long requests in flight may finish after a step",
    )
    load.add_argument(
        "--warmup",
        type=int,
        default=_bench_default("warmup_requests"),
        help="short unrecorded requests before the first step",
    )
    slo = p.add_argument_group("SLOs and cost")
    slo.add_argument("--slo-ttft", help="TTFT target, e.g. 2s")
    slo.add_argument("--slo-tpot", help="TPOT target, e.g. 80ms")
    slo.add_argument(
        "--slo-target", type=float, default=SLO().target, help="attainment a healthy step must reach"
    )
    slo.add_argument(
        "--knee-elasticity", type=float, default=KneeConfig().elasticity, help="see docs/loadgen.md"
    )
    slo.add_argument(
        "--headroom", type=float, default=KneeConfig().headroom, help="below the knee's last good load"
    )
    slo.add_argument("--cost-per-hour", type=float, help="machine cost per hour, to price 1,000 requests")
    wl = p.add_argument_group("workload")
    wl.add_argument("--seed", type=int, default=WorkloadConfig().seed)
    wl.add_argument(
        "--chars-per-token",
        type=float,
        default=WorkloadConfig().chars_per_token,
        help="1.0 for byte tokenizers, ~4 for BPE",
    )
    wl.add_argument("--max-prompt-tokens", type=int, help="clip prompts (after shifts) to this many tokens")
    wl.add_argument(
        "--shift",
        action="append",
        default=[],
        help="at=30s,prompt_len=2,rate=1.5,prefix_change=0.3 (repeatable)",
    )
    p.add_argument(
        "--otlp-endpoint", help="export a CLIENT span per request (default: OTEL_EXPORTER_OTLP_ENDPOINT)"
    )
    p.add_argument(
        "--out", default="results.json", help="results file; plots and requests.jsonl go beside it"
    )


def check_server(url: str) -> list[str]:
    """Model ids the server lists; UsageError when it cannot be reached at all."""
    try:
        with httpx.Client(timeout=5.0, trust_env=False) as c:
            r = c.get(url + "/v1/models")
            if r.status_code == 200:
                return [m.get("id") for m in r.json().get("data", []) if m.get("id")]
            if c.get(url + "/health").status_code < 400:
                return []
    except (httpx.HTTPError, ValueError) as e:
        raise UsageError(f"cannot reach {url}: {type(e).__name__}: {e}") from None
    raise UsageError(
        f"{url} does not look like an OpenAI-compatible server (GET /v1/models: {r.status_code})"
    )


def _load_kind(args: argparse.Namespace, wl: Workload) -> tuple[str, list[float]]:
    if args.rate is not None and args.concurrency is not None:
        raise UsageError("give --rate or --concurrency, not both")
    if args.step_load:
        if args.rate is not None or args.concurrency is not None:
            raise UsageError("--step-load replaces --rate/--concurrency")
        kind = "rate" if args.rate_steps else "concurrency"
        return kind, parse_loads(args.step_load, integers=kind == "concurrency")
    if args.rate is not None:
        return "rate", [args.rate]
    if args.concurrency is not None:
        return "concurrency", [float(args.concurrency)]
    if wl.replay_timestamps() is not None:
        return "replay", [1.0]
    return "concurrency", [1.0]


def build_config(args: argparse.Namespace) -> tuple[BenchConfig, Path]:
    """Validate the arguments into a BenchConfig (no network); UsageError on bad input."""
    try:
        shifts = tuple(parse_shift(s) for s in args.shift)
        wl_cfg = WorkloadConfig(
            seed=args.seed,
            chars_per_token=args.chars_per_token,
            max_prompt_tokens=args.max_prompt_tokens,
            shifts=shifts,
        )
        workload = Workload.load(args.workload, wl_cfg)
        kind, loads = _load_kind(args, workload)
        if args.duration:
            duration: float | None = parse_duration(args.duration)
        elif args.num_requests or kind == "replay":
            duration = None
        else:
            duration = parse_duration(DEFAULT_DURATION)
        slo = SLO(
            ttft_s=parse_duration(args.slo_ttft, "--slo-ttft") if args.slo_ttft else None,
            tpot_s=parse_duration(args.slo_tpot, "--slo-tpot") if args.slo_tpot else None,
            target=args.slo_target,
        )
        cfg = BenchConfig(
            url=_base_url(args.url),
            model=args.model or "",
            workload=workload,
            loads=loads,
            load_kind=kind,
            arrival=args.arrival,
            burstiness=args.burstiness,
            duration_s=duration,
            num_requests=args.num_requests,
            max_concurrency=args.max_concurrency,
            slo=slo,
            knee=KneeConfig(elasticity=args.knee_elasticity, headroom=args.headroom),
            cost_per_hour=args.cost_per_hour,
            seed=args.seed,
            timeout_s=parse_duration(args.timeout, "--timeout"),
            drain_timeout_s=parse_duration(args.drain_timeout, "--drain-timeout"),
            warmup_requests=max(args.warmup, 0),
        )
        cfg.load_spec(loads[0])  # validates the load (rate, counts, arrival)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return cfg, Path(args.out)


def _base_url(url: str) -> str:
    if not re.match(r"https?://", url or ""):
        raise UsageError(f"bad --url {url!r}: use http://HOST:PORT")
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def _run(cfg: BenchConfig, bar: ProgressLine) -> tuple[list[RunResult], bool]:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # not possible off the main thread (library callers): Ctrl-C then raises KeyboardInterrupt as usual
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(signal.SIGINT, stop.set)

    def step_start(i: int, load: float) -> None:
        bar.start_step(i, load, cfg.duration_s, cfg.num_requests)

    def step_end(i: int, res: RunResult) -> None:
        done = sum(r.ok for r in res.records)
        bar.end_step(_final_progress(res, done))

    try:
        runs = await run_bench(cfg, stop, on_step_start=step_start, progress=bar, on_step_end=step_end)
    finally:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.remove_signal_handler(signal.SIGINT)
    return runs, stop.is_set()


def _final_progress(res: RunResult, done: int) -> Progress:
    n = len(res.records)
    return Progress(res.elapsed_s, n, n, n - done, 0)


def run(args: argparse.Namespace) -> int:
    """Run the bench; write results.json, plots and requests.jsonl; print the table."""
    cfg, out = build_config(args)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot write results beside {out}: {e.strerror}") from None
    models = check_server(cfg.url)
    if cfg.model and models and cfg.model not in models:
        raise UsageError(f"model {cfg.model!r} is not served at {cfg.url} (it serves: {', '.join(models)})")
    cfg.model = cfg.model or (models[0] if models else "default")
    cfg.tracer, shutdown_tracing = make_tracer(configured_endpoint(args.otlp_endpoint))
    bar = ProgressLine(len(cfg.loads), cfg.load_kind)
    try:
        runs, interrupted = asyncio.run(_run(cfg, bar))
    finally:
        shutdown_tracing()
    results = build_results(cfg, runs, interrupted=interrupted)
    write_json(out, results)  # first, so that a plotting failure cannot lose the figures
    _write_requests(out, runs)
    results["plots"] = [str(p) for p in write_plots(results, out)]
    write_json(out, results)
    print(table(results))
    print(f"results: {out}" + "".join(f"\nplot: {p}" for p in results["plots"]))
    return 130 if interrupted else 0


def _write_requests(out: Path, runs: list[RunResult]) -> None:
    path = out.with_name(out.stem + "_requests.jsonl")
    with path.open("w") as f:
        for step, res in enumerate(runs):
            for rec in res.records:
                f.write(json.dumps({"step": step, **rec.to_json()}) + "\n")
