"""Attention over the paged KV cache.

KV-cache layout, one tensor per layer:  [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 holds K, index 1 holds V). A token at position p of a sequence lives in
block `block_table[p // block_size]` at offset `p % block_size`; its flat slot is
`block_id * block_size + offset`.

    block_table = [7, 2, 9]   block_size = 4
    positions     0 1 2 3 | 4 5 6 7 | 8 9
    blocks        ---7--- | ---2--- | -9-
    slot of p=5:  2 * 4 + 1 = 9
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Where a step's tokens come from and where their K/V go. Tokens of all sequences are flattened.

    T = total new tokens this step, B = sequences this step.
    """

    slot_mapping: torch.Tensor  # [T] long: flat cache slot for each new token's K/V
    query_start_loc: torch.Tensor  # [B + 1] long: sequence b's new tokens are [qsl[b], qsl[b+1])
    seq_lens: torch.Tensor  # [B] long: context length of each sequence after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] long, padded with 0
    max_query_len: int
    max_seq_len: int
    query_lens: list[int]  # python copies, for per-sequence loops without device syncs
    seq_lens_list: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1
