"""Paged attention over a scattered KV cache equals plain causal attention over contiguous K/V."""

from __future__ import annotations

import pytest
import torch

from engine import attention
from engine.attention import dense_attention_reference, make_attention_metadata, paged_attention
from engine.config import ModelConfig
from engine.kernels import PagedDecodeKernel, paged_decode
from engine.kv_cache import Workspace, allocate_kv_cache, kv_cache_bytes_per_block

BLOCK_SIZE = 4
NUM_BLOCKS = 400
HEAD_DIM = 16


@pytest.fixture(params=["torch", "native"])
def decode_kernel(request: pytest.FixtureRequest) -> PagedDecodeKernel | None:
    """Decodes through the torch path (gather + SDPA) or the native kernel that reads blocks in place."""
    if request.param == "torch":
        return None
    kernel = paged_decode()
    if kernel is None:
        pytest.skip("the native kernel needs a C compiler, and none is on this machine")
    return kernel


def _run_case(
    specs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    seed: int = 0,
    workspace: Workspace | None = None,
    decode_kernel: PagedDecodeKernel | None = None,
    head_dim: int = HEAD_DIM,
    block_size: int = BLOCK_SIZE,
):
    """specs: (query_len, seq_len) per sequence. Cached prefixes are written into random blocks first.

    Returns the paged output [T, H, Dh], the dense reference [T, H, Dh], and the cache and new K/V.
    """
    gen = torch.Generator().manual_seed(seed)
    scale = head_dim**-0.5
    cache = torch.zeros(2, NUM_BLOCKS, block_size, num_kv_heads, head_dim)
    free_blocks = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables, qs, ks, vs, expected = [], [], [], [], []
    for qlen, slen in specs:
        table = [free_blocks.pop() for _ in range(-(-slen // block_size))]
        tables.append(table)
        full_k = torch.randn(slen, num_kv_heads, head_dim, generator=gen)
        full_v = torch.randn(slen, num_kv_heads, head_dim, generator=gen)
        for p in range(slen - qlen):  # the cached prefix, as earlier steps would have left it
            cache[0, table[p // block_size], p % block_size] = full_k[p]
            cache[1, table[p // block_size], p % block_size] = full_v[p]
        q = torch.randn(qlen, num_heads, head_dim, generator=gen)
        qs.append(q)
        ks.append(full_k[slen - qlen :])
        vs.append(full_v[slen - qlen :])
        expected.append(dense_attention_reference(q, full_k, full_v, scale))
    meta = make_attention_metadata([q for q, _ in specs], [s for _, s in specs], tables, block_size)
    meta.workspace = workspace
    meta.decode_kernel = decode_kernel
    k, v = torch.cat(ks), torch.cat(vs)
    out = paged_attention(torch.cat(qs), k, v, cache, meta, scale)
    return out, torch.cat(expected), cache, meta, k, v


CASES = {
    "decode_only": [(1, 7), (1, 1), (1, 13), (1, 16), (1, 4)],
    "decode_equal_lengths": [(1, 9), (1, 9), (1, 9)],
    "decode_spread_lengths": [(1, 3), (1, 33), (1, 12), (1, 50), (1, 22), (1, 7)],
    "prefill_no_prefix": [(5, 5), (8, 8), (1, 1)],
    "prefill_with_prefix": [(3, 10), (4, 4), (7, 12)],
    "mixed": [(1, 9), (6, 6), (1, 4), (4, 11), (1, 17)],
    "single_long_prefill": [(33, 33)],
    # enough decodes that the native kernel gives each its own task (all KV heads), not one per head
    "decode_many": [(1, 3 + 7 * i % 40) for i in range(24)],
}


@pytest.mark.parametrize(
    "heads",
    [(4, 4), (4, 2), (8, 1), (80, 8)],
    ids=["mha", "gqa2", "mqa", "wide"],  # wide: more query heads than the kernel attends in one task
)
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_equals_dense_reference(
    case: str, heads: tuple[int, int], decode_kernel: PagedDecodeKernel | None
) -> None:
    out, expected, *_ = _run_case(CASES[case], *heads, decode_kernel=decode_kernel)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("head_dim", "block_size"),
    [(12, 4), (64, 24), (128, 16), (32, 5)],
    # 12: no vector width divides it; 24 and 5: a block the vector chunks do not tile, so chunks and
    # the prefetch of the next one cross block boundaries; 128: several vectors per head
)
@pytest.mark.parametrize("case", ["decode_spread_lengths", "decode_many"])
def test_head_dims_and_block_sizes_beyond_the_usual_equal_the_reference(
    case: str, head_dim: int, block_size: int, decode_kernel: PagedDecodeKernel | None
) -> None:
    out, expected, *_ = _run_case(
        CASES[case], 8, 2, decode_kernel=decode_kernel, head_dim=head_dim, block_size=block_size
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


GROUPED_CASES = {
    "decode_spread_lengths": CASES["decode_spread_lengths"],
    "decode_only": CASES["decode_only"],
    "mixed": [(1, 9), (6, 6), (1, 4), (4, 11), (1, 17), (1, 30), (3, 3), (1, 2)],
}


@pytest.mark.parametrize("case", list(GROUPED_CASES))
def test_decodes_split_into_length_groups_equal_the_reference(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With free extra calls the plan splits even small batches by length (rows out of length order):
    every group's rows land where they belong."""
    monkeypatch.setattr(attention, "GROUP_COST_TOKENS", {"cpu": 0, "cuda": 0})
    out, expected, _, meta, *_ = _run_case(GROUPED_CASES[case], 4, 2)
    assert meta.decode_plan is not None and len(meta.decode_plan) >= 2
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_sorted_decodes_are_grouped_as_slices_of_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """In length order (as the model runner sends them) the groups are views: nothing is copied."""
    monkeypatch.setattr(attention, "GROUP_COST_TOKENS", {"cpu": 0, "cuda": 0})
    specs = sorted(CASES["decode_spread_lengths"], key=lambda qs: qs[1])
    out, expected, _, meta, *_ = _run_case(specs, 4, 2)
    assert all(isinstance(g.rows, slice) for g in meta.decode_plan)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_a_reused_workspace_changes_no_output() -> None:
    """One workspace across every case in turn (growing, then reused smaller) gives the same outputs."""
    workspace = Workspace()
    for seed, case in enumerate(list(CASES) * 2):
        out, expected, *_ = _run_case(CASES[case], 4, 2, seed=seed, workspace=workspace)
        fresh, *_ = _run_case(CASES[case], 4, 2, seed=seed)
        torch.testing.assert_close(out, fresh, rtol=0, atol=0)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_new_keys_and_values_land_in_their_slots(decode_kernel: PagedDecodeKernel | None) -> None:
    _, _, cache, meta, k, v = _run_case(CASES["mixed"], 4, 2, decode_kernel=decode_kernel)
    flat = cache.view(2, NUM_BLOCKS * BLOCK_SIZE, 2, HEAD_DIM)
    torch.testing.assert_close(flat[0, meta.slot_mapping], k)
    torch.testing.assert_close(flat[1, meta.slot_mapping], v)


def test_metadata_slot_mapping_follows_the_block_table() -> None:
    meta = make_attention_metadata([2, 1], [6, 10], [[7, 2], [1, 5, 3]], block_size=4)
    # seq 0: positions 4, 5 -> block 2, offsets 0, 1; seq 1: position 9 -> block 3, offset 1
    assert meta.slot_mapping.tolist() == [8, 9, 13]
    assert meta.query_start_loc.tolist() == [0, 2, 3]
    assert meta.block_tables.tolist() == [[7, 2, 0], [1, 5, 3]]
    assert (meta.max_query_len, meta.max_seq_len, meta.decode_only) == (2, 10, False)


def test_kv_cache_allocation_matches_its_byte_count() -> None:
    cfg = ModelConfig()
    caches = allocate_kv_cache(cfg, num_blocks=8, block_size=16, device="cpu", dtype=torch.float32)
    assert len(caches) == cfg.num_layers
    assert caches[0].shape == (2, 8, 16, cfg.num_kv_heads, cfg.head_dim)
    total = sum(c.numel() * c.element_size() for c in caches)
    assert total == 8 * kv_cache_bytes_per_block(cfg, 16, torch.float32)
    assert kv_cache_bytes_per_block(cfg, 16, torch.bfloat16) * 2 == kv_cache_bytes_per_block(
        cfg, 16, torch.float32
    )


def _run_padded_case(
    specs: list[tuple[int, int, int]],
    num_heads: int = 4,
    num_kv_heads: int = 2,
    decode_kernel: PagedDecodeKernel | None = None,
):
    """specs: (pads, query_len, real_len) per sequence. Its cache holds `pads` garbage positions, then
    `real_len` real ones; the queries are the last `query_len` cache positions (pads included when it
    covers them). Returns the real query rows of the paged output and their dense reference."""
    gen = torch.Generator().manual_seed(1)
    scale = HEAD_DIM**-0.5
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    free_blocks = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables, qs, ks, vs, real_rows, expected = [], [], [], [], [], []
    row = 0
    for pads, qlen, real in specs:
        slen = pads + real
        table = [free_blocks.pop() for _ in range(-(-slen // BLOCK_SIZE))]
        tables.append(table)
        full_k = torch.randn(slen, num_kv_heads, HEAD_DIM, generator=gen) * 5  # pads: loud garbage
        full_v = torch.randn(slen, num_kv_heads, HEAD_DIM, generator=gen) * 5
        for p in range(slen - qlen):
            cache[0, table[p // BLOCK_SIZE], p % BLOCK_SIZE] = full_k[p]
            cache[1, table[p // BLOCK_SIZE], p % BLOCK_SIZE] = full_v[p]
        q = torch.randn(qlen, num_heads, HEAD_DIM, generator=gen)
        qs.append(q)
        ks.append(full_k[slen - qlen :])
        vs.append(full_v[slen - qlen :])
        num_real_queries = min(qlen, real)
        real_rows.extend(range(row + qlen - num_real_queries, row + qlen))
        row += qlen
        expected.append(
            dense_attention_reference(q[qlen - num_real_queries :], full_k[pads:], full_v[pads:], scale)
        )
    meta = make_attention_metadata(
        [q for _, q, _ in specs],
        [p + r for p, _, r in specs],
        tables,
        BLOCK_SIZE,
        key_starts=[p for p, *_ in specs],
    )
    meta.decode_kernel = decode_kernel
    out = paged_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta, scale)
    assert torch.isfinite(out).all(), "pad query rows must stay finite"
    return out[real_rows], torch.cat(expected)


PADDED_CASES = {
    "padded_prefill": [(5, 12, 7), (0, 12, 12), (11, 12, 1)],  # a static batch's prefill
    "padded_decode": [(5, 1, 9), (0, 1, 14), (11, 1, 3)],  # its decodes
    "padded_mixed": [(5, 1, 9), (3, 9, 6), (0, 1, 2)],
    "padded_decode_spread": [(5, 1, 30), (0, 1, 4), (2, 1, 9)],
}


@pytest.mark.parametrize("case", list(PADDED_CASES))
def test_left_padding_is_invisible_to_real_queries(
    case: str, decode_kernel: PagedDecodeKernel | None
) -> None:
    out, expected = _run_padded_case(PADDED_CASES[case], decode_kernel=decode_kernel)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
