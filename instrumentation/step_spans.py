"""The core's half: phase spans under each `llm_request`, and `engine.step` spans linked to requests.

`StepTracer(telemetry).consume(events)` turns the events the core drained (engine/events.py) into
spans with explicit start and end times (monotonic ns + one epoch offset). It runs in-process in
tests; under `stepscope serve` it runs in the exporter process (`instrumentation.exporter_proc`), on
the events the core hands over through `instrumentation.core_sink`.

    llm_request (front end, SERVER)            engine.step (one per iteration, 1-in-N)
      queue     arrival -> scheduled             engine.step.schedule  start -> schedule end
      prefill   per chunk: schedule end of       engine.step.forward   schedule end -> forward end
                its step -> end of its step      engine.step.sample    forward end -> step end
      decode    first token -> last token        links: every request served (tokens it got)

A request preempted and resumed gets a second `queue` span (preemption -> rescheduled) and more
`prefill` spans (the recompute), as they happen. Requests the front end did not head-sample (flags
00 in their traceparent) have their phase spans held until they finish and kept only when slow or
aborted, mirroring the front end's tail decision.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags

from engine.events import Event, KVTransferEvent, RequestEvent, ScheduledChunk, StepEvent
from instrumentation import attributes as A
from instrumentation.providers import Telemetry

_PhaseSpec = tuple[str, int, int, dict[str, object]]  # name, start ns, end ns (monotonic), attributes


def parse_traceparent(value: str) -> SpanContext | None:
    """A W3C traceparent (version 00) as a remote SpanContext; None when absent or malformed."""
    parts = value.split("-") if value else ()
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16 or len(parts[3]) != 2:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags))


@dataclass(slots=True)
class _Request:
    parent: SpanContext
    context: object  # the parent as an OpenTelemetry Context, built once
    queue_start_ns: int
    after_preemption: bool = False
    chunk_index: int = 0
    held: list[_PhaseSpec] | None = None  # not head-sampled: spans wait for the tail decision
    recompute: bool = False


class StepTracer:
    """Builds spans from engine events. Not thread-safe: one consumer calls `consume`.
    `gpu()`: counters not yet attached to a step span (GpuSampler.take_fresh), or None."""

    def __init__(
        self, telemetry: Telemetry, gpu: Callable[[], dict[str, float] | None] | None = None
    ) -> None:
        self.telemetry, self.gpu = telemetry, gpu
        self.config = telemetry.config
        self.tracer = telemetry.tracer("stepscope.core")
        self.requests: dict[str, _Request] = {}  # requests with a trace context, until they finish

    def consume(self, events: list[Event]) -> None:
        """Build the spans these events describe, in order."""
        for ev in events:
            if isinstance(ev, StepEvent):
                self._step(ev)
            elif ev.kind in ("arrived", "committed"):  # committed: a decode worker's request (docs/disagg.md)
                self._arrived(ev)
            elif ev.kind == "scheduled":
                self._scheduled(ev)
            elif ev.kind == "preempted":
                self._preempted(ev)
            elif ev.kind == "finished":
                self._finished(ev)
            elif ev.kind == "kv_transfer":
                self._kv_transfer(ev)

    # -- requests ------------------------------------------------------------------------------
    def _arrived(self, ev: RequestEvent) -> None:
        parent = parse_traceparent(ev.trace_context)
        if parent is None:
            return  # no llm_request to hang phases on (a request nobody traced)
        held = None if parent.trace_flags.sampled else []
        ctx = trace.set_span_in_context(NonRecordingSpan(parent))
        queue_start = ev.ts_ns if ev.kind == "arrived" else -1  # committed: it queued on the prefill worker
        self.requests[ev.req_id] = _Request(parent, ctx, queue_start, held=held)

    def _scheduled(self, ev: RequestEvent) -> None:
        req = self.requests.get(ev.req_id)
        if req is None or req.queue_start_ns < 0:
            return
        attrs = {A.QUEUE_AFTER_PREEMPTION: True} if req.after_preemption else {}
        self._phase(req, (A.SPAN_QUEUE, req.queue_start_ns, ev.ts_ns, attrs))
        req.queue_start_ns = -1

    def _preempted(self, ev: RequestEvent) -> None:
        req = self.requests.get(ev.req_id)
        if req is not None:
            req.queue_start_ns, req.after_preemption, req.recompute = ev.ts_ns, True, True

    def _finished(self, ev: RequestEvent) -> None:
        req = self.requests.pop(ev.req_id, None)
        if req is None:
            return
        if req.queue_start_ns >= 0:  # aborted while waiting
            self._phase(req, (A.SPAN_QUEUE, req.queue_start_ns, ev.ts_ns, {}))
        if ev.first_token_ns and ev.finish_reason != "handoff":  # a prefill worker decodes nothing
            attrs = {
                A.DECODE_TOKENS: max(ev.num_output_tokens - 1, 0),
                A.ITL_COUNT: ev.itl_count,
                A.TPOT_MAX_S: ev.itl_max_ns / 1e9,
            }
            if ev.itl_count:
                attrs[A.TPOT_MEAN_S] = ev.itl_sum_ns / ev.itl_count / 1e9
            self._phase(req, (A.SPAN_DECODE, ev.first_token_ns, ev.last_token_ns, attrs))
        if req.held:
            slow = (ev.ts_ns - ev.arrival_ns) / 1e9 > self.config.slow_request_s
            if slow or ev.finish_reason == "abort":
                for spec in req.held:
                    self._build(req, spec)

    def _kv_transfer(self, ev: KVTransferEvent) -> None:
        """A KV transfer (engine/events.py's KVTransferEvent), one span per side under llm_request.
        Kept when the request was head-sampled (the transfer may outlive the prefill side's request)."""
        parent = parse_traceparent(ev.trace_context)
        if parent is None or not parent.trace_flags.sampled:
            return
        attrs = {
            A.KV_TRANSFER_SIDE: ev.side,
            A.KV_TRANSFER_BYTES: ev.kv_bytes,
            A.KV_TRANSFER_BLOCKS: ev.num_blocks,
            A.KV_TRANSFER_BANDWIDTH: ev.bandwidth_bytes_per_s,
        }
        if ev.peer:
            attrs[A.KV_TRANSFER_PEER] = ev.peer
        to_epoch = self.config.to_epoch_ns
        ctx = trace.set_span_in_context(NonRecordingSpan(parent))
        span = self.tracer.start_span(
            A.SPAN_KV_TRANSFER, context=ctx, attributes=attrs, start_time=to_epoch(ev.start_ns)
        )
        if ev.error:
            span.set_status(Status(StatusCode.ERROR, ev.error))
        span.end(end_time=to_epoch(max(ev.end_ns, ev.start_ns)))

    def _phase(self, req: _Request, spec: _PhaseSpec) -> None:
        if req.held is None:
            self._build(req, spec)
        else:
            req.held.append(spec)

    def _build(self, req: _Request, spec: _PhaseSpec) -> None:
        name, start_ns, end_ns, attrs = spec
        to_epoch = self.config.to_epoch_ns
        span = self.tracer.start_span(
            name, context=req.context, attributes=attrs, start_time=to_epoch(start_ns)
        )
        span.end(end_time=to_epoch(max(end_ns, start_ns)))

    # -- steps ---------------------------------------------------------------------------------
    def _step(self, ev: StepEvent) -> None:
        for chunk in ev.scheduled:
            if chunk.is_prefill:
                self._prefill_chunk(ev, chunk)
        if self.config.steps_every and ev.step_id % self.config.steps_every == 0:
            self._step_spans(ev)

    def _prefill_chunk(self, ev: StepEvent, chunk: ScheduledChunk) -> None:
        req = self.requests.get(chunk.req_id)
        if req is None:
            return
        attrs = {
            A.CHUNK_INDEX: req.chunk_index,
            A.CHUNK_TOKENS: chunk.num_tokens,
            A.PREFILL_COMPUTED_BEFORE: chunk.num_computed_before,
            A.STEP_ID: ev.step_id,
        }
        if req.recompute:
            attrs[A.PREFILL_RECOMPUTE] = True
            req.recompute = not chunk.sampled  # the recompute ends with the step that samples again
        req.chunk_index += 1
        # From the end of scheduling to the end of the step: the last chunk ends at the first token.
        self._phase(req, (A.SPAN_PREFILL, ev.schedule_end_ns, ev.end_ns, attrs))

    def _step_spans(self, ev: StepEvent) -> None:
        to_epoch = self.config.to_epoch_ns
        links = []
        for chunk in ev.scheduled:
            req = self.requests.get(chunk.req_id)
            parent = req.parent if req is not None else parse_traceparent(chunk.trace_context)
            if parent is not None:
                link_attrs = {A.LINK_TOKENS: chunk.num_tokens, A.LINK_IS_PREFILL: chunk.is_prefill}
                links.append(Link(parent, link_attrs))
        step = self.tracer.start_span(
            A.SPAN_STEP,
            context=_ROOT,
            attributes=self._step_attributes(ev),
            links=links,
            start_time=to_epoch(ev.start_ns),
        )
        ctx = trace.set_span_in_context(step)
        for name, start, end in (
            (A.SPAN_STEP_SCHEDULE, ev.start_ns, ev.schedule_end_ns),
            (A.SPAN_STEP_FORWARD, ev.schedule_end_ns, ev.forward_end_ns),
            (A.SPAN_STEP_SAMPLE, ev.forward_end_ns, ev.end_ns),
        ):
            child = self.tracer.start_span(name, context=ctx, start_time=to_epoch(start))
            child.end(end_time=to_epoch(max(start, end)))
        step.end(end_time=to_epoch(ev.end_ns))

    def _step_attributes(self, ev: StepEvent) -> dict[str, object]:
        attrs: dict[str, object] = {
            A.STEP_ID: ev.step_id,
            A.STEP_NUM_RUNNING: ev.num_running,
            A.STEP_NUM_WAITING: ev.num_waiting,
            A.STEP_BATCH_SIZE: ev.batch_size,
            A.STEP_PREFILL_TOKENS: ev.prefill_tokens,
            A.STEP_DECODE_TOKENS: ev.decode_tokens,
            A.STEP_KV_BLOCKS_USED: ev.kv_blocks_used,
            A.STEP_KV_BLOCKS_FREE: ev.kv_blocks_free,
            A.STEP_KV_BLOCKS_TOTAL: ev.kv_blocks_total,
            A.STEP_PREEMPTIONS: ev.preemptions,
            A.STEP_PREFIX_HIT_TOKENS: ev.prefix_cache_hit_tokens,
            A.STEP_WEIGHT_DTYPE: ev.weight_dtype,
            A.STEP_KV_DTYPE: ev.kv_dtype,
            A.STEP_CHUNKED_PREFILL: ev.chunked_prefill,
            A.STEP_MAX_NUM_SEQS: ev.max_num_seqs,
            A.STEP_MAX_NUM_BATCHED_TOKENS: ev.max_num_batched_tokens,
            A.STEP_GAP_S: (ev.start_ns - ev.prev_end_ns) / 1e9 if ev.prev_end_ns else 0.0,
            A.STEP_BYTES_READ: ev.bytes_read,
            A.STEP_SAMPLED_EVERY: self.config.steps_every,
        }
        if ev.cpu_ns:
            attrs[A.STEP_CPU_S] = ev.cpu_ns / 1e9
        if self.gpu is not None:
            counters = self.gpu()
            if counters:
                attrs.update(counters)
        return attrs


# engine.step spans start their own traces: a step serves many requests, so it links to them
# rather than belonging to any one of them.
_ROOT = trace.set_span_in_context(trace.INVALID_SPAN)
