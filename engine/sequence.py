"""A request inside the engine core: its tokens, its blocks, its progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from engine.config import SamplingParams
from engine.request import EngineRequest, RequestTimings


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's state. `token_ids` holds the prompt followed by every generated token.

    Progress is one number, `num_computed_tokens`: tokens whose K/V are in the cache. A step
    computes some of `token_ids[num_computed_tokens:]`; when it reaches the end, a token is sampled.
    A prompt chunk, a decode step and a recompute after preemption are all the same move.
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    cache_salt: str = ""
    trace_context: str = ""
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks, in order
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens from the prefix cache at first admission (-1: not yet)
    num_preemptions: int = 0
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    timings: RequestTimings = field(default_factory=RequestTimings)
    itl_sum_ns: int = 0  # inter-token gaps, summarised here instead of a span per token
    itl_max_ns: int = 0
    itl_count: int = 0
    batch_done: bool = False  # static mode: finished, but its slot runs on (padding) until the batch ends
    # Static mode: pad tokens left of the prompt in the KV cache, to the batch's longest prompt. Token i
    # lives at cache position num_pad_tokens + i but keeps rotary position i; attention masks the pads.
    num_pad_tokens: int = 0
    prefill_only: bool = False  # disaggregated prefill worker: hand off after the first token

    @classmethod
    def from_request(cls, req: EngineRequest) -> Sequence:
        seq = cls(
            req_id=req.req_id,
            token_ids=list(req.prompt_token_ids),
            num_prompt_tokens=len(req.prompt_token_ids),
            sampling=req.sampling,
            cache_salt=req.cache_salt,
            trace_context=req.trace_context,
        )
        seq.timings.arrival_ns = req.arrival_ns
        return seq

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_prefill(self) -> bool:
        """Still computing prompt tokens (or recomputing after preemption)."""
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def record_token(self, now_ns: int) -> None:
        t = self.timings
        if t.first_token_ns == 0:
            t.first_token_ns = now_ns
        else:
            gap = now_ns - t.last_token_ns
            self.itl_sum_ns += gap
            self.itl_max_ns = max(self.itl_max_ns, gap)
            self.itl_count += 1
        t.last_token_ns = now_ns
