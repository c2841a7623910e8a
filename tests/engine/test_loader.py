"""Loading a Hugging Face checkpoint directory: weights, config and tokenizer match transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, pre_tokenizers, trainers
from transformers import LlamaConfig, Qwen2Config
from transformers import LlamaForCausalLM as HFLlama
from transformers import Qwen2ForCausalLM as HFQwen2

from engine.loader import CheckpointError, is_checkpoint_dir, load_checkpoint
from engine.reference import SingleSequence, greedy_generate
from engine.tokenizer import HFTokenizer, get_tokenizer

SENTENCES = ["the cat sat on the mat", "the dog ate the bone", "a cat and a dog"]
SMALL = dict(
    vocab_size=64,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)


def _write_tokenizer(directory: Path) -> None:
    tok = RustTokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(SENTENCES, trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def _save_hf(directory: Path, hf_model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():  # HF init is tiny and smooth; wider weights make a sharper comparison
        for p in hf_model.parameters():
            p.normal_(0.0, 0.3)
    hf_model.save_pretrained(str(directory), safe_serialization=True)
    _write_tokenizer(directory)
    return hf_model.eval()


@pytest.fixture
def llama_dir(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    config = LlamaConfig(**SMALL, head_dim=8, rope_theta=500.0, attn_implementation="eager")
    return tmp_path, _save_hf(tmp_path, HFLlama(config))


def test_loaded_llama_matches_transformers(llama_dir: tuple[Path, torch.nn.Module]) -> None:
    path, hf = llama_dir
    assert is_checkpoint_dir(path)
    cfg, model = load_checkpoint(path, "cpu", torch.float32)
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta) == (2, 2, 8, 500.0)
    assert (cfg.max_model_len, cfg.bos_token_id, cfg.eos_token_id) == (128, 1, 2)
    tok = get_tokenizer(str(path), cfg.vocab_size)
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    prompt = [tok.bos_token_id, *tok.encode("the cat sat on the", add_bos=False)]
    assert tok.decode(prompt) == "the cat sat on the"
    ours = SingleSequence(model, 64).feed(prompt)
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    expected = hf.generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt) :]
    assert greedy_generate(model, prompt, 12) == expected.tolist()


def test_loaded_qwen2_with_tied_embeddings_matches_transformers(tmp_path: Path) -> None:
    config = Qwen2Config(**SMALL, tie_word_embeddings=True, attn_implementation="eager")
    hf = _save_hf(tmp_path, HFQwen2(config))
    cfg, model = load_checkpoint(tmp_path, "cpu", torch.float32)
    assert cfg.attention_bias and cfg.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    prompt = [1, 5, 9, 3, 7, 11, 4]
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(SingleSequence(model, 32).feed(prompt), theirs, atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    hf = HFLlama(LlamaConfig(**SMALL, head_dim=8, attn_implementation="eager"))
    hf.save_pretrained(str(tmp_path), safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    _, model = load_checkpoint(tmp_path, "cpu", torch.float32)
    with torch.no_grad():
        theirs = hf.eval()(torch.tensor([[1, 4, 6]])).logits[0]
    torch.testing.assert_close(SingleSequence(model, 16).feed([1, 4, 6]), theirs, atol=1e-4, rtol=1e-4)


def test_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    assert not is_checkpoint_dir(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope", "cpu", torch.float32)
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_checkpoint(tmp_path, "cpu", torch.float32)


def test_unsupported_architecture_and_missing_weights_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel"):
        load_checkpoint(tmp_path, "cpu", torch.float32)
    LlamaConfig(**SMALL, head_dim=8).save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(CheckpointError, match="safetensors"):
        load_checkpoint(tmp_path, "cpu", torch.float32)


def test_unsupported_rope_scaling_is_a_clear_error(llama_dir: tuple[Path, torch.nn.Module]) -> None:
    path, _ = llama_dir
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="yarn"):
        load_checkpoint(path, "cpu", torch.float32)
