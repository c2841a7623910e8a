"""Our model matches Hugging Face transformers on the same config and weights, through the paged cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config
from transformers import LlamaForCausalLM as HFLlama
from transformers import Qwen2ForCausalLM as HFQwen2

from engine import kernels
from engine.attention import make_attention_metadata
from engine.config import ModelConfig, preset
from engine.kv_cache import allocate_kv_cache
from engine.loader import hf_config_dict, hf_state_dict
from engine.model import LlamaForCausalLM, build_model
from engine.reference import SingleSequence, greedy_generate

PROMPT = [256, *b"The quick brown fox jumps over"]


def to_transformers(model: LlamaForCausalLM) -> torch.nn.Module:
    """The same weights in an HF model (eager attention: the plainest reference)."""
    fields = hf_config_dict(model.config)
    arch = fields.pop("architectures")[0]
    fields.pop("model_type")
    config_cls, model_cls = (Qwen2Config, HFQwen2) if arch == "Qwen2ForCausalLM" else (LlamaConfig, HFLlama)
    hf = model_cls(config_cls(**fields, attn_implementation="eager"))
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False)
    assert not unexpected
    assert set(missing) <= ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    return hf.eval()


def hf_greedy(hf: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


QWEN_STYLE = dataclasses.replace(
    preset("tiny"), attention_bias=True, tie_word_embeddings=True, rope_theta=1e6
)


@pytest.fixture(params=["torch", "native"])
def ops(request: pytest.FixtureRequest) -> str:
    """Torch ops throughout, or the native CPU kernels (fused small ops, in-place decode attention)."""
    if request.param == "native" and kernels.library() is None:
        pytest.skip("the native kernels need a C compiler, and none is on this machine")
    return request.param


def native_model(cfg: ModelConfig, ops: str) -> tuple[torch.nn.Module, kernels.PagedDecodeKernel | None]:
    model = build_model(cfg, "cpu", torch.float32)
    if ops == "torch":
        return model, None
    model.fused = kernels.fused_ops()
    return model, kernels.paged_decode()


@pytest.mark.parametrize("cfg", [preset("tiny"), QWEN_STYLE], ids=["llama", "qwen2"])
def test_prefill_logits_match_transformers(cfg: ModelConfig, ops: str) -> None:
    model, _ = native_model(cfg, ops)
    ours = SingleSequence(model, max_len=64).feed(PROMPT)
    with torch.no_grad():
        theirs = to_transformers(model)(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_over_a_cached_prefix_matches_one_shot_prefill() -> None:
    model = build_model(preset("tiny"), "cpu", torch.float32)
    whole = SingleSequence(model, max_len=64).feed(PROMPT)
    chunked = SingleSequence(model, max_len=64, block_size=4)
    parts = [chunked.feed(PROMPT[:13]), chunked.feed(PROMPT[13:21]), chunked.feed(PROMPT[21:])]
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cfg", [preset("tiny"), QWEN_STYLE], ids=["llama", "qwen2"])
def test_greedy_decoding_matches_transformers(cfg: ModelConfig, ops: str) -> None:
    model, decode_kernel = native_model(cfg, ops)
    ours = greedy_generate(model, PROMPT, 20, block_size=4, decode_kernel=decode_kernel)
    assert ours == hf_greedy(to_transformers(model), PROMPT, 20)


@torch.inference_mode()
def test_a_mixed_batch_gives_each_sequence_its_own_logits() -> None:
    model = build_model(preset("tiny"), "cpu", torch.float32)
    a, b = PROMPT[:12], PROMPT[3:20]
    expected_a = SingleSequence(model, 32).feed(a)[-1]
    seq_b = SingleSequence(model, 32)
    seq_b.feed(b[:-1])
    expected_b = seq_b.feed(b[-1:])[-1]
    # one step: a whole prefill of `a` (blocks 0, 1) and the last token of `b` over its cached prefix
    caches = allocate_kv_cache(model.config, 8, 16, "cpu", torch.float32)
    prefix = SingleSequence(model, 32)
    prefix.feed(b[:-1])
    for cache, src in zip(caches, prefix.kv_caches, strict=True):
        cache[:, 4:6] = src[:, 0:2]
    meta = make_attention_metadata([len(a), 1], [len(a), len(b)], [[0, 1], [4, 5]], 16)
    ids = torch.tensor([*a, b[-1]])
    positions = torch.tensor([*range(len(a)), len(b) - 1])
    hidden = model(ids, positions, caches, meta)
    logits = model.compute_logits(hidden[meta.query_start_loc[1:] - 1])
    torch.testing.assert_close(logits, torch.stack([expected_a, expected_b]), atol=1e-5, rtol=1e-5)


def test_random_weights_are_seeded_and_deterministic() -> None:
    one = build_model(preset("tiny"), "cpu", torch.float32).state_dict()
    two = build_model(preset("tiny"), "cpu", torch.float32).state_dict()
    other = build_model(dataclasses.replace(preset("tiny"), seed=1), "cpu", torch.float32).state_dict()
    assert all(torch.equal(one[k], two[k]) for k in one)
    assert not torch.equal(one["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_random_model_greedy_output_varies_by_prompt_and_is_not_one_token() -> None:
    model = build_model(preset("tiny"), "cpu", torch.float32)
    outputs = [
        greedy_generate(model, [256, *p.encode()], 24) for p in ("Hello world", "1 2 3 4", "Once upon")
    ]
    assert len({tuple(o) for o in outputs}) == len(outputs)
    assert all(len(set(o)) > 4 for o in outputs)


def test_logits_are_float32_even_for_a_bf16_model() -> None:
    model = build_model(preset("tiny"), "cpu", torch.bfloat16)
    seq = SingleSequence(model, 16)
    logits = seq.feed(PROMPT[:8])
    assert logits.dtype == torch.float32 and logits.shape == (8, model.config.vocab_size)
    decode = seq.feed([int(logits[-1].argmax())])
    assert torch.isfinite(logits).all() and torch.isfinite(decode).all()
