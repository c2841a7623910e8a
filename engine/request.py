"""What goes into the engine core and what comes out of it, per request.

These plain dataclasses are the contract between the core (scheduler, runner) and whatever
drives it: the offline `LLM` helper, or the core process that the HTTP front end talks to.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import SamplingParams


@dataclass(slots=True)
class EngineRequest:
    """A tokenized request handed to the core. `arrival_ns` is `time.monotonic_ns()` at the front end."""

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_ns: int = 0
    cache_salt: str = ""  # joins the prefix-cache hash: requests with different salts never share blocks
    trace_context: str = ""  # W3C traceparent of the request span, carried for the instrumentation


@dataclass(slots=True)
class RequestTimings:
    """Monotonic-ns timestamps of a request's life in the core, filled as it goes."""

    arrival_ns: int = 0
    first_scheduled_ns: int = 0
    first_token_ns: int = 0
    last_token_ns: int = 0
    finished_ns: int = 0


@dataclass(slots=True)
class RequestOutput:
    """New tokens of one request from one step. `finished` once, with the reason and the summary."""

    req_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS or stop token), "length", "abort"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    timings: RequestTimings = field(default_factory=RequestTimings)
