"""Attention over the paged KV cache.

KV-cache layout, one tensor per layer:  [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 holds K, index 1 holds V). A token at position p of a sequence lives in
block `block_table[p // block_size]` at offset `p % block_size`; its flat slot is
`block_id * block_size + offset`.

    block_table = [7, 2, 9]   block_size = 4
    positions     0 1 2 3 | 4 5 6 7 | 8 9
    blocks        ---7--- | ---2--- | -9-
    slot of p=5:  2 * 4 + 1 = 9

The cache is touched in exactly two places, `_write_kv` (scatter new K/V to their slots) and
`_gather_blocks` (read whole blocks through a block table). A layer's cache is either that tensor in
the model's dtype or an `Int8KVCache` (engine/kv_cache.py), quantized on write and dequantized on read;
the attention math never sees the difference. Gathered K/V land in the runner's `Workspace`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels import PagedDecodeKernel
from engine.kv_cache import Int8KVCache, KVCache, Workspace


@dataclass(slots=True)
class DecodeGroup:
    """Decoding sequences of similar context length, attended as one padded batch."""

    rows: slice | torch.Tensor  # their rows of q and of the output (a slice when contiguous)
    block_tables: torch.Tensor  # [n, max_blocks] (trimmed to the group's longest when read)
    seq_lens: torch.Tensor  # [n]
    seq_lens_list: list[int]
    key_starts: torch.Tensor | None  # [n]: static mode's left padding
    # (pool size, cache rows to gather, padded length, mask): the same in every layer, built by the first
    reads: tuple[int, torch.Tensor, int, torch.Tensor | None] | None = None


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
    # Static mode's left padding: sequence b's cache positions below key_starts[b] hold pad tokens that
    # real queries must not see (pad queries see only pads, so every row stays finite). None: no padding.
    key_starts: torch.Tensor | None = None  # [B] long
    key_starts_list: list[int] | None = None
    workspace: Workspace | None = None  # where gathered K/V go; None: fresh tensors
    decode_plan: list[DecodeGroup] | None = None  # built by the first layer that needs it (`_decode_plan`)
    # engine/kernels: decodes read a float32 cache in place instead of gathering (None: the torch path)
    decode_kernel: PagedDecodeKernel | None = None
    decode_index: tuple[torch.Tensor, torch.Tensor] | None = None  # the decodes' (sequences, token rows)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


def make_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    key_starts: list[int] | None = None,
) -> AttentionMetadata:
    """Build metadata from python lists: sequence b adds `query_lens[b]` tokens ending at `seq_lens[b]`;
    with `key_starts`, its first `key_starts[b]` cache positions are left padding (masked out).

    A plain reference builder (tests, the single-sequence helpers in engine/reference.py); the
    model runner may build the same tensors its own way.
    """
    slots: list[int] = []
    for qlen, slen, table in zip(query_lens, seq_lens, block_tables, strict=True):
        if not 1 <= qlen <= slen or len(table) * block_size < slen:
            raise ValueError(f"bad sequence: query_len={qlen} seq_len={slen} blocks={len(table)}")
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(slen - qlen, slen))
    starts = [0]
    for qlen in query_lens:
        starts.append(starts[-1] + qlen)
    width = max(len(t) for t in block_tables)
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    as_long = dict(dtype=torch.long, device=device)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, **as_long),
        query_start_loc=torch.tensor(starts, **as_long),
        seq_lens=torch.tensor(seq_lens, **as_long),
        block_tables=torch.tensor(padded, **as_long),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens=list(query_lens),
        seq_lens_list=list(seq_lens),
        key_starts=None if key_starts is None else torch.tensor(key_starts, **as_long),
        key_starts_list=None if key_starts is None else list(key_starts),
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache at `meta.slot_mapping`, then attend.

    q [T, H, Dh], k and v [T, Hkv, Dh] -> [T, H, Dh]. Query token i of sequence b sits at
    position seq_len_b - query_len_b + i and attends to every cached position <= its own.
    Sequences with one new token (decodes) go through a few batched SDPA calls, one per group of
    similar context lengths (`_decode_plan`); the others (prefills, prefill chunks) get one SDPA call
    each. Keys below `meta.key_starts` (left padding) are hidden from real queries.
    """
    if meta.decode_kernel is not None and isinstance(kv_cache, torch.Tensor):
        out = _kernel_decodes(q, k, v, kv_cache, meta, scale)  # writes this step's K/V too
    else:
        _write_kv(kv_cache, meta.slot_mapping, k, v)
        out = _grouped_decodes(q, kv_cache, meta, scale)
    if meta.decode_only:
        return out
    starts = _starts(meta.query_lens)
    for b, qlen in enumerate(meta.query_lens):
        if qlen > 1:
            s, e = starts[b], starts[b] + qlen
            table, seq_len = meta.block_tables[b], meta.seq_lens_list[b]
            key_start = meta.key_starts_list[b] if meta.key_starts_list else 0
            out[s:e] = _prefill_one(
                q[s:e], k[s:e], v[s:e], kv_cache, table, seq_len, scale, key_start, meta.workspace
            )
    return out


