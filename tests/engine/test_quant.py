"""Int8 weights and int8 KV cache: numerics of the helpers, the engine's dtype plumbing, the
`weight_quant_off` fault, and quality against the unquantized model on the `small` preset.

The quality bar (also in docs/engine.md, Quantization):
- next-token agreement >= 0.9: at each position of a fixed text, the quantized model's greedy
  choice equals the unquantized one's (teacher forcing, so one flip does not decide the rest);
- logit cosine similarity >= 0.999 at every position.
Random-weight models have flat logits (the top two of 8192 are often closer than int8 noise), so
agreement is harder here than on a trained model; a correct implementation measures 0.97-1.0 and
cosine 0.99995 on `small`, and the same code with its scales on the wrong channels fails both.
"""

from __future__ import annotations

import copy
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.attention import dense_attention_reference, make_attention_metadata, paged_attention
from engine.channel import Channel
from engine.config import EngineConfig, ModelConfig, SamplingParams, preset
from engine.core import EngineCore
from engine.core_proc import CoreLoop
from engine.faults import EngineFaults, FaultSettings
from engine.kv_cache import Int8KVCache, Workspace, allocate_kv_cache, kv_cache_bytes_per_block
from engine.model import build_model
from engine.protocol import AdminReply, FaultSet, get_codec
from engine.quant import (
    DYNAMIC_MAX_ROWS,
    Int8Linear,
    dequantize_kv,
    dequantize_weight,
    int8_matmul,
    quantize_kv,
    quantize_model,
    quantize_weight,
)
from engine.reference import SingleSequence, continuation_logits
from engine.request import EngineRequest
from engine.serve_cli import engine_config
from stepscope.cli import UsageError

AGREEMENT_BAR = 0.9
COSINE_BAR = 0.999
CHECKPOINT_ENV = "STEPSCOPE_QUANT_CHECKPOINT"  # a HF checkpoint dir: the quality test runs on it too


def test_weight_round_trip_error_is_at_most_half_a_step_per_channel() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=g) * torch.linspace(0.01, 3.0, 96)[:, None]  # rows of other scale
    w_int8, scales = quantize_weight(w)
    assert w_int8.dtype == torch.int8 and scales.shape == (96,)
    assert w_int8.abs().max() <= 127 and (w_int8.abs().amax(dim=1) >= 126).all()  # each row uses its range
    err = (dequantize_weight(w_int8, scales, torch.float32) - w).abs()
    assert (err <= scales.float()[:, None] / 2 * 1.001).all()


def test_kv_round_trip_error_is_at_most_half_a_step_per_token_and_head() -> None:
    x = torch.randn(10, 2, 64, generator=torch.Generator().manual_seed(1))
    x[3] *= 100.0  # one loud token must not coarsen the others
    q, scales = quantize_kv(x)
    assert q.shape == x.shape and scales.shape == (10, 2)
    err = (dequantize_kv(q, scales, torch.float32) - x).abs()
    assert (err <= scales.float()[..., None] / 2 * 1.001).all()
    assert err[0].max() < 0.05


# each kernel path: a decode-sized batch (fbgemm's int8 x int8 on x86, else the bf16 packed kernel, which
# refuses K = 172), and a prefill-sized batch that dequantizes instead
@pytest.mark.parametrize(("in_features", "rows"), [(256, 3), (172, 3), (256, 30)])
def test_int8_linear_matches_the_dequantized_matmul(in_features: int, rows: int) -> None:
    g = torch.Generator().manual_seed(2)
    linear = torch.nn.Linear(in_features, 80, bias=True)
    with torch.no_grad():
        linear.weight.normal_(0, 0.05, generator=g)
    q = Int8Linear.from_linear(linear)
    x = torch.randn(rows, 5, in_features, generator=g)  # [B, T, K]: 3-D activations work too
    expected = F.linear(x, dequantize_weight(q.weight, q.scales, torch.float32), linear.bias)
    out = q(x)
    assert out.shape == (rows, 5, 80) and out.dtype == torch.float32
    # int8 or bf16 activations on the CPU kernels: about 2-3 significant digits
    torch.testing.assert_close(out, expected, atol=2e-2 * expected.abs().max().item(), rtol=0)


