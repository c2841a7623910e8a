"""The engine core: scheduler -> model runner -> sampler, one `step()` at a time.

    core = EngineCore(EngineConfig(model="tiny"))
    core.add_request(EngineRequest("r1", token_ids, SamplingParams(max_tokens=8, temperature=0)))
    while core.has_unfinished_requests():
        for out in core.step():            # RequestOutput: new tokens, finished, finish_reason
            ...
    core.drain_events()                    # StepEvent / RequestEvent, when record_events=True

Runtime knobs (`EngineConfig.runtime_fields()`) change between steps through `update_limits`.
The core imports no OpenTelemetry; with `record_events=False` it records nothing at all.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from engine import kernels
from engine.block_manager import KVCacheManager
from engine.config import EngineConfig, ModelConfig, preset
from engine.device import resolve_device
from engine.events import Event, EventBuffer, RequestEvent, ScheduledChunk, StepEvent
from engine.kernels.cpu import cpu_info
from engine.kv_cache import kv_cache_bytes_per_block
from engine.model_runner import ModelRunner
from engine.packed import native_linear_rows, pack_model, packing_available
from engine.quant import (
    dequantize_model,
    is_quantized,
    quantize_model,
    resolve_model_dtype,
    restore_modules,
    streamed_weight_bytes,
)
from engine.request import EngineRequest, RequestOutput
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer, get_tokenizer

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def load_model(
    config: EngineConfig, device: torch.device, dtype: torch.dtype
) -> tuple[ModelConfig, torch.nn.Module]:
    """A named preset with seeded random weights, or a Hugging Face checkpoint directory."""
    from engine.loader import is_checkpoint_dir, load_checkpoint
    from engine.model import build_model

    if is_checkpoint_dir(config.model):
        return load_checkpoint(config.model, device, dtype)
    model_config = preset(config.model)
    model_config.seed = config.seed
    return model_config, build_model(model_config, device, dtype)


def kv_block_bytes(config: EngineConfig, model_config: ModelConfig, model_dtype: torch.dtype) -> int:
    """Bytes of one KV block across layers in the configured KV dtype (int8 counts its scales); the pool
    is `kv_cache_bytes` // this when `num_kv_blocks` is 0."""
    kv_dtype = torch.int8 if config.kv_dtype == "int8" else model_dtype
    return kv_cache_bytes_per_block(model_config, config.block_size, kv_dtype)


def _pick_linear_kernels(model: torch.nn.Module, config: EngineConfig) -> None:
    """With `--weight-packing`, float32 CPU linears get their weights reordered once at load: into the
    native kernel's panels (`--kernels auto`, where the library builds), taken up to a row count set by the
    CPU's vector unit, `F.linear` above; else into oneDNN's blocked layout."""
    if not config.weight_packing:
        return
    native = kernels.linear() if config.kernels == "auto" else None
    if native is not None:
        pack_model(
            model, onednn=False, native=native, native_max_rows=native_linear_rows(cpu_info().kernel_isa)
        )
    elif packing_available():
        pack_model(model)


