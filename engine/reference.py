"""Single-sequence helpers that drive the model without the scheduler or runner.

Used by tests (comparison with Hugging Face transformers) and handy for a quick look at a model:
one sequence, its own small KV cache, a block table that is simply 0, 1, 2, ...
"""

from __future__ import annotations

import torch

from engine.attention import make_attention_metadata
from engine.kernels import PagedDecodeKernel
from engine.kv_cache import allocate_kv_cache
from engine.model import LlamaForCausalLM


class SingleSequence:
    """One sequence's KV cache and block table; `feed(ids)` runs the new ids and returns their logits."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        max_len: int,
        block_size: int = 16,
        kv_int8: bool = False,
        decode_kernel: PagedDecodeKernel | None = None,
    ) -> None:
        param = next(model.parameters())
        self.decode_kernel = decode_kernel  # decodes through the native kernel (float32 CPU caches)
        self.model, self.block_size, self.device = model, block_size, param.device
        num_blocks = -(-max_len // block_size)
        self.block_table = list(range(num_blocks))
        self.kv_caches = allocate_kv_cache(
            model.config, num_blocks, block_size, param.device, param.dtype, kv_int8=kv_int8
        )
        self.num_tokens = 0

    @torch.inference_mode()
    def feed(self, ids: list[int]) -> torch.Tensor:
        """Append `ids` (a prefill chunk or one decode token) -> logits [len(ids), V] float32."""
        start, end = self.num_tokens, self.num_tokens + len(ids)
        meta = make_attention_metadata([len(ids)], [end], [self.block_table], self.block_size, self.device)
        meta.decode_kernel = self.decode_kernel
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.arange(start, end, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [T, D]
        self.num_tokens = end
        return self.model.compute_logits(hidden)


def greedy_generate(
    model: LlamaForCausalLM,
    prompt_ids: list[int],
    max_new_tokens: int,
    block_size: int = 16,
    kv_int8: bool = False,
    decode_kernel: PagedDecodeKernel | None = None,
) -> list[int]:
    """Greedy continuation of one prompt: prefill in one step, then one decode step per token."""
    seq = SingleSequence(model, len(prompt_ids) + max_new_tokens, block_size, kv_int8, decode_kernel)
    logits = seq.feed(prompt_ids)
    out: list[int] = []
    for _ in range(max_new_tokens):
        out.append(int(logits[-1].argmax()))
        logits = seq.feed(out[-1:])
    return out


def continuation_logits(
    model: LlamaForCausalLM, prompt_ids: list[int], continuation: list[int], kv_int8: bool = False
) -> torch.Tensor:
    """Teacher forcing: logits [len(continuation), V] float32 that predict each continuation token.

    The prompt is one prefill; the continuation is a second chunk over the cached prompt, so every row
    reads K/V back through the cache (quantized and dequantized with `kv_int8`).
    """
    seq = SingleSequence(model, len(prompt_ids) + len(continuation), kv_int8=kv_int8)
    first = seq.feed(prompt_ids)[-1:]  # [1, V]: predicts continuation[0]
    if len(continuation) == 1:
        return first
    return torch.cat([first, seq.feed(continuation[:-1])])  # [C, V]
