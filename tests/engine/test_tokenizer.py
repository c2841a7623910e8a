"""Tokenizers and the incremental detokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from engine.config import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_PAD_ID
from engine.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDetokenizer, get_tokenizer

TEXT = "Grüße, 世界! naïve café 🙂"


def test_byte_tokenizer_round_trips_utf8() -> None:
    tok = ByteTokenizer(512)
    ids = tok.encode(TEXT)
    assert ids[0] == BYTE_BOS_ID and ids[1:] == list(TEXT.encode())
    assert tok.decode(ids) == TEXT
    assert tok.encode("hi", add_bos=False) == [104, 105]
    assert tok.decode([BYTE_BOS_ID, 104, BYTE_PAD_ID, 105, BYTE_EOS_ID]) == "hi"


def test_high_ids_decode_to_deterministic_pseudo_words() -> None:
    tok = ByteTokenizer(8192)
    pieces = [tok.decode([i]) for i in range(259, 400)]
    assert all(p and p.strip(" ,.").isalpha() and p.isascii() for p in pieces)
    assert pieces == [ByteTokenizer(8192).decode([i]) for i in range(259, 400)]
    assert len(set(pieces)) > 50
    assert " " in tok.decode(list(range(300, 320)))  # reads as words, not one long run


def test_byte_tokenizer_rejects_a_vocab_without_room_for_specials() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        ByteTokenizer(200)


def test_incremental_detokenizer_never_emits_half_a_character() -> None:
    tok = ByteTokenizer(512)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push([b]) for b in TEXT.encode()]  # one byte at a time: characters split across pushes
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[list(TEXT.encode()).index(0xE4)] == ""  # first byte of 世 alone: held back


def test_incremental_detokenizer_with_mixed_chunks_and_pseudo_words() -> None:
    tok = ByteTokenizer(512)
    ids = [*"é".encode(), 300, *"🙂".encode(), 301]
    detok = IncrementalDetokenizer(tok)
    text = detok.push(ids[:1]) + detok.push(ids[1:4]) + detok.push(ids[4:6]) + detok.push(ids[6:])
    assert text + detok.flush() == tok.decode(ids)


def test_flush_emits_a_dangling_partial_character_as_replacement() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer(512))
    assert detok.push([104, 0xE4]) == ""
    assert detok.flush() == "h\ufffd"


def _write_hf_tokenizer(directory: Path) -> None:
    """A tiny byte-level BPE trained on a few sentences, saved like a HF checkpoint's tokenizer."""
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["the quick brown fox", "jumps over the lazy dog", TEXT] * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(directory / "tokenizer.json"))
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": template + "<assistant>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def test_hf_tokenizer_round_trip_and_specials(tmp_path: Path) -> None:
    _write_hf_tokenizer(tmp_path)
    tok = get_tokenizer(str(tmp_path), vocab_size=999)
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    ids = tok.encode(TEXT)
    assert ids[0] == 0 and tok.encode(TEXT, add_bos=False) == ids[1:]
    assert tok.decode(ids) == TEXT
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.push([i]) for i in ids) + detok.flush() == TEXT


def test_hf_tokenizer_renders_the_checkpoint_chat_template(tmp_path: Path) -> None:
    _write_hf_tokenizer(tmp_path)
    tok = get_tokenizer(str(tmp_path), vocab_size=999)
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert text == "<user>hi</s><assistant>"


def test_fixed_chat_template_and_bad_messages() -> None:
    tok = get_tokenizer("tiny", vocab_size=512)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages) == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    with pytest.raises(ValueError):
        tok.apply_chat_template([{"content": "no role"}])
    with pytest.raises(ValueError):
        tok.apply_chat_template([])


def test_directory_without_tokenizer_json_gets_bytes(tmp_path: Path) -> None:
    assert isinstance(get_tokenizer(str(tmp_path), vocab_size=512), ByteTokenizer)
