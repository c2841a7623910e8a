"""The library API: run a workload against an OpenAI-compatible URL and return per-request records.

    from loadgen.runner import LoadSpec, RunOptions, run
    from loadgen.workloads import Workload, WorkloadConfig, WorkloadShift

    shift = WorkloadShift(start_s=30, prefix_change_fraction=0.5)
    wl = Workload.load("shared-prefix", WorkloadConfig(seed=1, shifts=(shift,)))
    result = run("http://127.0.0.1:8000", wl, LoadSpec(rate=4, duration_s=60), RunOptions(model="tiny"))
    result.records  # list[RequestRecord], in index order

Two ways to load a server:
- open loop (`rate`): requests leave on a seeded arrival schedule whatever the server does (optionally at
  most `max_concurrency` in flight); a shift's `rate_factor` changes the schedule's rate from its second on.
- closed loop (`concurrency`): C requests are always in flight; a new one leaves when one ends. A shift's
  `rate_factor` multiplies C from its second on.
- replay: a JSONL workload whose rows carry `timestamp` is sent at those offsets (`LoadSpec(replay=True)`).
Issuing stops at `duration_s` or after `num_requests`; requests in flight then get `drain_timeout_s` to end,
after which they are cancelled and recorded as `cancelled`. Setting `stop` ends a run early (Ctrl-C).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from opentelemetry.trace import Tracer

from loadgen.arrivals import ARRIVALS, arrival_times
from loadgen.client import RequestRecord, send_request
from loadgen.workloads import RequestSpec, Workload


@dataclass(slots=True)
class LoadSpec:
    """How hard to push: a `rate` (open loop), a `concurrency` (closed loop) or a timestamped `replay`;
    for `duration_s` seconds or `num_requests` requests (the first reached ends issuing)."""

    rate: float | None = None
    concurrency: int | None = None
    replay: bool = False
    arrival: str = "poisson"
    burstiness: float = 1.0
    duration_s: float | None = None
    num_requests: int | None = None
    max_concurrency: int | None = None  # open loop: cap on requests in flight

    def __post_init__(self) -> None:
        if sum((self.rate is not None, self.concurrency is not None, self.replay)) != 1:
            raise ValueError("give exactly one of rate, concurrency or replay")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.duration_s is None and self.num_requests is None and not self.replay:
            raise ValueError("give duration_s or num_requests")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("duration must be > 0")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"unknown arrival process {self.arrival!r}; choose one of {', '.join(ARRIVALS)}")
        if self.burstiness <= 0:
            raise ValueError("burstiness must be > 0")


@dataclass(slots=True)
class RunOptions:
    """Everything about a run that is not the load: model name, timeouts, seed, tracing."""

    model: str
    timeout_s: float = 300.0
    drain_timeout_s: float = 60.0
    seed: int = 0
    first_index: int = 0  # request indices start here (steps use fresh prompts, so no step warms the cache)
    tracer: Tracer | None = None


@dataclass(slots=True)
class Progress:
    """A snapshot for progress displays."""

    elapsed_s: float
    issued: int
    done: int
    errors: int
    in_flight: int


@dataclass(slots=True)
class RunResult:
    """The records of one run (index order), how long it took, and whether it was stopped early."""

    records: list[RequestRecord] = field(default_factory=list)
    elapsed_s: float = 0.0
    issue_s: float | None = None  # when issuing stopped (the measurement window); None: at the end
    start_unix_ns: int = 0
    interrupted: bool = False


class _Run:
    """State of one run: the clock, the client, the tasks in flight and the records."""

    def __init__(
        self, base_url: str, workload: Workload, opts: RunOptions, client: httpx.AsyncClient
    ) -> None:
        self.base_url, self.workload, self.opts, self.client = base_url, workload, opts, client
        self.t0 = time.perf_counter()
        self.records: list[RequestRecord] = []
        self.tasks: set[asyncio.Task] = set()
        self.done = self.errors = 0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def spawn(self, scheduled_s: float, sem: asyncio.Semaphore | None = None) -> None:
        index = self.opts.first_index + len(self.records)
        spec = self.workload.request(index, scheduled_s)
        rec = RequestRecord(
            index,
            spec.kind,
            spec.max_tokens,
            spec.prompt_tokens_est,
            scheduled_s,
            prefix_changed=spec.prefix_changed,
        )
        self.records.append(rec)
        task = asyncio.create_task(self._send(spec, rec, sem))
        self.tasks.add(task)
        task.add_done_callback(self._finished)

    async def _send(
        self, spec: RequestSpec, rec: RequestRecord, sem: asyncio.Semaphore | None
    ) -> RequestRecord:
        if sem is None:
            return await self._send_now(spec, rec)
        async with sem:
            return await self._send_now(spec, rec)

    async def _send_now(self, spec: RequestSpec, rec: RequestRecord) -> RequestRecord:
        o = self.opts
        return await send_request(
            self.client,
            self.base_url,
            spec,
            rec,
            model=o.model,
            t0=self.t0,
            timeout_s=o.timeout_s,
            tracer=o.tracer,
        )

    def _finished(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled():
            self.done += 1
            self.errors += task.exception() is not None or task.result().error is not None

    def snapshot(self) -> Progress:
        """Where the run stands, for progress displays."""
        return Progress(self.now(), len(self.records), self.done, self.errors, len(self.tasks))

    async def wait_any(self, stop: asyncio.Future, timeout: float | None) -> None:
        """Until a request ends, `stop` is set, or `timeout` passes."""
        await asyncio.wait({*self.tasks, stop}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)

    async def drain(self, stop: asyncio.Future, timeout_s: float) -> None:
        """Let requests in flight end (unless stopped), then cancel what is left."""
        deadline = self.now() + timeout_s
        while self.tasks and not stop.done() and self.now() < deadline:
            await self.wait_any(stop, deadline - self.now())
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def _issue_limit(load: LoadSpec, run: _Run) -> bool:
    over_count = load.num_requests is not None and len(run.records) >= load.num_requests
    over_time = load.duration_s is not None and run.now() >= load.duration_s
    return over_count or over_time


async def _closed_loop(run: _Run, load: LoadSpec, stop: asyncio.Future) -> None:
    shift_starts = sorted(s.start_s for s in run.workload.config.shifts)
    while not stop.done() and not _issue_limit(load, run):
        now = run.now()
        target = max(1, round(load.concurrency * run.workload.shift_at(now).rate_factor))  # type: ignore[operator]
        while len(run.tasks) < target and not _issue_limit(load, run):
            run.spawn(now)
        wakeups = [t - now for t in shift_starts if t > now]
        if load.duration_s is not None:
            wakeups.append(load.duration_s - now)
        await run.wait_any(stop, min(wakeups) if wakeups else None)


async def _open_loop(run: _Run, load: LoadSpec, stop: asyncio.Future) -> None:
    if load.replay:
        times = run.workload.replay_timestamps()
        if times is None:
            raise ValueError("replay needs a JSONL workload whose every row has a timestamp")
        if load.duration_s is not None:
            times = times[times < load.duration_s]
        times = times[: load.num_requests] if load.num_requests else times
    else:
        times = arrival_times(
            load.arrival,
            load.rate,  # type: ignore[arg-type]
            num_requests=load.num_requests,
            duration_s=load.duration_s,
            burstiness=load.burstiness,
            seed=run.opts.seed + run.opts.first_index,
            rate_changes=run.workload.rate_changes(),
        )
    sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    for t in times:
        delay = float(t) - run.now()
        if delay > 0:
            await asyncio.wait({stop}, timeout=delay)
        if stop.done():
            return
        run.spawn(float(t), sem)


async def run_load(
    base_url: str,
    workload: Workload,
    load: LoadSpec,
    opts: RunOptions,
    *,
    stop: asyncio.Event | None = None,
    progress: Callable[[Progress], None] | None = None,
    client: httpx.AsyncClient | None = None,
) -> RunResult:
    """Run `workload` at `load` against `base_url` (no `/v1`); see the module docstring."""
    stop = stop or asyncio.Event()
    own = client is None
    client = client or make_client(opts.timeout_s)
    stop_waiter = asyncio.ensure_future(stop.wait())
    run = _Run(base_url.rstrip("/"), workload, opts, client)
    start_unix_ns = time.time_ns()
    ticker = asyncio.create_task(_tick(run, progress)) if progress is not None else None
    issue_s = None
    try:
        loop = _open_loop if load.rate is not None or load.replay else _closed_loop
        await loop(run, load, stop_waiter)
        issue_s = _window(run, load, stop.is_set())
        await run.drain(stop_waiter, opts.drain_timeout_s)
    finally:
        stop_waiter.cancel()
        if ticker is not None:
            ticker.cancel()
        for t in run.tasks:  # an exception above: leave nothing running
            t.cancel()
        await asyncio.gather(*run.tasks, return_exceptions=True)
        if own:
            await client.aclose()
    for rec in run.records:
        if rec.error is None and rec.end_s is None:  # cancelled before it was sent
            rec.error, rec.error_detail = "cancelled", "cut before it was sent"
    if progress is not None:
        progress(run.snapshot())
    return RunResult(run.records, run.now(), issue_s, start_unix_ns, stop.is_set())


def _window(run: _Run, load: LoadSpec, stopped: bool) -> float | None:
    """The measurement window: the duration if it ended issuing, the moment of a stop, else the whole run."""
    if stopped:
        return run.now()
    count_reached = load.num_requests is not None and len(run.records) >= load.num_requests
    return load.duration_s if load.duration_s is not None and not count_reached else None


async def _tick(run: _Run, progress: Callable[[Progress], None], every_s: float = 0.5) -> None:
    while True:
        progress(run.snapshot())
        await asyncio.sleep(every_s)


def make_client(timeout_s: float) -> httpx.AsyncClient:
    """An HTTP client for load: no connection cap, no proxies from the environment (straight to the URL)."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=10.0, pool=None),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        trust_env=False,
    )


def run(base_url: str, workload: Workload, load: LoadSpec, opts: RunOptions) -> RunResult:
    """Blocking wrapper of `run_load` for callers without an event loop."""
    return asyncio.run(run_load(base_url, workload, load, opts))
