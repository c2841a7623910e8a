"""Typed events the core records as it runs, drained once per step by whoever observes it.

The core never imports OpenTelemetry: `instrumentation/` turns these into spans and metrics.
Timestamps are `time.monotonic_ns()`, taken once per event; observers convert them to epoch
time with one offset per process.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ScheduledChunk:
    """What one request got in one step."""

    req_id: str
    num_tokens: int  # tokens computed for it this step
    num_computed_before: int  # its tokens already in the cache before this step
    is_prefill: bool  # prompt (or recompute) tokens rather than one decode token
    sampled: bool  # a token was sampled for it at the end of this step
    trace_context: str = ""


@dataclass(slots=True)
class StepEvent:
    """One engine iteration: schedule -> forward -> sample."""

    step_id: int
    start_ns: int
    schedule_end_ns: int
    forward_end_ns: int
    end_ns: int
    prev_end_ns: int  # end of the previous step (0 for the first): the gap shows idle or stalled loops
    num_running: int
    num_waiting: int
    batch_size: int
    prefill_tokens: int
    decode_tokens: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_total: int
    preemptions: int
    prefix_cache_hit_tokens: int
    chunked_prefill: bool
    max_num_seqs: int
    max_num_batched_tokens: int
    weight_dtype: str
    kv_dtype: str
    bytes_read: int  # weights plus the KV cache read by attention, an estimate for the roofline
    # CPU time of the stepping thread over the step (time.thread_time_ns): against the wall time, a step
    # that waited for a core (contention) shows wall up at equal CPU; slower compute shows CPU up.
    cpu_ns: int = 0
    scheduled: list[ScheduledChunk] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)


@dataclass(slots=True)
class RequestEvent:
    """A request's life-cycle moment. `kind`: arrived | scheduled | preempted | finished."""

    kind: str
    req_id: str
    ts_ns: int
    trace_context: str = ""
    # filled on "finished":
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    arrival_ns: int = 0
    first_scheduled_ns: int = 0
    first_token_ns: int = 0
    last_token_ns: int = 0
    itl_sum_ns: int = 0
    itl_max_ns: int = 0
    itl_count: int = 0
    prefix_key: str = ""  # hex hash of the first full prompt block


@dataclass(slots=True)
class KVTransferEvent:
    """One request's KV transfer as one side of a disaggregated pair saw it (docs/disagg.md).
    `side`: send (prefill) or receive (decode)."""

    side: str
    req_id: str
    start_ns: int
    end_ns: int
    trace_context: str
    kv_bytes: int
    num_blocks: int
    bandwidth_bytes_per_s: float
    peer: str = ""
    error: str = ""
    kind: str = "kv_transfer"


Event = StepEvent | RequestEvent | KVTransferEvent


class EventBuffer:
    """Bounded buffer: a full buffer drops and counts, never blocks the step loop."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self.events: list[Event] = []
        self.dropped = 0

    def append(self, event: Event) -> None:
        if len(self.events) >= self.capacity:
            self.dropped += 1
            return
        self.events.append(event)

    def drain(self) -> list[Event]:
        out, self.events = self.events, []
        return out
