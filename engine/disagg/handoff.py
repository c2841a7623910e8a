"""The engine-core side of disaggregated serving: prefill-only requests and remote-KV requests.

Prefill worker                                   Decode worker
  add_prefill_only(core, req)                      reserve_remote(core, req) -> block ids | None
  core.step() ... first token sampled:             write_remote_kv(core, req_id, first_block, blocks)
    finish_reason "handoff", blocks kept             (as frames arrive, between steps)
  newly_full_blocks / read_kv -> the KV link       commit_remote(core, req_id, first_token, ...)
  release_handoff(core, req_id)                      -> running with num_computed_tokens = prompt

Both sides keep the scheduler's invariants: handed-off and reserved sequences are live (they hold
blocks), `core.abort_request` frees either, and `core.check_invariants()` holds throughout.
"""

from __future__ import annotations

import time

from engine.disagg.kv_wire import LayerBlocks, read_blocks, write_blocks
from engine.events import RequestEvent
from engine.request import EngineRequest, RequestOutput
from engine.sequence import Sequence

# RequestEvent kind of a decode worker's request that starts running on received KV: the tracer opens
# the request there (no queue span: its queue was on the prefill worker).
COMMITTED = "committed"


def add_prefill_only(core: object, req: EngineRequest) -> None:
    """Queue `req` to run until its first token is sampled, then hand off (finish_reason "handoff")
    keeping its blocks. A first token that ends the request (EOS, max_tokens 1) finishes it here."""
    core.add_request(req)
    core.scheduler.waiting[-1].prefill_only = True


def prefill_sequences(core: object) -> dict[str, Sequence]:
    """Prefill-only sequences that hold KV now: running ones and handed-off ones."""
    live = {s.req_id: s for s in core.scheduler.running if s.prefill_only}
    live.update(core.scheduler.handed_off)
    return live


def num_sendable_blocks(seq: Sequence, block_size: int) -> int:
    """Leading blocks whose KV is final: full computed blocks, and after the handoff the partial last one."""
    if seq.finished:
        return -(-seq.num_prompt_tokens // block_size)
    return seq.num_computed_tokens // block_size


def read_kv(core: object, seq: Sequence, first: int, end: int) -> list[LayerBlocks]:
    """Copies of blocks [first, end) of `seq`'s block table, every layer."""
    return read_blocks(core.runner.kv_caches, seq.block_table[first:end])


def release_handoff(core: object, req_id: str) -> None:
    """The handed-off request's KV has been copied out: free its blocks."""
    core.scheduler.release_handoff(req_id)


def reserve_remote(core: object, req: EngineRequest) -> list[int] | None:
    """Reserve blocks for a request whose prompt KV comes from a prefill worker; None when there is no
    room now. Raises ValueError if it can never fit."""
    n, max_len, pool = len(req.prompt_token_ids), core.model_config.max_model_len, core.kv.num_blocks
    if not 0 < n < max_len:
        raise ValueError(f"prompt of {n} tokens does not fit the context of {max_len}")
    if core.kv.blocks_needed(n + 1) > pool:
        raise ValueError(f"prompt of {n} tokens needs more KV blocks than the pool has ({pool})")
    seq = Sequence.from_request(req)
    if not core.scheduler.reserve_remote(seq):
        return None
    return list(seq.block_table)


def write_remote_kv(core: object, req_id: str, first_block: int, blocks: list[LayerBlocks]) -> None:
    """Write received blocks [first_block, first_block + n) of a reserved request into its blocks.
    KeyError if the request is not reserved; KVWireError if the blocks do not fit."""
    seq = core.scheduler.remote[req_id]
    n, reserved = blocks[0][0].shape[1], len(seq.block_table)
    if first_block + n > reserved:
        raise ValueError(f"KV blocks {first_block}..{first_block + n} past the {reserved} reserved")
    write_blocks(core.runner.kv_caches, seq.block_table[first_block : first_block + n], blocks)


def commit_remote(
    core: object, req_id: str, first_token: int, first_scheduled_ns: int, num_cached_tokens: int
) -> RequestOutput:
    """The reserved request's prompt KV is complete: it runs on from `first_token` (emitted now)."""
    seq = core.scheduler.remote[req_id]
    seq.timings.first_scheduled_ns = first_scheduled_ns
    seq.num_cached_tokens = num_cached_tokens  # the prefill worker's prefix-cache hits
    now_ns = time.monotonic_ns()
    out = core.scheduler.commit_remote(req_id, first_token, now_ns)
    if core.record_events:
        core.events.append(RequestEvent(COMMITTED, req_id, now_ns, seq.trace_context))
        if seq.finished:
            core.events.append(core._finished_event(seq))
    return out
