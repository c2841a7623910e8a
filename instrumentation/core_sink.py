"""The core process's event sink: `start_core_process(config, event_sink=CORE_SINK, extra={"telemetry":
config.to_dict()})` makes the core call `make_sink(options)` and hand it each step's drained events.

The step loop only appends the step's event list to a bounded queue (no lock, no wake-up, no
OpenTelemetry call); a background thread wakes every `poll_s` (0.25 s), turns the events into spans
(`StepTracer`) and leaves them to the SDK's batch processor. It wakes rarely on purpose: each wake
takes the GIL from the step loop, and on an oversubscribed machine getting it back can cost a
scheduler time slice. A full queue drops the step's events and counts them; the count is reported
in a log line and the `stepscope.telemetry.dropped` metric.
"""

from __future__ import annotations

import atexit
import collections
import sys
import threading
from collections.abc import Callable
from typing import Any

from engine.events import Event
from instrumentation.config import TelemetryConfig
from instrumentation.gpu import GpuSampler
from instrumentation.providers import Telemetry
from instrumentation.step_spans import StepTracer


class BackgroundSink:
    """Bounded hand-off from the step loop to a consumer thread. `sink(events)` never blocks."""

    def __init__(
        self, consume: Callable[[list[Event]], None], capacity_events: int, poll_s: float = 0.25
    ) -> None:
        self.consume, self.capacity, self.poll_s = consume, capacity_events, poll_s
        self.queue: collections.deque[list[Event]] = collections.deque()
        # Each counter has one writer (appended/dropped: the step loop; consumed: the worker), so
        # their difference is safe to read without a lock.
        self.appended = self.consumed = self.dropped = 0
        self.failed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stepscope-step-tracer", daemon=True)
        self._thread.start()

    def __call__(self, events: list[Event]) -> None:
        if self.appended - self.consumed + len(events) > self.capacity:
            self.dropped += len(events)
            return
        self.queue.append(events)
        self.appended += len(events)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._drain()
        self._drain()

    def _drain(self) -> None:
        while self.queue:
            events = self.queue.popleft()
            try:
                if not self.failed:
                    self.consume(events)
            except Exception:  # a tracing bug stops tracing, never the engine
                import traceback

                traceback.print_exc()
                print("stepscope telemetry: building spans failed; tracing stops", file=sys.stderr)
                self.failed = True
            self.consumed += len(events)

    def close(self, timeout_s: float = 5.0) -> None:
        """Build what is queued (up to `timeout_s`), then stop the thread."""
        self._stop.set()
        self._thread.join(timeout_s)


class CoreTelemetry:
    """Everything the core process runs for tracing: providers, the step tracer, its thread, the GPU
    sampler. `__call__` is the event sink."""

    def __init__(self, config: TelemetryConfig, telemetry: Telemetry, gpu: GpuSampler | None) -> None:
        self.telemetry, self.gpu, self.closed = telemetry, gpu, False
        self.tracer = StepTracer(telemetry, gpu=gpu.take_fresh if gpu else None)
        self.sink = BackgroundSink(self.tracer.consume, config.sink_capacity_events)
        telemetry.extra_dropped["events"] = lambda: self.sink.dropped
        if gpu is not None:
            gpu.register_gauges(telemetry.meter)
            gpu.start()

    def __call__(self, events: list[Event]) -> None:
        self.sink(events)

    def close(self, timeout_s: float = 5.0) -> None:
        """Build what is queued, flush, stop (once; also registered with atexit)."""
        if self.closed:
            return
        self.closed = True
        if self.gpu is not None:
            self.gpu.stop()
        self.sink.close(timeout_s)
        self.telemetry.shutdown(timeout_s)


def make_sink(options: dict[str, Any]) -> CoreTelemetry:
    """The factory `engine.core_proc` calls with its options (`options["telemetry"]`: TelemetryConfig
    as a dict). Flushes at process exit, within a bounded time."""
    config = TelemetryConfig(**(options.get("telemetry") or {}))
    if not config.endpoint and options.get("otlp_endpoint"):
        config.endpoint = options["otlp_endpoint"]
    telemetry = Telemetry.open(config, process="core")
    core = CoreTelemetry(config, telemetry, GpuSampler())
    atexit.register(core.close)
    return core
