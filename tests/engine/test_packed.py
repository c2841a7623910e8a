"""Float32 CPU linears through oneDNN's packed weights or the native panel kernel: same numbers as
nn.Linear, same state dict, ties kept."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import kernels
from engine.config import EngineConfig, preset
from engine.core import EngineCore
from engine.loader import hf_state_dict
from engine.model import build_model
from engine.packed import PackedLinear, pack_model, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN on this CPU")


@pytest.mark.parametrize("rows", [1, 3, 32, 200])
def test_a_packed_linear_multiplies_like_the_plain_one(rows: int) -> None:
    torch.manual_seed(0)
    plain = nn.Linear(48, 80, bias=True)
    packed = PackedLinear.from_linear(plain)
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), plain(x), rtol=1e-5, atol=1e-5)


def native_kernel() -> kernels.LinearKernel:
    kernel = kernels.linear()
    if kernel is None:
        pytest.skip("the native kernels need a C compiler, and none is on this machine")
    return kernel


@pytest.mark.parametrize("rows", [1, 2, 7, 32, 200])
@pytest.mark.parametrize(("in_features", "out_features", "bias"), [(48, 80, True), (37, 19, False)])
def test_the_native_kernel_multiplies_like_the_plain_linear(
    rows: int, in_features: int, out_features: int, bias: bool
) -> None:
    torch.manual_seed(0)
    plain = nn.Linear(in_features, out_features, bias=bias)
    native = PackedLinear.from_linear(plain, onednn=False, native=native_kernel(), native_max_rows=512)
    x = torch.randn(rows + 3, in_features)[1 : rows + 1]  # rows of a wider batch, as a view
    with torch.inference_mode():
        torch.testing.assert_close(native(x), plain(x), rtol=1e-5, atol=1e-5)


def test_the_native_kernel_gives_a_row_the_same_bits_at_any_batch_size() -> None:
    torch.manual_seed(0)
    plain = nn.Linear(64, 100, bias=True)
    native = PackedLinear.from_linear(plain, onednn=False, native=native_kernel(), native_max_rows=512)
    batch = torch.randn(32, 64)
    with torch.inference_mode():
        together = native(batch)
        for r in (0, 5, 31):
            assert torch.equal(native(batch[r : r + 1]), together[r : r + 1])
            assert torch.equal(native(batch[r : r + 3]), together[r : r + 3])


def test_packing_a_model_keeps_its_state_dict_and_tied_weights() -> None:
    cfg = preset("tiny")
    cfg.tie_word_embeddings = True
    model = build_model(cfg, "cpu", torch.float32)
    before = {k: v.clone() for k, v in hf_state_dict(model).items()}
    swapped = pack_model(model)
    assert (
        swapped == sum(1 for m in model.modules() if isinstance(m, PackedLinear)) == 4 * cfg.num_layers + 1
    )  # qkv, o, gate_up, down; the head
    assert model.lm_head.weight is model.model.embed_tokens.weight
    after = hf_state_dict(model)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_the_engine_packs_only_float32_cpu_weights() -> None:
    packed = EngineCore(EngineConfig(model="tiny", num_threads=1))
    assert any(isinstance(m, PackedLinear) for m in packed.runner.model.modules())
    for off in ({"weight_packing": False}, {"dtype": "bf16"}):
        core = EngineCore(EngineConfig(model="tiny", num_threads=1, **off))
        assert not any(isinstance(m, PackedLinear) for m in core.runner.model.modules()), off
    int8 = EngineCore(EngineConfig(model="tiny", num_threads=1, weight_dtype="int8"))
    modules = list(int8.runner.model.modules())
    assert not any(type(m) is nn.Linear or isinstance(m, PackedLinear) for m in modules)  # all int8


def test_the_engine_reorders_each_weight_once_for_one_kernel() -> None:
    native_kernel()
    linears = [
        m
        for m in EngineCore(EngineConfig(model="tiny")).runner.model.modules()
        if isinstance(m, PackedLinear)
    ]
    assert linears and all(
        m._panels is not None and m._packed is None for m in linears
    )  # native: no oneDNN copy
    torch_ops = EngineCore(EngineConfig(model="tiny", kernels="torch")).runner.model.modules()
    linears = [m for m in torch_ops if isinstance(m, PackedLinear)]
    assert linears and all(m._panels is None and m._packed is not None for m in linears)
