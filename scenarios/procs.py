"""The processes of a scenario: `stepscope collector` and `stepscope serve` as subprocesses.

Each is a `stepscope.procs.Proc`: its own session (so a Ctrl-C in the terminal reaches only the runner, whose
`finally` stops them), a log file in the run directory, SIGTERM then SIGKILL after a timeout.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from instrumentation.providers import DEFAULT_SERVICE_NAME
from scenarios.fleet import tree
from stepscope.procs import Proc, free_port

if TYPE_CHECKING:
    from scenarios.config import ScenarioConfig


# The cores this process could use when it started: split between the harness and the engine under test.
_ALL_CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def core_split() -> tuple[set[int], set[int]] | None:
    """(harness cores, engine cores): the engine's step loops get the upper half of the cores (at least
    one) to themselves; the collector, the load generator, the front ends and the runner share the rest.
    None where there are fewer than two cores to split (or no affinity to set)."""
    if len(_ALL_CORES) < 2:
        return None
    half = len(_ALL_CORES) // 2
    return set(_ALL_CORES[:half]), set(_ALL_CORES[half:])


def isolates(cfg: ScenarioConfig) -> bool:
    """Whether a run of `cfg` splits the cores: asked for (`isolate_cores`), two cores or more, and an
    engine core for each replica. Three replicas' step loops pinned to one core wait for each other: a
    replica's step time then follows its peers' load, which a fleet of one device per replica never sees
    (the isolated fleets of a full grid on two cores: routing and cache faults named wrong or not at all,
    load average 4-13). Such a fleet shares every core with the harness instead."""
    split = core_split()
    return cfg.isolate_cores and split is not None and len(split[1]) >= cfg.replicas


# The collector's niceness where the cores are not split (a fleet on two cores): the store's inserts and
# merges then run when the engines' processes leave a core idle, instead of taking a share of every core
# from them. On two cores a healthy 3-replica run gave the collector a third to a half of a core, rising
# with the store's merges over the run, and the replicas' steps slowed with it: at nice 0 a dev healthy
# fleet run read step time at equal batch x1.22 ("contention") and TPOT P50 x1.3 between its halves.
HARNESS_NICE = 10


def harness_nice(isolate: bool) -> int:
    """The collector's niceness for a run that does (`isolates`) or does not split the cores."""
    return 0 if isolate else HARNESS_NICE


def isolate_harness(isolate: bool = True) -> Callable[[], None]:
    """Pin this process, and so every process it starts from now on, to the harness cores; returns what
    puts it back on the cores it had (call it when the run's processes are stopped). The store's inserts
    and merges, the load generator and the front ends then never run on the cores that step the engine: on
    a small machine they otherwise slow the steps by a third from time to time, a "slower compute" that no
    healthy run should show. A no-op where `isolate` is False or there is nothing to split."""
    split = core_split()
    if not isolate or split is None:
        return lambda: None
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, split[0])
    return lambda: os.sched_setaffinity(0, before)


def pin_engine_cores(server_pid: int) -> list[int]:
    """Move the engine core processes under `server_pid` (every thread of each) to the engine cores and the
    rest of its processes (the front end, a fleet's router and replicas' front ends) to the harness cores;
    the core pids moved. Where no core process is found nothing moves, and the server keeps every core."""
    split = core_split()
    if split is None:
        return []
    cores, others = [], []
    for pid in tree(server_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        (cores if b"engine.core_proc" in argv else others).append(pid)  # `python -m engine.core_proc`
    if not cores:
        return []
    for pids, where in ((cores, split[1]), (others, split[0])):
        for pid in pids:
            for tid in _threads(pid):
                try:
                    os.sched_setaffinity(tid, where)
                except OSError:  # a thread that has just ended
                    continue
    return cores


def _on_every_core(start: Callable[[], Proc]) -> Proc:
    """`start()` with this process on every core it could use at first, so that what it starts inherits
    them; then back on the cores it had."""
    if not _ALL_CORES:
        return start()
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(_ALL_CORES))
    try:
        return start()
    finally:
        os.sched_setaffinity(0, before)


def engine_cores() -> set[int] | None:
    """The cores the engine's step loops run on (None: not isolated)."""
    split = core_split()
    return split[1] if split else None


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def start_server(
    cfg: ScenarioConfig, log: Path, token: str, otlp: str | None, port: int | None = None
) -> tuple[Proc, str]:
    """`stepscope serve` with the scenario's engine; (process, base URL) once healthy, its core processes
    on the engine cores when the run splits them (`isolates`, `pin_engine_cores`). Its service.instance.id
    is its host:port, the instance name a scrape of its /metrics gets."""
    port = port or free_port()
    args = ["serve", *cfg.engine_args(), "--port", str(port), "--admin-token", token]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    if otlp:
        args += ["--otlp-endpoint", otlp, "--trace-steps-every", "1" if cfg.step_spans else "0"]
        env |= {"OTEL_BSP_SCHEDULE_DELAY": "500", "OTEL_METRIC_EXPORT_INTERVAL": "2000"}
        env["OTEL_RESOURCE_ATTRIBUTES"] = f"service.instance.id={engine_instance(port)}"
    proc = _on_every_core(lambda: Proc(args, log, env))  # where its core cannot be pinned, it keeps them
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(url + "/health", 300)
        if isolates(cfg) and not pin_engine_cores(proc.pid):
            cfg.log("scenario: warning: no engine core process found to pin; the engine shares the cores")
    except BaseException:
        proc.stop()
        raise
    return proc, url