@pytest.mark.skipif(
    torch.backends.quantized.engine not in ("x86", "fbgemm"),
    reason="torch without fbgemm (a non-x86 CPU): int8 decode falls back to the bf16 kernel",
)
def test_decode_batches_take_fbgemm_int8_activations_repacked_when_the_weights_change() -> None:
    g = torch.Generator().manual_seed(4)
    linear = torch.nn.Linear(1024, 256, bias=False)
    with torch.no_grad():
        linear.weight.normal_(0, 0.02, generator=g)
    q = Int8Linear.from_linear(linear)
    x = torch.randn(DYNAMIC_MAX_ROWS, 1024, generator=g)
    expected = F.linear(x, dequantize_weight(q.weight, q.scales, torch.float32))
    out = q(x)
    assert q.packed() is not None
    assert not torch.equal(out, int8_matmul(x, q.weight, q.scales))  # not the weights-only bf16 kernel
    assert (out - expected).norm() / expected.norm() < 0.02  # one uint8 scale over the rows: ~1%
    torch.testing.assert_close(copy.deepcopy(q)(x), out, atol=0, rtol=0)  # a copy packs its own
    q.scales = q.scales * 2  # what the scales-on-the-wrong-channels test does: the packed copy follows
    torch.testing.assert_close(q(x), 2 * out, atol=1e-4 * out.abs().max().item(), rtol=0)


def test_quantize_model_swaps_every_linear_and_leaves_embeddings_and_norms() -> None:
    model = build_model(preset("tiny"), "cpu", torch.float32)
    swapped = quantize_model(model)
    assert "lm_head" in swapped and "model.layers.0.self_attn.qkv_proj" in swapped
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert model.model.embed_tokens.weight.dtype == torch.float32
    tied = build_model(ModelConfig(tie_word_embeddings=True), "cpu", torch.float32)
    assert "lm_head" not in quantize_model(tied)  # tied to the embedding: stays full precision with it


