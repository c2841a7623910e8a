"""Turns a `SchedulerOutput` into tensors, runs the model over the paged cache, samples.

All scheduled tokens of all sequences are flattened into one varlen batch:

    seq A: 3 prompt tokens (chunk)   seq B: 1 decode token   seq C: 2 prompt tokens
    input_ids        [a0 a1 a2 | b7 | c0 c1]           T = 6
    query_start_loc  [0, 3, 4, 6]                        B = 3
    logits rows      last token of each sequence that samples this step
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.attention import AttentionMetadata
from engine.config import ModelConfig
from engine.kernels import PagedDecodeKernel, fused_ops, paged_decode
from engine.kv_cache import KVCache, Workspace, allocate_kv_cache, concat_kv_blocks
from engine.sampler import make_generator, sample
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence

PAD_TOKEN_ID = 0  # fills static mode's left padding; attention masks it, so any id does
# SDPA kernels on CUDA. cuDNN's is left out: it builds an execution plan for every new shape, and a decode's
# key length grows by one each step, so every step paid a plan build (an H200, `small` in bf16: 41-61 ms a
# decode step at batch 1-32 with it, the first rounds of a run slower than the later ones).
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(slots=True)
class RunnerOutput:
    sampled: dict[Sequence, int]  # one new token per sequence that reached the end of its tokens
    forward_end_ns: int


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_int8: bool = False,
        native: bool = False,
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.kv_int8 = kv_int8  # int8 K/V with per-token scales (engine/quant.py), read back in `dtype`
        self.kv_caches = self._allocate(num_blocks)
        self.workspace = Workspace()  # gathered K/V, reused by every layer and step
        # Native CPU kernels (engine/kernels) for float32 on the CPU, where the library builds here: the small
        # ops between matmuls fused, and decodes reading the cache in place (a float32 cache, a layout the
        # kernel takes).
        cpu_fp32 = native and device.type == "cpu" and dtype == torch.float32
        cfg = model_config
        takes = PagedDecodeKernel.supports(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size)
        self.decode_kernel = paged_decode() if cpu_fp32 and takes and not kv_int8 else None
        model.fused = fused_ops() if cpu_fp32 else None

    @property
    def num_allocated_blocks(self) -> int:
        return self.kv_caches[0].shape[1]

    def grow_kv_cache(self, num_blocks: int) -> None:
        """Grow the cache tensors (block ids and contents stay); only between steps."""
        extra = num_blocks - self.num_allocated_blocks
        if extra <= 0:
            return
        more = self._allocate(extra)
        self.kv_caches = [concat_kv_blocks(old, new) for old, new in zip(self.kv_caches, more, strict=True)]

    def _allocate(self, num_blocks: int) -> list[KVCache]:
        cfg, bs = self.model_config, self.block_size
        return allocate_kv_cache(cfg, num_blocks, bs, self.device, self.dtype, kv_int8=self.kv_int8)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        input_ids, positions, meta, sample_rows, samplers = self._prepare(sched)
        cuda = self.device.type == "cuda"
        with sdpa_kernel(CUDA_SDPA_BACKENDS) if cuda else contextlib.nullcontext():
            hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [T, D]
        logits = self.model.compute_logits(hidden[sample_rows]) if samplers else None  # [N, V]
        if cuda:
            torch.cuda.synchronize(self.device)  # so the forward's end is timed, not its launch
        forward_end_ns = time.monotonic_ns()
        if logits is None:
            return RunnerOutput({}, forward_end_ns)
        for seq in samplers:
            if seq.sampling.seed is not None and seq.generator is None:
                seq.generator = make_generator(seq.sampling.seed, self.device)
        tokens = sample(logits, [s.sampling for s in samplers], [s.generator for s in samplers])
        return RunnerOutput(dict(zip(samplers, tokens, strict=True)), forward_end_ns)

    def _prepare(
        self, sched: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[Sequence]]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        key_starts: list[int] = []
        sample_rows: list[int] = []
        samplers: list[Sequence] = []
        max_blocks = max(len(s.block_table) for s, _ in sched.scheduled)
        tables: list[list[int]] = []  # padded with 0 to max_blocks: one tensor built at the end
        # In order of context length: attention then splits the decodes into groups of similar length
        # as contiguous slices (engine/attention.py, `_decode_plan`).
        for seq, n in sorted(sched.scheduled, key=lambda item: item[0].num_computed_tokens + item[1]):
            start = seq.num_computed_tokens
            end = start + n
            pad = seq.num_pad_tokens  # static mode: token p sits at cache position pad + p
            lead = pad if start == 0 else 0  # the pads are computed with the first chunk
            ids.extend([PAD_TOKEN_ID] * lead + seq.token_ids[start:end])
            pos.extend([0] * lead)  # masked out of every real query: any rotary position does
            pos.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[c // bs] * bs + c % bs for c in range(pad + start - lead, pad + end))
            tables.append(table + [0] * (max_blocks - len(table)))
            qsl.append(qsl[-1] + lead + n)
            seq_lens.append(pad + end)
            query_lens.append(lead + n)
            key_starts.append(pad)
            if end == seq.num_tokens:
                sample_rows.append(qsl[-1] - 1)
                samplers.append(seq)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.long, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.long, device=dev),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens=query_lens,
            seq_lens_list=seq_lens,
            workspace=self.workspace,
            decode_kernel=self.decode_kernel,
        )
        if any(key_starts):
            meta.key_starts = torch.tensor(key_starts, dtype=torch.long, device=dev)
            meta.key_starts_list = key_starts
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        return input_ids, positions, meta, rows, samplers
