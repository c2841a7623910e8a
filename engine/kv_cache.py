"""The paged KV cache: one tensor per layer, or its int8 form, and the scratch buffer reads land in.

Layout, one cache per layer:  [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 holds K, index 1 holds V); engine/attention.py pictures how positions map to slots.
A layer's cache is either that tensor in the model's dtype or an `Int8KVCache` (the same layout in
int8 plus per-token, per-head scales [2, num_blocks, block_size, num_kv_heads]), quantized on write
and dequantized on read with engine/quant.py's helpers.

Gathered K/V land in a `Workspace` that the model runner keeps from step to step. On the CPU a fresh
tensor of tens of MB per layer costs more in page faults than the copy into it (glibc maps blocks
over 32 MB afresh and unmaps them on free): at batch 32 and 300-1000 tokens of context, 25 ms a
layer against 5 ms with the reused buffer (`small` preset, 2 threads).
"""

from __future__ import annotations

import math

import torch

from engine.config import ModelConfig
from engine.quant import SCALE_DTYPE, dequantize_kv, quantize_kv


class Workspace:
    """One scratch buffer reused by every layer and step for gathered K/V; it only grows."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised tensor of `shape` over the buffer; valid until the next `take`."""
        numel = math.prod(shape)
        buf = self._buf
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = self._buf = torch.empty(numel + numel // 4, dtype=dtype, device=device)  # room to grow
        return buf[:numel].view(shape)


class Int8KVCache:
    """One layer's paged cache in int8 with per-token, per-head scales.

    values [2, num_blocks, block_size, Hkv, Dh] int8 and scales [2, num_blocks, block_size, Hkv] bf16
    (index 0: K, 1: V). A block costs Dh + 2 bytes per token and head, against 4 Dh in fp32 and 2 Dh
    in bf16: about 3.9x and 1.9x the tokens in the same bytes at Dh = 64. Reads dequantize to `dtype`.
    """

    __slots__ = ("dtype", "scales", "values")

    def __init__(self, values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        self.values, self.scales, self.dtype = values, scales, dtype

    @classmethod
    def zeros(cls, shape: tuple[int, ...], device: torch.device | str, dtype: torch.dtype) -> Int8KVCache:
        """An empty cache of `shape` = (2, num_blocks, block_size, Hkv, Dh)."""
        values = torch.zeros(shape, device=device, dtype=torch.int8)
        return cls(values, torch.zeros(shape[:-1], device=device, dtype=SCALE_DTYPE), dtype)

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def nbytes(self) -> int:
        return self.values.numel() + self.scales.numel() * self.scales.element_size()

    @staticmethod
    def bytes_per_token_head(head_dim: int) -> int:
        """Bytes of one token's K (or V) for one KV head: the int8 values and one scale."""
        return head_dim + torch.empty((), dtype=SCALE_DTYPE).element_size()

    def write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize k, v [T, Hkv, Dh] and scatter them to their flat slots [T]."""
        _, num_blocks, block_size, num_kv_heads, head_dim = self.values.shape
        slots = num_blocks * block_size
        values = self.values.view(2, slots, num_kv_heads, head_dim)  # [2, slots, Hkv, Dh]
        scales = self.scales.view(2, slots, num_kv_heads)  # [2, slots, Hkv]
        for i, x in enumerate((k, v)):
            q, s = quantize_kv(x)
            values[i].index_copy_(0, slot_mapping, q)
            scales[i].index_copy_(0, slot_mapping, s)

    def gather_rows(self, rows: torch.Tensor, workspace: Workspace | None = None) -> torch.Tensor:
        """rows [2N] of the [2 * num_blocks, block] view (N blocks' K rows, then their V rows) -> those
        blocks dequantized, [2, N, bs, Hkv, Dh] in `dtype`.

        With a `workspace` (and an fp32 `dtype`) the result is a view of its buffer.
        """
        _, num_blocks, block_size, num_kv_heads, head_dim = self.values.shape
        values = self.values.view(2 * num_blocks, -1).index_select(0, rows)  # [2N, bs * Hkv * Dh]
        scales = self.scales.view(2 * num_blocks, -1).index_select(0, rows)  # [2N, bs * Hkv]
        shape = (2, rows.shape[0] // 2, block_size, num_kv_heads)
        if workspace is None or self.dtype != torch.float32:
            return dequantize_kv(values.view(*shape, head_dim), scales.view(shape), self.dtype)
        out = workspace.take((*shape, head_dim), torch.float32, values.device)
        out.copy_(values.view(*shape, head_dim))  # int8 -> fp32 is exact: the same as dequantize_kv
        return out.mul_(scales.view(shape).to(torch.float32).unsqueeze(-1))

    def cat(self, more: Int8KVCache) -> Int8KVCache:
        """This cache followed by `more`'s blocks (block ids and contents stay)."""
        values = torch.cat([self.values, more.values], dim=1)
        return Int8KVCache(values, torch.cat([self.scales, more.scales], dim=1), self.dtype)


KVCache = torch.Tensor | Int8KVCache  # one layer's cache: [2, num_blocks, block_size, Hkv, Dh]


def allocate_kv_cache(
    cfg: ModelConfig,
    num_blocks: int,
    block_size: int,
    device: torch.device | str,
    dtype: torch.dtype,
    kv_int8: bool = False,
) -> list[KVCache]:
    """One zeroed cache per layer, [2, num_blocks, block_size, num_kv_heads, head_dim].

    In `dtype` (the model's), or with `kv_int8` an `Int8KVCache` whose reads dequantize to `dtype`.
    """
    shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    if kv_int8:
        return [Int8KVCache.zeros(shape, device, dtype) for _ in range(cfg.num_layers)]
    return [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]


def kv_cache_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V together; `torch.int8` counts the scales too."""
    if dtype == torch.int8:
        per_token_head = Int8KVCache.bytes_per_token_head(cfg.head_dim)
    else:
        per_token_head = cfg.head_dim * torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * per_token_head


def concat_kv_blocks(old: KVCache, more: KVCache) -> KVCache:
    """A cache with `more`'s blocks after `old`'s (growing the pool keeps block ids and contents)."""
    if isinstance(old, Int8KVCache) and isinstance(more, Int8KVCache):
        return old.cat(more)
    return torch.cat([old, more], dim=1)  # type: ignore[list-item]