class EngineCore:
    def __init__(self, config: EngineConfig, record_events: bool = False) -> None:
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_model_dtype(config.dtype, config.weight_dtype, self.device)
        self.model_config, model = load_model(config, self.device, self.dtype)
        if config.weight_dtype == "int8":
            quantize_model(model)
        cpu_fp32 = self.device.type == "cpu" and self.dtype == torch.float32
        if cpu_fp32:
            _pick_linear_kernels(model, config)
        self.tokenizer: Tokenizer = get_tokenizer(config.model, self.model_config.vocab_size)
        kv_int8 = config.kv_dtype == "int8"
        block_bytes = kv_block_bytes(config, self.model_config, self.dtype)
        num_blocks = config.num_kv_blocks or max(config.kv_cache_bytes // block_bytes, 1)
        self.config.num_kv_blocks = num_blocks
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.runner = ModelRunner(
            model,
            self.model_config,
            num_blocks,
            config.block_size,
            self.device,
            self.dtype,
            kv_int8,
            native=config.kernels == "auto",
        )
        eos = self.model_config.eos_token_id
        self.scheduler = Scheduler(config, self.kv, self.model_config.max_model_len, eos)
        self.block_bytes = block_bytes
        self.kv_dtype = "int8" if kv_int8 else DTYPE_NAMES.get(self.dtype, str(self.dtype))
        self._full_precision_swap: dict[str, torch.nn.Module] = {}
        self._account_weights()
        self.record_events = record_events
        self.events = EventBuffer()
        self.step_id = 0
        self.last_step_tokens = 0  # tokens the latest step scheduled (reported with its stats)
        self._prev_end_ns = 0

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        """Queue a tokenized request. Raises ValueError if it can never run."""
        n = len(req.prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.model_config.max_model_len:
            raise ValueError(
                f"prompt of {n} tokens does not fit the context of {self.model_config.max_model_len}"
            )
        if self.kv.blocks_needed(n + 1) > self.kv.num_blocks:
            raise ValueError(
                f"prompt of {n} tokens needs more KV blocks than the pool has ({self.kv.num_blocks})"
            )
        if not req.arrival_ns:
            req.arrival_ns = time.monotonic_ns()
        seq = Sequence.from_request(req)
        self.scheduler.add(seq)
        if self.record_events:
            self.events.append(RequestEvent("arrived", seq.req_id, req.arrival_ns, seq.trace_context))

    def abort_request(self, req_id: str) -> None:
        seq = self.scheduler.abort(req_id)
        if seq is not None and self.record_events:
            self.events.append(self._finished_event(seq))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work or bool(self.scheduler.finished_outputs)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return sum(1 for s in self.scheduler.running if not s.batch_done)

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model, sample, update. Returns this step's outputs."""
        start_ns, cpu_start_ns = time.monotonic_ns(), time.thread_time_ns()
        sched = self.scheduler.schedule()
        schedule_end_ns = time.monotonic_ns()
        self.last_step_tokens = sched.num_tokens
        if sched.empty:
            return self.scheduler.update_from_output(sched, {}, schedule_end_ns)
        result = self.runner.execute(sched)
        end_ns = time.monotonic_ns()
        before = {seq: seq.num_computed_tokens for seq, _ in sched.scheduled} if self.record_events else None
        outputs = self.scheduler.update_from_output(sched, result.sampled, end_ns)
        if self.record_events:
            times = (start_ns, schedule_end_ns, result.forward_end_ns, end_ns)
            self._record_step(sched, result.sampled, before, *times, time.thread_time_ns() - cpu_start_ns)
        self._prev_end_ns = end_ns
        self.step_id += 1
        return outputs

    def drain_events(self) -> list[Event]:
        return self.events.drain()

    # -- runtime knobs -----------------------------------------------------------------------
    def update_limits(self, **changes: object) -> dict[str, object]:
        """Change runtime knobs between steps; all-or-nothing. Returns the current values."""
        allowed = EngineConfig.runtime_fields()
        unknown = sorted(set(changes) - set(allowed))
        if unknown:
            raise ValueError(f"not a runtime knob: {', '.join(unknown)}; allowed: {', '.join(allowed)}")
        new = dataclasses.replace(self.config, **changes)  # validates via __post_init__
        if new.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if new.num_kv_blocks != self.kv.num_blocks:
            self.runner.grow_kv_cache(new.num_kv_blocks)
            self.kv.pool.resize(new.num_kv_blocks)
        for name in allowed:
            setattr(self.config, name, getattr(new, name))
        return self.limits()

    def set_weights_full_precision(self, on: bool) -> None:
        """Serve an int8 model from full-precision weights (`on`) or back from its int8 ones; between steps.

        The `weight_quant_off` fault (engine/faults.py): the int8 weights are dequantized into full-size
        Linears in the model dtype, as if the wrong checkpoint had been loaded; the int8 modules are kept
        aside and put back exactly when the fault clears. Raises ValueError to turn it on for a model that
        was never quantized.
        """
        if on and not self._full_precision_swap:
            if not is_quantized(self.runner.model):
                raise ValueError(
                    "weight_quant_off needs an engine serving int8 weights (--weight-dtype int8)"
                )
            self._full_precision_swap = dequantize_model(self.runner.model, self.dtype)
        elif not on and self._full_precision_swap:
            restore_modules(self.runner.model, self._full_precision_swap)
            self._full_precision_swap = {}
        self._account_weights()

    def _account_weights(self) -> None:
        """weight_dtype and the weight bytes one step streams (the embedding table only by the row)."""
        model = self.runner.model
        self.weight_dtype = "int8" if is_quantized(model) else DTYPE_NAMES.get(self.dtype, str(self.dtype))
        embed = model.model.embed_tokens
        tied = model.lm_head.weight is embed.weight
        self.weight_bytes = streamed_weight_bytes(model, exclude=() if tied else (embed,))
        self.embed_row_bytes = 0 if tied else embed.weight[0].numel() * embed.weight.element_size()

    def limits(self) -> dict[str, object]:
        return {name: getattr(self.config, name) for name in EngineConfig.runtime_fields()}

    def stats(self) -> dict[str, float | int]:
        total = self.kv.num_blocks
        used = self.kv.pool.num_used
        return {
            "running": self.num_running,
            "waiting": self.num_waiting,
            "kv_blocks_used": used,
            "kv_blocks_free": self.kv.num_free_blocks,
            "kv_blocks_total": total,
            "kv_usage": min(used / total, 1.0),
            "prefix_cache_queries": self.kv.prefix_queries,
            "prefix_cache_hits": self.kv.prefix_hits,
            "preemptions_total": self.scheduler.num_preemptions_total,
            "events_dropped": self.events.dropped,
        }

    def check_invariants(self) -> None:
        """Block-pool accounting matches the live sequences (tests call this)."""
        self.kv.check_invariants(self.scheduler.live_sequences())

    # -- events ------------------------------------------------------------------------------
    def _record_step(
        self,
        sched: SchedulerOutput,
        sampled: dict[Sequence, int],
        before: dict[Sequence, int],
        start_ns: int,
        schedule_end_ns: int,
        forward_end_ns: int,
        end_ns: int,
        cpu_ns: int = 0,
    ) -> None:
        chunks = []
        prefill = decode = ctx_tokens = 0
        for seq, n in sched.scheduled:
            done = before[seq]
            is_prefill = n > 1 or done < seq.num_prompt_tokens
            chunks.append(ScheduledChunk(seq.req_id, n, done, is_prefill, seq in sampled, seq.trace_context))
            prefill += n if is_prefill else 0
            decode += 0 if is_prefill else n
            ctx_tokens += done + n
        for seq in sched.admitted:
            self.events.append(RequestEvent("scheduled", seq.req_id, schedule_end_ns, seq.trace_context))
        for seq in sched.preempted:
            self.events.append(RequestEvent("preempted", seq.req_id, schedule_end_ns, seq.trace_context))
        self.events.append(
            StepEvent(
                step_id=self.step_id,
                start_ns=start_ns,
                schedule_end_ns=schedule_end_ns,
                forward_end_ns=forward_end_ns,
                end_ns=end_ns,
                prev_end_ns=self._prev_end_ns,
                num_running=self.num_running,
                num_waiting=self.num_waiting,
                batch_size=len(sched.scheduled),
                prefill_tokens=prefill,
                decode_tokens=decode,
                kv_blocks_used=self.kv.pool.num_used,
                kv_blocks_free=self.kv.num_free_blocks,
                kv_blocks_total=self.kv.num_blocks,
                preemptions=len(sched.preempted),
                prefix_cache_hit_tokens=sched.prefix_hit_tokens,
                chunked_prefill=self.config.enable_chunked_prefill,
                max_num_seqs=self.config.max_num_seqs,
                max_num_batched_tokens=self.config.max_num_batched_tokens,
                weight_dtype=self.weight_dtype,
                kv_dtype=self.kv_dtype,
                bytes_read=self._bytes_read(prefill + decode, ctx_tokens),
                cpu_ns=cpu_ns,
                scheduled=chunks,
                preempted_req_ids=[s.req_id for s in sched.preempted],
            )
        )
        for seq, _ in sched.scheduled:
            if seq.finished and seq.timings.finished_ns == end_ns:
                self.events.append(self._finished_event(seq))

    def _bytes_read(self, num_tokens: int, ctx_tokens: int) -> int:
        """Weights streamed once, the step's embedding rows, and the K/V (with int8 scales) of the context."""
        kv = ctx_tokens * self.block_bytes // self.config.block_size
        return self.weight_bytes + num_tokens * self.embed_row_bytes + kv

    def _finished_event(self, seq: Sequence) -> RequestEvent:
        t = seq.timings
        return RequestEvent(
            kind="finished",
            req_id=seq.req_id,
            ts_ns=t.finished_ns,
            trace_context=seq.trace_context,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=min(seq.num_output_tokens, seq.sampling.max_tokens),
            num_cached_tokens=max(seq.num_cached_tokens, 0),
            num_preemptions=seq.num_preemptions,
            arrival_ns=t.arrival_ns,
            first_scheduled_ns=t.first_scheduled_ns,
            first_token_ns=t.first_token_ns,
            last_token_ns=t.last_token_ns,
            itl_sum_ns=seq.itl_sum_ns,
            itl_max_ns=seq.itl_max_ns,
            itl_count=seq.itl_count,
            prefix_key=seq.block_hashes[0].hex() if seq.block_hashes else "",
        )
