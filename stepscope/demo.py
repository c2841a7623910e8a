"""`stepscope demo`: watch stepscope find a root cause, everything local and embedded.

    stepscope demo [--duration S] [--fault NAME[=VALUE]] [--no-dashboard] [--model M] [--rate RPS] [--out DIR]

1. sizes a steady load to this machine (the scenario runner's calibration, cached for 2 h);
2. starts the collector on chDB in the demo directory, the engine exporting OTLP to it, and the dashboard;
3. runs the steady load; near the end of its healthy part, measures TTFT P99 and arms an alert rule
   (`alerting.AlertRunner`, threshold `alert_factor` x that P99) whose webhook is a receiver in this process;
4. switches the fault on after the healthy part (default: a prefix-cache miss), prints the alert when it fires
   with the findings it carries, and after the load the diagnosis with its evidence and lever;
5. with the dashboard, keeps the collector and the dashboard up until Ctrl-C.

Processes, the load and the fault are the scenario runner's (`scenarios.runner`, docs/faults.md); each
child runs in its own session with its log in the demo directory, and Ctrl-C (or SIGTERM) stops them all.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import secrets
import signal
import sys
import time
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

from stepscope.cli import UsageError
from stepscope.demo_alert import AlertWatch, ttft_since

HEALTH_PATH = "/_stcore/health"  # Streamlit's


@dataclass(slots=True)
class DemoConfig:
    """One demo run. Every default lives here; the CLI is built from it."""

    out: Path
    duration_s: float | None = None  # of load; None: sized to the rate (`timeline`)
    fault: str = "prefix_cache_miss"
    value: float | None = None  # None: the fault's default
    # tiny: a step takes about a millisecond, so even a busy 2-core machine runs several requests a second
    # and each side holds hundreds (with `small`, a busy machine gets a few dozen in minutes); the prefix
    # cache, prefill and queueing behave the same, only faster. `--model small` for heavier steps.
    model: str = "tiny"
    rate: float | None = None  # requests/s; None: the scenario runner's fraction of the calibrated capacity
    dashboard: bool = True
    dashboard_port: int = 8501  # a free port is taken when this one is busy (or 0)
    onset_fraction: float = 0.5  # of a given --duration: when the fault goes on
    # Sized by rate: at least this long healthy and faulty, and long enough for `side_requests` each, up
    # to `max_side_s`. The P99 test needs 50 a side; the mean prompt length of the bimodal mixed workload
    # (a rule's "unchanged prompt lengths" test) wanders x1.27 between halves of 45 requests, so 80.
    # At ~1.4 requests/s: 60 s + 60 s, about 4 minutes in all.
    healthy_s: float = 60.0
    fault_s: float = 60.0
    side_requests: int = 80
    max_side_s: float = 150.0
    drain_s: float = 60.0  # requests in flight at the end may finish (cut ones would skew prompt lengths)
    progress_every_s: float = 10.0
    arm_at: float = 0.9  # of the healthy part: when the healthy TTFT P99 is measured and the rule armed
    # Threshold = alert_factor x the healthy TTFT P99. The P99 of a minute of healthy traffic is about its
    # slowest request, so 1.5x stays clear of healthy noise, while a fault worth paging for (the default
    # prefix-cache miss: TTFT P99 x3 in the scenario runs) crosses it.
    alert_factor: float = 1.5
    alert_fallback_s: float = 2.0  # threshold when the healthy part had too few requests to measure
    alert_min_healthy: int = 20
    # The alert attaches a diagnosis of [breach - interval, firing] against as long before: `for` plus an
    # interval must hold 30+ requests at the demo's ~1.4 requests/s for the regression tests to speak.
    alert_interval: str = "10s"
    alert_window: str = "60s"
    alert_for: str = "20s"

    def __post_init__(self) -> None:
        if self.duration_s is not None and not self.duration_s >= 20:
            raise ValueError(f"--duration must be at least 20 seconds, got {self.duration_s:g}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"--rate must be positive, got {self.rate:g}")
        if not 0 <= self.dashboard_port < 65536:
            raise ValueError(
                f"--dashboard-port must be 0-65535 (0: any free port), got {self.dashboard_port}"
            )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for the DemoConfig fields a newcomer may want to change."""
    d = DemoConfig(out=Path("."))
    parser.add_argument(
        "--duration",
        metavar="S",
        help=f"seconds of load (default: {d.healthy_s + d.fault_s:g}, longer when "
        f"the machine is slow: {d.side_requests} requests before and after the fault)",
    )
    parser.add_argument(
        "--fault", default=d.fault, metavar="NAME[=VALUE]",
        help="switched on after the healthy part (default: %(default)s; list: stepscope scenario list)",
    )  # fmt: skip
    parser.add_argument("--no-dashboard", action="store_true", help="no dashboard; exit when the run ends")
    parser.add_argument("--dashboard-port", default=str(d.dashboard_port), metavar="PORT")
    parser.add_argument("--model", default=d.model, help="engine model preset or checkpoint (%(default)s)")
    parser.add_argument("--rate", metavar="RPS", help="requests/s (default: sized to this machine)")
    parser.add_argument("--out", metavar="DIR", help="demo directory (default: ./stepscope-demo/<time>)")


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    """The DemoConfig the flags describe; UsageError on bad input."""
    from scenarios.faults import parse_fault

    try:
        fault, value = parse_fault(args.fault)
        out = Path(args.out or Path("stepscope-demo") / datetime.now().strftime("%Y%m%d-%H%M%S"))
        cfg = DemoConfig(
            out=out.resolve(),
            duration_s=_number("--duration", args.duration) if args.duration is not None else None,
            fault=fault,
            value=value,
            model=args.model,
            rate=_number("--rate", args.rate) if args.rate is not None else None,
            dashboard=not args.no_dashboard,
            dashboard_port=int(_number("--dashboard-port", args.dashboard_port)),
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    if (cfg.out / "store").exists():
        raise UsageError(f"--out: {cfg.out} already holds a run (store/); choose a new directory")
    return cfg


def _number(flag: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{flag}: expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{flag}: expected a finite number, got {text!r}")
    return value


def say(text: str = "") -> None:
    """One line of the demo's output (children log to files; this is all the terminal shows)."""
    print(text, flush=True)


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 when it completed, 130 when interrupted before that."""
    cfg = config_from_args(args)
    cfg.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        filename=cfg.out / "demo.log",
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    # Ctrl-C even when started with SIGINT ignored (a background job of a script); SIGTERM the same way.
    previous = (
        signal.signal(signal.SIGTERM, _interrupt),
        signal.signal(signal.SIGINT, signal.default_int_handler),
    )
    demo = Demo(cfg)
    try:
        demo.run()
        if cfg.dashboard:
            demo.hold()
        return 0
    except KeyboardInterrupt:
        say("\ninterrupted: stopping everything the demo started")
        return 0 if demo.finished else 130
    except RuntimeError as e:  # a child that would not start or died: its log's tail is in the message
        print(f"stepscope demo: {e}\n(logs in {cfg.out})", file=sys.stderr, flush=True)
        return 1
    finally:
        demo.close()
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


class Demo:
    """The processes, the load, the alert and the diagnosis of one demo run."""

    def __init__(self, cfg: DemoConfig) -> None:
        from scenarios.config import ScenarioConfig

        self.cfg = cfg
        self.scenario = ScenarioConfig(
            out=cfg.out, fault=cfg.fault, value=cfg.value, model=cfg.model, rate=cfg.rate,
            drain_timeout_s=cfg.drain_s,
            isolate_cores=False,  # a demo shows the engine as it runs on the user's machine
            log=_scenario_line,
        )  # fmt: skip
        self.procs: list[Any] = []
        self.alert: AlertWatch | None = None
        self.collector_url = self.dashboard_url = ""
        self.finished = False

    # --- phases ---------------------------------------------------------------------------------------
    def run(self) -> None:
        cfg, sc = self.cfg, self.scenario
        say(f"stepscope demo: the {cfg.model} engine under steady load, then a fault: {cfg.fault}={sc.value}")
        logs = "collector.log, server.log" + (", dashboard.log" if cfg.dashboard else "")
        say(f"  files: {cfg.out}  ({logs}, rules.toml, alerts.jsonl, demo.log)")
        rate = self._rate()
        sc.duration_s, sc.onset_s = timeline(cfg, rate)
        if cfg.duration_s is None and rate * cfg.max_side_s < cfg.side_requests:
            say(f"  this machine is busy or slow: {rate * cfg.max_side_s:.0f} requests a side in "
                f"{cfg.max_side_s:g}s, fewer than the {cfg.side_requests} the diagnosis wants; "
                "`--model tiny` is lighter")  # fmt: skip
        self._start(rate)
        token = self._token
        run = asyncio.run(self._load(rate, token))
        done = run["summary"]
        say(f"\n[4/5] load done: {done['completed']} of {done['issued']} requests completed; flushing spans")
        self.procs[1].stop()  # the engine: its exporters flush on the way out
        from scenarios.procs import wait_flushed

        stored = wait_flushed(self.collector_url)
        say(f"  {stored} requests stored")
        if self.alert is not None:
            self.alert.finish()
        self._diagnose(run["start"], time.time(), run["onset"])
        self.finished = True

    def _rate(self) -> float:
        from scenarios.calibrate import capacity

        sc = self.scenario
        if sc.rate is not None:
            say(f"\n[1/5] load: {sc.rate:g} requests/s (--rate)")
            return sc.rate
        say("\n[1/5] sizing a steady load to this machine")
        cap = capacity(replace(sc, out=sc.out / "calibrate"))
        rate = round(sc.load_fraction * cap, 3)
        say(f"  capacity {cap:.2f} requests/s; the demo runs at {sc.load_fraction:.0%} of it: {rate:g}/s")
        return rate

    def _start(self, rate: float) -> None:
        from scenarios.procs import COLLECTOR_START_S, launch_collector, start_server, warm_up
        from stepscope.procs import Proc, free_port

        cfg, sc = self.cfg, self.scenario
        parts = (
            "the collector (chDB), the engine and the dashboard"
            if cfg.dashboard
            else "the collector (chDB) and the engine"
        )
        say(f"\n[2/5] starting {parts}")
        collector, self.collector_url = launch_collector(cfg.out / "store", cfg.out / "collector.log")
        self.procs.append(collector)  # it boots beside the engine
        self._token = secrets.token_hex(16)
        server, self.engine_url = start_server(sc, cfg.out / "server.log", self._token, self.collector_url)
        self.procs.append(server)
        collector.wait_http(self.collector_url + "/health", COLLECTOR_START_S)
        say(f"  collector  {self.collector_url}  store chdb://{cfg.out / 'store'}")
        say(f"  engine     {self.engine_url}  (stepscope serve {' '.join(sc.engine_args())})")
        if cfg.dashboard:
            port = (
                cfg.dashboard_port if cfg.dashboard_port and _port_free(cfg.dashboard_port) else free_port()
            )
            dash = Proc(
                ["dashboard", "--api", self.collector_url, "--port", str(port)], cfg.out / "dashboard.log"
            )
            self.procs.append(dash)
            self.dashboard_url = f"http://127.0.0.1:{port}"
            dash.wait_http(self.dashboard_url + HEALTH_PATH, 120)
            say(f"  dashboard  {self.dashboard_url}  (open it now to watch the run)")
        warm_up(self.engine_url, sc.model)

    async def _load(self, rate: float, token: str) -> dict[str, Any]:
        from scenarios.runner import Undo, drive, undo_all

        sc = self.scenario
        say(f"\n[3/5] steady load: {rate:g} requests/s for {sc.duration_s:g}s, {sc.fault} at {sc.onset:g}s")
        stop = asyncio.Event()
        t0 = time.time()
        watcher = asyncio.create_task(self._watch(t0, stop))
        undo: list[Undo] = []  # what the fault started (busy processes of a noisy neighbour)
        try:
            return await drive(sc, self.engine_url, token, rate, stop, undo)
        except asyncio.CancelledError:
            stop.set()
            raise
        finally:
            stop.set()
            undo_all(undo)
            await asyncio.gather(watcher, return_exceptions=True)

    async def _watch(self, t0: float, stop: asyncio.Event) -> None:
        """Every `progress_every_s`: the last interval's TTFT from the collector; arm the alert on time."""
        from collector.client import ApiReader

        cfg, sc = self.cfg, self.scenario
        reader = ApiReader(self.collector_url, timeout_s=20)
        arm_at = t0 + sc.onset * cfg.arm_at
        next_line = t0 + cfg.progress_every_s
        try:
            while not stop.is_set():
                wake = min(next_line, arm_at) if self.alert is None else next_line
                try:
                    await asyncio.wait_for(stop.wait(), max(wake - time.time(), 0.05))
                    return
                except TimeoutError:
                    pass
                now = time.time()
                if self.alert is None and now >= arm_at:
                    self.alert = await asyncio.to_thread(self._arm, reader, t0)
                if now >= next_line:
                    await asyncio.to_thread(self._progress, reader, t0, now)
                    next_line += cfg.progress_every_s
        finally:
            reader.close()

    def _arm(self, reader: Any, t0: float) -> AlertWatch:
        cfg = self.cfg
        n, _, p99 = ttft_since(reader, t0)
        if n >= cfg.alert_min_healthy and p99:
            threshold = max(math.ceil(cfg.alert_factor * p99 * 100) / 100, 0.01)
            why = f"{cfg.alert_factor:g} x the healthy TTFT P99 of {p99:.2f}s over {n} requests"
        else:
            threshold, why = cfg.alert_fallback_s, f"too few healthy requests ({n}) to measure; a fixed value"
        watch = AlertWatch(
            self.collector_url, threshold, cfg.out, printer=say, why=why,
            interval=cfg.alert_interval, window=cfg.alert_window, hold=cfg.alert_for,
        ).start()  # fmt: skip
        say(f"  alert rule armed: TTFT P99 > {threshold:g}s over {watch.window}, for {watch.hold}"
            f"  ({why}; {cfg.out / 'rules.toml'})")  # fmt: skip
        return watch

    def _progress(self, reader: Any, t0: float, now: float) -> None:
        n, p50, p99 = ttft_since(reader, now - self.cfg.progress_every_s)
        phase = "fault on" if now - t0 >= self.scenario.onset else "healthy"
        ttft = f"TTFT P50 {p50:.2f}s  P99 {p99:.2f}s" if n else "no requests finished"
        state = f"  alert {self.alert.state()}" if self.alert is not None else ""
        say(f"  {now - t0:5.0f}s  {phase:8}  {n:3d} requests  {ttft}{state}")
        if self.alert is not None and n:
            self.alert.peak = max(self.alert.peak, p99)

    def _diagnose(self, start: float, end: float, onset: float | None) -> None:
        from collector.client import open_reader
        from diagnosis import TimeRange, diagnose, render

        say("\n[5/5] diagnosis: the whole run, no baseline given (stepscope finds the change point itself)")
        source = open_reader(url=self.collector_url)
        try:
            result = diagnose(source, window=TimeRange(start, end))
        finally:
            source.close()
        text = render(result, "text")
        say("\n".join("  " + line for line in text.splitlines() if not line.lstrip().startswith("sql:")))
        findings = result.to_json()["findings"]
        truth = f"{self.cfg.fault} switched on at {_clock(onset)}" if onset else self.cfg.fault
        top = findings[0]["cause"] if findings else "nothing"
        say(f"\n  injected: {truth}; top finding: {top}")
        say(
            f"  the same from a shell: stepscope diagnose --api {self.collector_url} "
            f"--from {start:.0f} --to {end:.0f}"
        )

    def hold(self) -> None:
        """Keep the collector and the dashboard up until Ctrl-C."""
        say(f"\ndashboard: {self.dashboard_url}   collector API: {self.collector_url}")
        say("  the collector and the dashboard stay up; try `stepscope query --list` with --api above.")
        say("  Ctrl-C stops them.")
        while True:
            time.sleep(3600)

    def close(self) -> None:
        """Stop the alert runner and every process started, newest first."""
        if self.alert is not None:
            self.alert.close()
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()


def timeline(cfg: DemoConfig, rate: float) -> tuple[float, float]:
    """(load duration, fault onset) in seconds from the start of the load."""
    if cfg.duration_s is not None:
        return cfg.duration_s, round(cfg.duration_s * cfg.onset_fraction, 1)
    need = min(cfg.side_requests / rate, cfg.max_side_s)
    healthy, fault = math.ceil(max(cfg.healthy_s, need)), math.ceil(max(cfg.fault_s, need))
    return healthy + fault, healthy


def _scenario_line(text: str) -> None:
    """The scenario runner's log lines, in the demo's words."""
    text = text.split(": ", 1)[-1]
    say("  >>> fault on: " + text.removeprefix("onset: ") if text.startswith("onset: ") else "  " + text)


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%H:%M:%S")