def _mixed_step_attention(
    kv_int8: bool, workspace: Workspace | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two sequences prefilled (29 and 20 tokens), then one step: a decode of the first and a chunk of 5
    tokens of the second over its cached prefix. Returns (that step's output [6, H, Dh], the float64
    dense reference of the same)."""
    cfg, bs = ModelConfig(num_heads=4, num_kv_heads=2, head_dim=64), 4
    g = torch.Generator().manual_seed(3)
    cache = allocate_kv_cache(cfg, 16, bs, "cpu", torch.float32, kv_int8=kv_int8)[0]
    k, v = torch.randn(2, 2, 30, 2, 64, generator=g).unbind(0)  # [seq, S, Hkv, Dh] each
    q = torch.randn(6, 4, 64, generator=g)  # [T, H, Dh]: 1 decode token, then 5 chunk tokens
    tables = [[3, 0, 7, 9, 1, 12, 2, 5], [4, 6, 8, 10, 11, 13, 14, 15]]
    fill = make_attention_metadata([29, 20], [29, 20], tables, bs)
    paged_attention(torch.zeros(49, 4, 64), torch.cat([k[0, :29], k[1, :20]]),
                    torch.cat([v[0, :29], v[1, :20]]), cache, fill, 0.125)  # fmt: skip
    step = make_attention_metadata([1, 5], [30, 25], tables, bs)
    step.workspace = workspace
    out = paged_attention(q, torch.cat([k[0, 29:30], k[1, 20:25]]), torch.cat([v[0, 29:30], v[1, 20:25]]),
                          cache, step, 0.125)  # fmt: skip
    ref = torch.cat([dense_attention_reference(q[:1], k[0], v[0], 0.125),
                     dense_attention_reference(q[1:], k[1, :25], v[1, :25], 0.125)])  # fmt: skip
    return out, ref


def test_int8_kv_attention_matches_full_precision_attention() -> None:
    out_fp, ref = _mixed_step_attention(kv_int8=False)
    out_q, _ = _mixed_step_attention(kv_int8=True)
    torch.testing.assert_close(out_fp, ref, atol=1e-5, rtol=1e-5)
    cosine = F.cosine_similarity(out_q.flatten(1), ref.flatten(1), dim=-1)  # per token
    assert cosine.min() > 0.999
    assert not torch.equal(out_q, out_fp)  # really read back from int8
    for workspace in (Workspace(), Workspace()):  # dequantized into a reused buffer: the same values
        out_ws, _ = _mixed_step_attention(kv_int8=True, workspace=workspace)
        torch.testing.assert_close(out_ws, out_q, rtol=0, atol=0)


def test_int8_kv_pool_holds_about_twice_the_tokens_of_bf16_in_the_same_bytes() -> None:
    cfg = preset("small")
    bf16, fp32 = (kv_cache_bytes_per_block(cfg, 16, d) for d in (torch.bfloat16, torch.float32))
    int8 = kv_cache_bytes_per_block(cfg, 16, torch.int8)
    assert 1.9 < bf16 / int8 < 2.0 and 3.8 < fp32 / int8 < 4.0  # 2 bytes of scale per 64 int8 values
    cache = allocate_kv_cache(cfg, 8, 16, "cpu", torch.float32, kv_int8=True)
    assert sum(c.nbytes for c in cache) == 8 * int8
    budget = 32 * 2**20
    cores = [
        EngineCore(EngineConfig(model="tiny", kv_cache_bytes=budget, kv_dtype=k)) for k in ("auto", "int8")
    ]
    assert cores[1].kv.num_blocks / cores[0].kv.num_blocks > 3.5  # tiny is fp32 on the CPU


def test_an_int8_kv_pool_grows_and_keeps_its_contents() -> None:
    core = EngineCore(EngineConfig(model="tiny", kv_dtype="int8", num_kv_blocks=8))
    core.add_request(EngineRequest("a", list(range(1, 40)), SamplingParams(max_tokens=2, temperature=0)))
    core.step()
    before = core.runner.kv_caches[0].values[:, :3].clone()
    core.update_limits(num_kv_blocks=20)
    cache = core.runner.kv_caches[0]
    assert isinstance(cache, Int8KVCache) and cache.shape[1] == 20
    assert torch.equal(cache.values[:, :3], before)


def test_bad_dtype_names_are_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="weight_dtype must be one of auto, fp32, bf16, fp16, int8"):
        EngineConfig(weight_dtype="int4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_dtype must be one of auto, int8"):
        EngineConfig(kv_dtype="fp8")  # type: ignore[arg-type]
    import argparse

    with pytest.raises(UsageError, match="--weight-dtype: expected one of"):
        engine_config(argparse.Namespace(weight_dtype="int4"))
    with pytest.raises(ValueError, match="contradicts"):
        EngineCore(EngineConfig(model="tiny", dtype="fp32", weight_dtype="bf16"))


def _decode_steps(core: EngineCore, steps: int) -> list:
    sampling = SamplingParams(max_tokens=steps + 1, temperature=0)
    core.add_request(EngineRequest(f"r{core.step_id}", list(range(1, 20)), sampling))
    core.step()  # the prefill
    core.drain_events()
    tokens = [out.new_token_ids for _ in range(steps) for out in core.step()]
    return [tokens, [e for e in core.drain_events() if type(e).__name__ == "StepEvent"]]


def test_weight_quant_off_switches_to_full_precision_and_back() -> None:
    core = EngineCore(EngineConfig(model="tiny", weight_dtype="int8", num_kv_blocks=32), record_events=True)
    faults = EngineFaults()
    tokens_int8, steps = _decode_steps(core, 3)
    assert {s.weight_dtype for s in steps} == {"int8"}
    faults.apply(FaultSettings(weight_quant_off=True), None, core)
    _, steps_off = _decode_steps(core, 3)
    assert {s.weight_dtype for s in steps_off} == {"fp32"}
    # same batch size and context: the difference is the weights, about 4x (norms and biases stay)
    assert steps_off[0].batch_size == steps[0].batch_size
    assert steps_off[0].bytes_read - steps[0].bytes_read > 2.5 * core.weight_bytes / 4
    faults.apply(FaultSettings(), None, core)
    tokens_back, steps_back = _decode_steps(core, 3)
    assert {s.weight_dtype for s in steps_back} == {"int8"} and steps_back[0].bytes_read == steps[
        0
    ].bytes_read
    assert tokens_back == tokens_int8  # the very same int8 modules came back


def test_weight_quant_off_reaches_the_core_through_the_admin_message() -> None:
    core = EngineCore(EngineConfig(model="tiny", weight_dtype="int8", num_kv_blocks=8))
    ours, theirs = socket.socketpair()
    loop = CoreLoop(core, Channel(theirs, get_codec()))
    front = Channel(ours, get_codec())
    loop.apply(FaultSet(1, {"weight_quant_off": True}))
    reply = front.receive(block=True, timeout=10)[0]
    assert isinstance(reply, AdminReply) and reply.ok and reply.payload["weight_quant_off"] is True
    assert core.weight_dtype == "fp32"
    ours.close()
    theirs.close()


def test_the_scenario_serves_int8_weights_for_the_weight_quant_off_fault(tmp_path: Path) -> None:
    from scenarios.config import ScenarioConfig
    from scenarios.faults import FAULTS

    args = ScenarioConfig(out=tmp_path, fault="weight_quant_off").engine_args()
    assert args[args.index("--weight-dtype") + 1] == "int8"
    assert "--weight-dtype" not in ScenarioConfig(out=tmp_path).engine_args()
    assert FAULTS["weight_quant_off"].engine(0.0) == {"weight_quant_off": True}  # type: ignore[misc]


def test_weight_quant_off_is_refused_on_an_engine_without_int8_weights() -> None:
    core = EngineCore(EngineConfig(model="tiny", num_kv_blocks=8))
    with pytest.raises(ValueError, match="--weight-dtype int8"):
        EngineFaults().apply(FaultSettings(weight_quant_off=True), None, core)
    with pytest.raises(ValueError, match="true or false"):
        FaultSettings.from_json({"weight_quant_off": 1})


# -- quality --------------------------------------------------------------------------------------
def _quality(model: torch.nn.Module, quantized: torch.nn.Module, kv_int8: bool) -> tuple[float, float]:
    """(next-token agreement, worst logit cosine) over 3 random prompts of 24 tokens + 64 text tokens."""
    g = torch.Generator().manual_seed(4)
    vocab = model.config.vocab_size
    agree, total, worst = 0, 0, 1.0
    for _ in range(3):
        prompt, text = torch.randint(0, vocab, (2, 64), generator=g).tolist()
        with torch.inference_mode():
            ref = continuation_logits(model, prompt[:24], text)  # [64, V]
            out = continuation_logits(quantized, prompt[:24], text, kv_int8=kv_int8)
        agree += int((ref.argmax(-1) == out.argmax(-1)).sum())
        total += ref.shape[0]
        worst = min(worst, F.cosine_similarity(ref, out, dim=-1).min().item())
    return agree / total, worst


@pytest.fixture(scope="module")
def small_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.set_num_threads(2)
    path = os.environ.get(CHECKPOINT_ENV)
    if path:
        from engine.loader import load_checkpoint

        model = load_checkpoint(path, torch.device("cpu"), torch.float32)[1]
    else:
        model = build_model(preset("small"), "cpu", torch.float32)
    quantized = copy.deepcopy(model)
    quantize_model(quantized)
    return model, quantized


def test_int8_weights_keep_greedy_choices_and_logits(small_models: tuple) -> None:
    model, quantized = small_models
    agreement, cosine = _quality(model, quantized, kv_int8=False)
    assert agreement >= AGREEMENT_BAR and cosine >= COSINE_BAR, (agreement, cosine)


def test_int8_kv_cache_keeps_greedy_choices_and_logits(small_models: tuple) -> None:
    model, _ = small_models
    agreement, cosine = _quality(model, model, kv_int8=True)
    assert agreement >= AGREEMENT_BAR and cosine >= COSINE_BAR, (agreement, cosine)


def test_int8_weights_keep_greedy_choices_and_logits_fed_a_token_at_a_time(small_models: tuple) -> None:
    # one row per forward: the decode kernel (int8 activations on x86) at every position, as served
    model, quantized = small_models
    prompt, text = torch.randint(
        0, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(5)
    )
    with torch.inference_mode():
        ref = continuation_logits(model, prompt.tolist(), text.tolist())  # [48, V]
        seq = SingleSequence(quantized, 96)
        out = torch.cat([seq.feed(prompt.tolist())[-1:], *(seq.feed([t]) for t in text[:-1].tolist())])
    agreement = (ref.argmax(-1) == out.argmax(-1)).float().mean().item()
    cosine = F.cosine_similarity(ref, out, dim=-1).min().item()
    assert agreement >= AGREEMENT_BAR and cosine >= COSINE_BAR, (agreement, cosine)


def test_the_bar_fails_scales_on_the_wrong_channels(small_models: tuple) -> None:
    model, quantized = small_models
    broken = copy.deepcopy(quantized)
    for m in broken.modules():
        if isinstance(m, Int8Linear):
            m.scales = m.scales.roll(1)  # each channel dequantized with its neighbour's scale
    agreement, cosine = _quality(model, broken, kv_int8=False)
    assert agreement < AGREEMENT_BAR and cosine < COSINE_BAR, (agreement, cosine)
