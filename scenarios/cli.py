"""`stepscope scenario run`: one fault scenario end to end (engine, collector, load, truth.json).

    stepscope scenario run --fault overload=6 --duration 80 --seed 1 --out /tmp/stepscope-scenarios/overload
    stepscope scenario run --duration 60 --out /tmp/stepscope-scenarios/healthy      # no fault
    stepscope scenario list                                                          # the faults
    stepscope scenario facts /tmp/stepscope-scenarios/overload      # what the fault changed (JSON)

Defaults come from `scenarios.config.ScenarioConfig`. Ctrl-C stops every process it started.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from stepscope.cli import UsageError

_DEFAULTS: dict[str, object] = {}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`run` and `list`."""
    from scenarios.config import ScenarioConfig

    d = ScenarioConfig(out=Path("."))
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    run = sub.add_parser("run", help="run one scenario and write DIR/truth.json")
    run.add_argument(
        "--fault", metavar="NAME[=VALUE]", help="the fault (see `stepscope scenario list`); none: healthy"
    )
    run.add_argument(
        "--onset",
        metavar="SECONDS",
        help="when the fault goes on (default: --onset-fraction of the duration)",
    )
    run.add_argument(
        "--onset-fraction", default=str(d.onset_fraction), metavar="F",
        help="when the fault goes on, as a fraction of the duration (default: %(default)s)",
    )  # fmt: skip
    run.add_argument(
        "--workload-of", metavar="FAULT",
        help="a healthy run (no --fault) under this fault's workload, demand and engine settings",
    )  # fmt: skip
    run.add_argument(
        "--duration",
        metavar="SECONDS",
        default=str(d.duration_s),
        help="load duration (default: %(default)s)",
    )
    run.add_argument(
        "--seed", default=str(d.seed), metavar="INT", help="workload and arrival seed (default: %(default)s)"
    )
    run.add_argument("--out", required=True, metavar="DIR", help="run directory: store/, logs, truth.json")
    run.add_argument(
        "--model", help=f"engine model preset or checkpoint (default: {d.model}; with --replicas: tiny)"
    )
    run.add_argument(
        "--rate", metavar="RPS", help="requests/s in all (default: a fraction of the calibrated capacity)"
    )
    run.add_argument(
        "--load-fraction", default=str(d.load_fraction), metavar="F",
        help="fraction of the calibrated capacity (default: %(default)s)",
    )  # fmt: skip
    run.add_argument(
        "--disagg", action="store_true", help="serve disaggregated: router, 1 prefill + 1 decode worker"
    )
    run.add_argument(
        "--no-step-spans",
        action="store_true",
        help="the engine exports request spans only (no engine.step spans), as vLLM and SGLang do",
    )
    run.add_argument(
        "--scrape",
        action="store_true",
        help="the collector scrapes the engine's Prometheus /metrics (vLLM names) into engine_samples",
    )
    run.add_argument(
        "--replicas", default=str(d.replicas), metavar="N",
        help="serve N replicas behind the prefix-aware router (default: %(default)s, no router)",
    )  # fmt: skip
    run.add_argument(
        "--fault-instance", default=str(d.fault_instance), metavar="K",
        help="the replica (index) a fleet fault targets (default: %(default)s)",
    )  # fmt: skip
    sub.add_parser("list", help="the faults, their defaults and eval magnitudes")
    facts = sub.add_parser("facts", help="before/after figures of a finished run, from its store (JSON)")
    facts.add_argument("dir", metavar="DIR", help="a run directory with truth.json")