def _kernel_decodes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """The native kernel writes this step's K/V and attends every decode: [T, H, Dh], the decodes' rows
    filled (the others are the caller's to fill)."""
    assert meta.decode_kernel is not None
    if meta.decode_index is None:  # the step's first layer
        indices = (meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.key_starts)
        meta.decode_kernel.check(q, k, v, kv_cache, indices)
        starts = _starts(meta.query_lens)
        seqs = [b for b, qlen in enumerate(meta.query_lens) if qlen == 1]
        as_long = dict(dtype=torch.long, device=q.device)
        meta.decode_index = (
            torch.tensor(seqs, **as_long),
            torch.tensor([starts[b] for b in seqs], **as_long),
        )
    seqs, tokens = meta.decode_index
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    meta.decode_kernel(
        q,
        k,
        v,
        meta.slot_mapping,
        out,
        kv_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.key_starts,
        seqs,
        tokens,
        scale,
    )
    return out


def _grouped_decodes(
    q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """[T, H, Dh] with every decode's row attended by gather + SDPA, a call per length group."""
    if meta.decode_plan is None:
        meta.decode_plan = _decode_plan(meta)
    plan = meta.decode_plan
    if meta.decode_only and len(plan) == 1 and isinstance(plan[0].rows, slice):
        return _decode_attention(q, kv_cache, plan[0], scale, meta.workspace)
    out = torch.empty_like(q)
    for g in plan:
        out[g.rows] = _decode_attention(q[g.rows], kv_cache, g, scale, meta.workspace)
    return out


def dense_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Plain causal attention for one sequence, for tests: q [Tq, H, Dh], k and v [S, Hkv, Dh] (S >= Tq).

    The queries are the last Tq of the S positions. Computed in float64 with explicit softmax.
    """
    tq, num_heads, _ = q.shape
    s = k.shape[0]
    group = num_heads // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, Dh]
    vv = v.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, Dh]
    scores = q.double().transpose(0, 1) @ kk.transpose(1, 2) * scale  # [H, Tq, S]
    pos = torch.arange(s - tq, s)[:, None]  # [Tq, 1]
    scores = scores.masked_fill(torch.arange(s)[None, :] > pos, float("-inf"))
    return (scores.softmax(-1) @ vv).transpose(0, 1).to(q.dtype)  # [Tq, H, Dh]


def _starts(query_lens: list[int]) -> list[int]:
    starts = [0]
    for qlen in query_lens:
        starts.append(starts[-1] + qlen)
    return starts


def _prefill_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    key_start: int = 0,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """One sequence's chunk of new tokens: q [Tq, H, Dh], k and v [Tq, Hkv, Dh] -> [Tq, H, Dh]."""
    qlen = q.shape[0]
    if qlen == seq_len and key_start == 0:  # no cached prefix: over the new tokens themselves, causal
        return _prefill_attention(q, k, v, None, scale)
    if qlen == seq_len:
        ctx_k, ctx_v = k, v
    else:
        # [S, Hkv, Dh], the new tokens included
        ctx_k, ctx_v = _gather_kv(kv_cache, block_table, seq_len, workspace)
    # query i sits at position seq_len - qlen + i: a causal mask shifted right by the prefix
    mask = torch.ones(qlen, seq_len, dtype=torch.bool, device=q.device).tril(diagonal=seq_len - qlen)
    if key_start:
        # left padding [0, key_start): real queries skip it; pad queries see only pads (finite rows)
        is_pad_key = torch.arange(seq_len, device=q.device) < key_start  # [S]
        is_pad_query = torch.arange(seq_len - qlen, seq_len, device=q.device) < key_start  # [Tq]
        mask &= is_pad_key[None, :] == is_pad_query[:, None]
    return _prefill_attention(q, ctx_k, ctx_v, mask, scale)


def _write_kv(kv_cache: KVCache, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if isinstance(kv_cache, Int8KVCache):
        kv_cache.write(slot_mapping, k, v)  # quantized per token and head on the way in
        return
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)  # [2, slots, Hkv, Dh]
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def _gather_kv(
    kv_cache: KVCache, block_table: torch.Tensor, seq_len: int, workspace: Workspace | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's context: block_table [max_blocks] -> k, v [seq_len, Hkv, Dh]."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_blocks = -(-seq_len // block_size)
    kv = _gather_blocks(kv_cache, block_table[:num_blocks], workspace)  # [2, nb, bs, Hkv, Dh]
    kv = kv.view(2, num_blocks * block_size, num_kv_heads, head_dim)[:, :seq_len]
    return kv[0], kv[1]


def _kv_rows(block_ids: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """block_ids [N] -> their rows of a cache viewed as [2 * num_blocks, block]: K rows, then V rows."""
    return torch.cat([block_ids, block_ids + num_blocks])


def _gather_blocks(
    kv_cache: KVCache, block_ids: torch.Tensor, workspace: Workspace | None = None, rows: bool = False
) -> torch.Tensor:
    """block_ids [N] -> their K and V blocks [2, N, bs, Hkv, Dh] (an int8 cache's dequantized).

    One index_select over whole blocks (K rows then V rows of a [2 * num_blocks, block] view) copies
    contiguous runs: about twice as fast on the CPU as advanced indexing `kv_cache[:, block_ids]`.
    With `rows`, `block_ids` are already those rows (`_kv_rows`, [2N]). With a `workspace` the result
    is a view of its buffer, valid until the next gather.
    """
    num_blocks = kv_cache.shape[1]
    ids = block_ids if rows else _kv_rows(block_ids, num_blocks)
    if isinstance(kv_cache, Int8KVCache):
        return kv_cache.gather_rows(ids, workspace)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2 * num_blocks, block_size * num_kv_heads * head_dim)
    if workspace is None:
        picked = flat.index_select(0, ids)
    else:
        picked = workspace.take((ids.shape[0], flat.shape[1]), flat.dtype, flat.device)
        torch.index_select(flat, 0, ids, out=picked)
    return picked.view(2, ids.shape[0] // 2, block_size, num_kv_heads, head_dim)


def _decode_attention(
    q: torch.Tensor, kv_cache: KVCache, group: DecodeGroup, scale: float, workspace: Workspace | None
) -> torch.Tensor:
    """One new token per sequence of `group`: q [B, H, Dh] -> [B, H, Dh].

    K/V of all its sequences are gathered into one padded [B, L, Hkv, Dh] and masked by length and by
    `key_starts` (left padding; no mask when all lengths are equal and nothing is padded). GQA without
    repeating K/V: the G query heads that share a KV head become G "query rows" of that head (one mask
    fits all: a decode has one position). The rows to gather and the mask are the same in every layer:
    built by the first, kept in the group.
    """
    batch, num_heads, head_dim = q.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    if group.reads is None or group.reads[0] != num_blocks:
        group.reads = (num_blocks, *_decode_reads(group, num_blocks, block_size))
    _, ids, width, mask = group.reads
    kv = _gather_blocks(kv_cache, ids, workspace, rows=True)  # [2, B * nb, bs, Hkv, Dh]
    kv = kv.view(2, batch, width, num_kv_heads, head_dim)  # [2, B, L, Hkv, Dh]
    if mask is None:
        kv = kv[:, :, : group.seq_lens_list[0]]
    kv = kv.transpose(2, 3)  # [2, B, Hkv, L, Dh]
    grouped_q = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hkv, G, Dh]
    out = F.scaled_dot_product_attention(grouped_q, kv[0], kv[1], attn_mask=mask, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def _decode_reads(
    group: DecodeGroup, num_blocks: int, block_size: int
) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """What a decode group reads from a pool of `num_blocks`: (cache rows [2 * B * nb], padded length L,
    mask [B, 1, 1, L] or None when every length is L's and nothing is left-padded)."""
    max_len = max(group.seq_lens_list)
    width = -(-max_len // block_size)
    ids = _kv_rows(group.block_tables[:, :width].reshape(-1), num_blocks)
    if min(group.seq_lens_list) == max_len and group.key_starts is None:
        return ids, width * block_size, None
    positions = torch.arange(width * block_size, device=ids.device)  # [L]
    mask = positions[None, :] < group.seq_lens[:, None]  # [B, L]
    if group.key_starts is not None:
        mask &= positions[None, :] >= group.key_starts[:, None]
    return ids, width * block_size, mask[:, None, None, :]  # [B, 1, 1, L]


# A padded decode batch reads every sequence's K/V up to the longest one's length; splitting it costs a
# gather, a mask and an SDPA call per group. In tokens of K/V read, one more group costs about this much
# (`small` preset, 2 CPU threads, batch 32: 512-2048 all within noise of the best split, e.g. contexts of
# 32-1000 tokens 6.9 -> 5.0-5.8 ms a layer, 32-1500 12.5 -> 7.4). The GPU figure is a guess, untested.
GROUP_COST_TOKENS = {"cpu": 1024, "cuda": 4096}
MAX_DECODE_GROUPS = 8


def _decode_plan(meta: AttentionMetadata) -> list[DecodeGroup]:
    """Split the step's decodes into groups of similar context length, built once per step.

    Sorted by length, the decodes go into k equal runs for the k in 1, 2, 4, 8 that reads the fewest
    padded tokens plus `GROUP_COST_TOKENS` a group. At batch 32 with contexts of 32-1000 tokens one
    padded batch reads about twice the tokens there are. The model runner orders a step's sequences by
    length, so the groups are contiguous slices and nothing is copied.
    """
    rows = [b for b, qlen in enumerate(meta.query_lens) if qlen == 1]
    if not rows:
        return []
    order = sorted(rows, key=lambda b: meta.seq_lens_list[b])
    device = meta.seq_lens.device
    k = _group_count([meta.seq_lens_list[b] for b in order], GROUP_COST_TOKENS.get(device.type, 4096))
    if k == 1:
        order = rows  # one group: keep the step's own order
    starts = _starts(meta.query_lens)
    bounds = [len(order) * i // k for i in range(k + 1)]
    return [_decode_group(meta, order[s:e], starts) for s, e in itertools.pairwise(bounds)]


def _group_count(sorted_lens: list[int], cost_per_group: int) -> int:
    """The k in 1, 2, 4, 8 whose equal runs of `sorted_lens` read the fewest padded tokens plus
    `cost_per_group` for each group."""
    n = len(sorted_lens)
    best_k, best_cost = 1, n * sorted_lens[-1]
    k = 2
    while k <= MAX_DECODE_GROUPS and n >= 2 * k:
        bounds = [n * i // k for i in range(k + 1)]
        cost = sum((e - s) * sorted_lens[e - 1] + cost_per_group for s, e in itertools.pairwise(bounds))
        if cost < best_cost:
            best_k, best_cost = k, cost
        k *= 2
    return best_k


def _decode_group(meta: AttentionMetadata, members: list[int], starts: list[int]) -> DecodeGroup:
    """The decode group of sequences `members`: slices of the step's tensors when they are consecutive
    (as the model runner orders them), index tensors otherwise."""
    device = meta.seq_lens.device
    tokens = [starts[b] for b in members]
    consecutive = members == list(range(members[0], members[-1] + 1))
    if consecutive and tokens == list(range(tokens[0], tokens[-1] + 1)):
        whole = len(members) == len(meta.query_lens)
        rows: slice | torch.Tensor = slice(None) if whole else slice(tokens[0], tokens[-1] + 1)
        picked: slice | torch.Tensor = slice(members[0], members[-1] + 1)
    else:
        rows = torch.tensor(tokens, dtype=torch.long, device=device)
        picked = torch.tensor(members, dtype=torch.long, device=device)
    key_starts = None if meta.key_starts is None else meta.key_starts[picked]
    lens = [meta.seq_lens_list[b] for b in members]
    return DecodeGroup(rows, meta.block_tables[picked], meta.seq_lens[picked], lens, key_starts)


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """q [Tq, H, Dh], k and v [S, Hkv, Dh], mask [Tq, S] bool or None (causal, Tq == S) -> [Tq, H, Dh]."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    # [1, H or Hkv, len, Dh]: with a batch dimension the CPU takes its fused kernel; 3-D inputs fall
    # back to a path 5-9x slower (512 tokens, 8 heads, GQA: 9-17 ms vs 83-104 ms CPU).
    qq, kk, vv = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    gqa = num_heads != num_kv_heads
    if gqa and q.device.type != "cpu":
        # GPU SDPA kernels that take a mask do not all support GQA; a repeat keeps the fast kernels.
        kk = kk.repeat_interleave(num_heads // num_kv_heads, dim=1)
        vv = vv.repeat_interleave(num_heads // num_kv_heads, dim=1)
        gqa = False
    out = F.scaled_dot_product_attention(
        qq, kk, vv, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
    )  # [1, H, Tq, Dh]
    return out[0].transpose(0, 1)
