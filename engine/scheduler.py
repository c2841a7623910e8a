"""Continuous batching at step level, chunked prefill, preemption by recompute; and the static baseline.

Every step the scheduler hands out a token budget (`max_num_batched_tokens`) to at most
`max_num_seqs` sequences: running ones first (so decodes are never starved by prefills), then
waiting ones in arrival order. A long prompt takes at most `long_prefill_token_threshold` tokens
per step, so it cannot starve the short requests queued behind it.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import KVCacheManager
from engine.config import EngineConfig
from engine.request import RequestOutput
from engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerOutput:
    """What runs this step: each sequence with how many of its pending tokens to compute."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # left the waiting queue this step
    prefix_hit_tokens: int = 0

    @property
    def empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(
        self, config: EngineConfig, kv: KVCacheManager, max_model_len: int, eos_token_id: int | None
    ) -> None:
        self.config = config
        self.eos_token_id = eos_token_id
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.finished_outputs: list[RequestOutput] = []  # aborts waiting to be reported
        self.num_preemptions_total = 0
        # Disaggregated serving (engine/disagg, docs/disagg.md); both hold blocks, so both are live.
        self.handed_off: dict[str, Sequence] = {}  # prefill side: first token sampled, KV still to send
        self.remote: dict[str, Sequence] = {}  # decode side: blocks reserved, KV arriving from a prefill

    # -- admission ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, req_id: str) -> Sequence | None:
        if req_id in self.handed_off:  # already reported as finished: only its blocks are left
            self.release_handoff(req_id)
            return None
        seq = self.remote.pop(req_id, None)
        if seq is not None:
            self._finish(seq, "abort")  # frees the reserved blocks
            return seq
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.req_id == req_id:
                    queue.remove(seq)
                    self._finish(seq, "abort")
                    return seq
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def prefill_chunk_cap(self) -> int:
        cap = self.config.long_prefill_token_threshold
        return cap if cap > 0 else max(self.config.max_num_batched_tokens // 2, self.kv.block_size)

    # -- scheduling --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.config.scheduling == "static":
            return self._schedule_static()
        return self._schedule_continuous()

    def _schedule_continuous(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill
        for seq in list(self.running):
            if seq not in self.running or budget <= 0:
                continue  # preempted earlier in this loop, or out of budget
            num_new = seq.num_tokens - seq.num_computed_tokens
            if chunked:
                num_new = min(num_new, budget, self.prefill_chunk_cap if num_new > 1 else 1)
            elif num_new > budget:
                continue
            if not self._reserve(seq, num_new, out):
                continue
            out.scheduled.append((seq, num_new))
            budget -= num_new
        if out.preempted:
            return out  # memory is tight: admit nobody new this step
        self._admit_waiting(out, budget)
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        chunked = self.config.enable_chunked_prefill
        full_budget = budget == self.config.max_num_batched_tokens
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            hit_blocks, hit_tokens = self.kv.get_computed_blocks(seq)
            num_new = seq.num_tokens - hit_tokens
            if chunked:
                num_new = min(num_new, budget, self.prefill_chunk_cap)
            elif num_new > budget and not (full_budget and not out.scheduled):
                break  # without chunking a prompt runs whole; one too big for any budget runs alone
            if not self.kv.allocate_slots(seq, num_new, hit_blocks):
                break
            self.waiting.popleft()
            self._start(seq, hit_tokens, out)
            out.prefix_hit_tokens += hit_tokens
            out.scheduled.append((seq, num_new))
            budget -= num_new

    def _start(self, seq: Sequence, hit_tokens: int, out: SchedulerOutput) -> None:
        if seq.num_cached_tokens < 0:  # first admission, not a resume after preemption
            seq.num_cached_tokens = hit_tokens
            self.kv.record_lookup(seq.num_prompt_tokens, hit_tokens)
        if seq.timings.first_scheduled_ns == 0:
            seq.timings.first_scheduled_ns = time.monotonic_ns()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        out.admitted.append(seq)

    def _reserve(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Find blocks for a running sequence, preempting the newest running ones if needed."""
        while not self.kv.allocate_slots(seq, num_new):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute preemption: drop the blocks, go back to the front of the queue."""
        self.running.remove(seq)
        out.scheduled = [(s, n) for s, n in out.scheduled if s is not seq]
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _schedule_static(self) -> SchedulerOutput:
        """Fixed batches: admit a batch only when the last one has fully finished; no chunking.

        Prompts are left-padded to the batch's longest (`Sequence.num_pad_tokens`): the pads are
        computed in the prefill and hold KV that every decode step reads past, as in a padded
        `generate()`. Finished members keep their slot and keep decoding (outputs discarded) until the
        longest one ends.
        """
        out = SchedulerOutput()
        if self.running and all(s.batch_done for s in self.running):
            for seq in self.running:
                self.kv.free(seq)
            self.running.clear()
        if not self.running:
            self._admit_static_batch(out)
            return out
        for seq in list(self.running):
            num_new = seq.num_tokens - seq.num_computed_tokens
            if seq.batch_done and seq.num_tokens >= self.max_model_len:
                continue  # padding never runs past the context
            if seq in self.running and self._reserve(seq, num_new, out):
                out.scheduled.append((seq, num_new))
        return out

    def _admit_static_batch(self, out: SchedulerOutput) -> None:
        """The next fixed batch: the first waiting sequences whose padded prompts all fit in the pool."""
        batch: list[Sequence] = []
        width = 0  # the longest prompt so far: every member is padded to it
        for seq in itertools.islice(self.waiting, self.config.max_num_seqs):
            wider = max(width, seq.num_tokens)
            if (len(batch) + 1) * self.kv.blocks_needed(wider) > self.kv.num_free_blocks:
                break
            batch.append(seq)
            width = wider
        for seq in batch:
            seq.num_pad_tokens = width - seq.num_tokens
            self.kv.allocate_slots(seq, seq.num_tokens)
            self.waiting.popleft()
            self._start(seq, 0, out)
            out.scheduled.append((seq, seq.num_tokens))

    # -- after the forward pass --------------------------------------------------------------
    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[Sequence, int], now_ns: int
    ) -> list[RequestOutput]:
        """Advance each scheduled sequence; append sampled tokens; finish those that are done."""
        outputs, self.finished_outputs = self.finished_outputs, []
        for seq, num_new in out.scheduled:
            seq.num_computed_tokens += num_new
            token = sampled.get(seq)
            if token is None:
                self.kv.cache_full_blocks(seq)
                continue
            seq.token_ids.append(token)
            self.kv.cache_full_blocks(seq)
            if seq.batch_done:
                continue
            seq.record_token(now_ns)
            reason = self._stop_reason(seq, token) or ("handoff" if seq.prefill_only else None)
            if reason:
                self._finish(seq, reason, now_ns)
            outputs.append(self._output(seq, [token]))
        return outputs

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        sp = seq.sampling
        if not sp.ignore_eos and token == self.eos_token_id:
            return "stop"
        if token in sp.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= sp.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str, now_ns: int = 0) -> None:
        seq.finish_reason = reason
        seq.timings.finished_ns = now_ns or time.monotonic_ns()
        if self.config.scheduling == "static" and reason != "abort" and seq in self.running:
            seq.batch_done = True  # keeps its slot until the batch ends
        elif reason == "handoff":  # keeps its blocks until its KV is copied out (`release_handoff`)
            self.running.remove(seq)
            self.handed_off[seq.req_id] = seq
        else:
            if seq in self.running:
                self.running.remove(seq)
            self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        if reason == "abort":
            self.finished_outputs.append(self._output(seq, []))

    def _output(self, seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        return RequestOutput(
            req_id=seq.req_id,
            new_token_ids=new_tokens,
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=max(seq.num_cached_tokens, 0),
            num_preemptions=seq.num_preemptions,
            timings=seq.timings,
        )

    def live_sequences(self) -> list[Sequence]:
        return [*self.running, *self.waiting, *self.handed_off.values(), *self.remote.values()]

    # -- disaggregated serving (docs/disagg.md) ----------------------------------------------
    def release_handoff(self, req_id: str) -> None:
        """Prefill side: the handed-off sequence's KV has been copied out; free its blocks."""
        seq = self.handed_off.pop(req_id, None)
        if seq is not None:
            self.kv.free(seq)

    def reserve_remote(self, seq: Sequence) -> bool:
        """Decode side: blocks for `seq`'s whole prompt, whose KV a prefill worker computes. False when
        the pool or `max_num_seqs` has no room now (the caller retries later)."""
        if len(self.running) + len(self.remote) >= self.config.max_num_seqs:
            return False
        if not self.kv.allocate_slots(seq, seq.num_prompt_tokens):
            return False
        seq.num_cached_tokens = max(seq.num_cached_tokens, 0)
        self.remote[seq.req_id] = seq
        return True

    def commit_remote(self, req_id: str, first_token: int, now_ns: int) -> RequestOutput:
        """Decode side: the prompt's KV is in the reserved blocks; run on from the first token."""
        seq = self.remote.pop(req_id)
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.token_ids.append(first_token)
        self.kv.cache_full_blocks(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        seq.record_token(now_ns)
        reason = self._stop_reason(seq, first_token)
        if reason:
            self._finish(seq, reason, now_ns)
        return self._output(seq, [first_token])