def config_from_args(args: argparse.Namespace) -> object:
    """The `ScenarioConfig` of the options; UsageError on bad input."""
    from scenarios.config import ScenarioConfig
    from scenarios.faults import FAULTS, parse_fault

    fault = value = None
    try:
        if args.fault:
            fault, value = parse_fault(args.fault)
        duration = _number("--duration", args.duration, 1.0)
        onset = _number("--onset", args.onset, 0.0) if args.onset is not None else None
        rate = _number("--rate", args.rate, 1e-6) if args.rate is not None else None
        fraction = _number("--load-fraction", args.load_fraction, 1e-3)
        onset_fraction = _number("--onset-fraction", args.onset_fraction, 0.01)
        if onset_fraction >= 1:
            raise ValueError(f"--onset-fraction: must be below 1, got {args.onset_fraction}")
        workload_of = args.workload_of
        if workload_of is not None and workload_of not in FAULTS:
            raise ValueError(
                f"--workload-of: unknown fault {workload_of!r}; choose one of {', '.join(FAULTS)}"
            )
        if workload_of is not None and fault is not None:
            raise ValueError("--workload-of is for a healthy run: give it without --fault")
        if not str(args.seed).isdigit():
            raise ValueError(f"--seed: expected a non-negative integer, got {args.seed!r}")
        replicas, instance = str(args.replicas), str(args.fault_instance)
        if not replicas.isdigit() or int(replicas) < 1:
            raise ValueError(f"--replicas: expected a positive integer, got {replicas!r}")
        if not instance.isdigit() or int(instance) >= int(replicas):
            raise ValueError(f"--fault-instance: expected a replica index below --replicas, got {instance!r}")
        if fault and FAULTS[fault].fleet and int(replicas) < 2:
            raise ValueError(f"fault {fault} needs a fleet: --replicas 2 or more")
    except ValueError as e:
        raise UsageError(str(e)) from None
    if onset is not None and onset >= duration:
        raise UsageError(f"--onset {onset:g} must be before the end of --duration {duration:g}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out: {out} exists and is not a directory")
    if (out / "truth.json").exists() or (out / "metadata").exists():
        raise UsageError(f"--out: {out} already holds a run; choose a new directory")
    default_model = ScenarioConfig.__dataclass_fields__["model"].default  # slots: no class attribute
    return ScenarioConfig(
        onset_fraction=onset_fraction, workload_of=workload_of,
        out=out.resolve(), fault=fault, value=value, duration_s=duration, onset_s=onset,
        seed=int(args.seed), model=args.model or ("tiny" if int(replicas) > 1 else default_model),
        rate=rate, load_fraction=fraction, disagg=bool(getattr(args, "disagg", False)),
        step_spans=not getattr(args, "no_step_spans", False), scrape=bool(getattr(args, "scrape", False)),
        replicas=int(replicas), fault_instance=int(instance),
    )  # fmt: skip


def _number(flag: str, raw: object, low: float) -> float:
    try:
        v = float(str(raw).removesuffix("s"))
    except ValueError:
        raise ValueError(f"{flag}: expected a number, got {raw!r}") from None
    if v < low:
        raise ValueError(f"{flag}: must be >= {low:g}, got {raw}")
    return v


def run(args: argparse.Namespace) -> int:
    """Run the action."""
    from scenarios.faults import FAULTS

    if args.action == "list":
        from scenarios.faults import open_loop, value_range

        for f in FAULTS.values():
            span = value_range(f)
            default = "-" if f.default is None else f"{f.default:g}"
            drawn = "-" if span is None else f"{span[0]:g}-{span[1]:g}"
            demand = "open loop" if open_loop(f) else f"{f.clients} clients"
            print(f"{f.name:22} default {default:>6}  range {drawn:10} {demand:11}  {f.help}")
        return 0
    if args.action == "facts":
        from scenarios.facts import measure

        if not (Path(args.dir) / "truth.json").is_file():
            raise UsageError(f"{args.dir}: no truth.json (not a finished scenario run)")
        print(json.dumps(measure(Path(args.dir)), indent=1))
        return 0
    if args.action != "run":
        raise UsageError("choose an action: run, list or facts")
    from scenarios.eval import interrupt_on_sigterm
    from scenarios.runner import run_scenario

    cfg = config_from_args(args)
    interrupt_on_sigterm()
    try:
        truth = run_scenario(cfg)  # type: ignore[arg-type]
    except RuntimeError as e:
        print(f"stepscope scenario: {e}")
        return 1
    print(json.dumps({k: truth[k] for k in ("fault", "value", "onset", "start", "end", "requests_stored")}))
    return 0
