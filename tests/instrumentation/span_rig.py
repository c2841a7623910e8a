"""In-process tracing rig (a helper; the fixture is in conftest.py): the front end's RequestTracer and
the core's StepTracer around a real EngineCore, both exporting to one InMemorySpanExporter via the SDK."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine.config import EngineConfig, SamplingParams
from engine.core import EngineCore
from engine.request import EngineRequest
from instrumentation.config import TelemetryConfig
from instrumentation.providers import Telemetry
from instrumentation.request_spans import RequestTrace, RequestTracer
from instrumentation.step_spans import StepTracer


@dataclass
class Rig:
    telemetry: Telemetry
    exporter: InMemorySpanExporter
    metrics: InMemoryMetricReader
    requests: RequestTracer
    steps: StepTracer
    traces: dict[str, RequestTrace] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)

    def run(
        self,
        core: EngineCore,
        prompts: list[list[int]],
        sampling: SamplingParams,
        traceparent: str | None = None,
        abort: set[int] = frozenset(),
    ) -> list[list[int]]:
        """Serve `prompts` as the front end would, building spans from the core's events."""
        ids = []
        for prompt in prompts:
            rid, arrival = f"req-{len(self.traces)}", time.monotonic_ns()
            rt = self.requests.start(
                rid, arrival, traceparent, model="tiny", operation="text_completion",
                max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                prompt_ids=prompt, block_size=core.config.block_size,
            )  # fmt: skip
            self.traces[rid], self.tokens[rid] = rt, []
            req = EngineRequest(rid, prompt, sampling, arrival_ns=arrival, trace_context=rt.traceparent)
            core.add_request(req)
            ids.append(rid)
        for i in abort:
            core.abort_request(ids[i])
        while core.has_unfinished_requests():
            for out in core.step():
                self.traces[out.req_id].observe(out)
                self.tokens[out.req_id] += out.new_token_ids
                if out.finished:
                    self.requests.finish(self.traces[out.req_id], out.finish_reason)
            self.steps.consume(core.drain_events())
        return [self.tokens[rid] for rid in ids]

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if name is None or s.name == name]


def make_rig(head_sampler=None, **config) -> Rig:
    exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    telemetry = Telemetry(TelemetryConfig(model="tiny", **config), exporter, [reader], batch=False)
    return Rig(telemetry, exporter, reader, RequestTracer(telemetry, head_sampler), StepTracer(telemetry))


def tiny_core(**kw) -> EngineCore:
    return EngineCore(EngineConfig(model="tiny", num_threads=1, **kw), record_events=True)