def engine_instance(port: int) -> str:
    """The instance name of the scenario's engine on `port`, in its spans and in its scraped samples."""
    return f"127.0.0.1:{port}"


def start_collector(
    store: Path, log: Path, scrape_port: int | None = None, scrape_interval_s: float = 1.0
) -> tuple[Proc, str]:
    """`stepscope collector` on chDB in `store`; (process, base URL) once healthy. With `scrape_port`, it
    scrapes the engine's /metrics there as service stepscope-engine (the engine's service.name)."""
    proc, url = launch_collector(store, log, scrape_port, scrape_interval_s)
    try:
        proc.wait_http(url + "/health", COLLECTOR_START_S)
    except BaseException:
        proc.stop()
        raise
    return proc, url


COLLECTOR_START_S = 120.0


def launch_collector(
    store: Path, log: Path, scrape_port: int | None = None, scrape_interval_s: float = 1.0, nice: int = 0
) -> tuple[Proc, str]:
    """`start_collector` without the wait: the engine can boot beside it (a collector takes 2-3 s to
    come up, an engine 4-5 s). Wait for it with `proc.wait_http(url + "/health", COLLECTOR_START_S)`
    before the first span matters; the engine's exporters retry until it answers. `nice`: the collector's
    scheduling niceness (`harness_nice`)."""
    port = free_port()
    args = ["collector", "--store", f"chdb://{store}", "--port", str(port), "--log-level", "warning"]
    if scrape_port is not None:
        config = log.with_name("scrape.toml")
        config.write_text(
            f'scrape_interval = "{scrape_interval_s:g}s"\n\n[[scrape]]\n'
            f'url = "http://127.0.0.1:{scrape_port}/metrics"\n'
            f'instance = "{engine_instance(scrape_port)}"\nservice = "{DEFAULT_SERVICE_NAME}"\n'
        )
        args += ["--config", str(config)]
    proc = Proc(args, log)
    if nice:
        lower_priority(proc.pid, nice)
    return proc, f"http://127.0.0.1:{port}"


def lower_priority(pid: int, nice: int) -> None:
    """Give the process `pid`, just started in a session of its own, the niceness `nice`: its main
    thread's (set before the interpreter starts a thread, so every thread it makes inherits it) and, where
    the kernel groups each session for scheduling (autogroup), its session's, without which a process's
    niceness only orders the threads of its own session against each other."""
    os.setpriority(os.PRIO_PROCESS, pid, nice)
    with contextlib.suppress(OSError):  # no autogroup (or not Linux): the thread niceness is what there is
        Path(f"/proc/{pid}/autogroup").write_text(f"{nice}\n")


def count_rows(collector_url: str, table: str, http: httpx.Client | None = None) -> int:
    """Rows in a table, through the collector's read-only SQL API (-1 when it does not answer); `http`, a
    client to reuse (one made per call loads the TLS trust store)."""
    body = {"sql": f"SELECT count() FROM {table}"}
    try:
        if http is None:
            r = httpx.post(f"{collector_url}/api/sql", json=body, timeout=10)
        else:
            r = http.post(f"{collector_url}/api/sql", json=body)
        return int(r.json()["rows"][0][0]) if r.status_code == 200 else -1
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return -1


def wait_flushed(collector_url: str, timeout_s: float = 60.0, quiet_s: float = 3.0) -> int:
    """The rows in `requests` once what the collector acknowledged is stored; call it after the engines
    have stopped (their exporters flush on the way out). Done when /health shows nothing spooled and
    `requests` kept its count between two polls; a collector that does not say what it has spooled is
    waited for until the count stops growing for `quiet_s`. Returns the count (-1: no answer)."""
    deadline, last, since = time.monotonic() + timeout_s, -2, time.monotonic()
    with httpx.Client(timeout=10, trust_env=False) as http:
        while time.monotonic() < deadline:
            n = count_rows(collector_url, "requests", http)
            drained = _spooled(http, collector_url) == 0
            if n != last:
                last, since = n, time.monotonic()
            elif n >= 0 and (drained or time.monotonic() - since >= quiet_s):
                break
            time.sleep(0.2 if drained else 0.5)
    return last


def _spooled(http: httpx.Client, collector_url: str) -> int | None:
    """The collector's spooled batches, from /health (None: it did not say)."""
    try:
        r = http.get(f"{collector_url}/health")
        return int(r.json()["spooled_batches"]) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def warm_up(url: str, model: str) -> None:
    """Two short requests before the run: the first steps of a fresh process are slow."""
    for prompt in ("warm up " * 40, "hello"):
        body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        httpx.post(url + "/v1/completions", json=body, timeout=120, trust_env=False)


# A process of another program that only burns CPU: what a noisy neighbour on the engine's cores does.
_BUSY = "while True: pass"


def start_neighbours(n: int, cores: set[int] | None = None) -> list[subprocess.Popen]:
    """Start `n` busy processes (each in its own session) on `cores` (this process's cores when None):
    real contention for the engine's CPU, the engine itself untouched. Stop them with `stop_neighbours`."""
    if cores is None and hasattr(os, "sched_getaffinity"):
        cores = os.sched_getaffinity(0)
    procs = []
    try:
        for _ in range(n):
            p = subprocess.Popen(
                [sys.executable, "-c", _BUSY],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            procs.append(p)
            if cores:
                os.sched_setaffinity(p.pid, cores)
    except BaseException:
        stop_neighbours(procs)
        raise
    return procs


def stop_neighbours(procs: list[subprocess.Popen]) -> None:
    """Kill the busy processes `start_neighbours` started and reap them."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()
    procs.clear()
