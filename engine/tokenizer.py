"""Tokenizers: bytes for the random-weight presets, Hugging Face `tokenizers` for checkpoints.

Also the incremental detokenizer that turns a stream of generated ids into text without ever
emitting half of a multi-byte UTF-8 character.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.config import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_PAD_ID

_REPLACEMENT = "\ufffd"  # what a decoder emits for bytes that are not (yet) a whole character
# Syllables for the pseudo-words of ids above the byte range (a random-weight model emits those).
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_ENDINGS = ("", "", " ", " ", " ", "n ", ", ", ". ")


class Tokenizer:
    """What the engine needs from a tokenizer. Subclasses implement `encode` and `decode`."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`, with the BOS token first when `add_bos` and the tokenizer has one."""
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`; special tokens decode to nothing."""
        raise NotImplementedError

    def apply_chat_template(self, messages: list[dict]) -> str:
        """Chat messages -> prompt text, ending where the assistant's reply starts.

        The fixed template (used unless a checkpoint brings its own):

            <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n
        """
        parts = [f"<|{role}|>\n{content}\n" for role, content in _checked_messages(messages)]
        return "".join(parts) + "<|assistant|>\n"


class ByteTokenizer(Tokenizer):
    """Ids 0..255 are UTF-8 bytes, then BOS, EOS, PAD; higher ids decode to pseudo-word pieces.

    A random-weight model samples from its whole vocabulary; giving ids above the byte range a short
    deterministic piece of text ("ka", "ren ", "vo. ") makes its output read as text in the demo.
    """

    def __init__(self, vocab_size: int) -> None:
        if vocab_size <= BYTE_PAD_ID:
            raise ValueError(f"a byte tokenizer needs vocab_size > {BYTE_PAD_ID}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_token_id = BYTE_BOS_ID
        self.eos_token_id = BYTE_EOS_ID

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """UTF-8 bytes of `text`, after BOS when `add_bos`."""
        ids = list(text.encode("utf-8"))
        return [BYTE_BOS_ID, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        """Runs of byte ids decode as UTF-8 (invalid bytes become U+FFFD); specials decode to nothing."""
        out: list[str] = []
        run = bytearray()
        for token_id in ids:
            if 0 <= token_id < 256:
                run.append(token_id)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            if token_id > BYTE_PAD_ID:
                out.append(pseudo_word(token_id))
            elif token_id < 0:
                raise ValueError(f"negative token id {token_id}")
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


def pseudo_word(token_id: int) -> str:
    """A short, pronounceable, deterministic piece of text for an id above the byte range."""
    # Knuth's multiplicative hash, so that neighbouring ids get unrelated pieces.
    h = (token_id * 2654435761) % 2**32
    text = _syllable(h)
    if h & 0x10000:
        text += _syllable(h >> 8)
    return text + _ENDINGS[(h >> 20) % len(_ENDINGS)]


def _syllable(h: int) -> str:
    return _CONSONANTS[h % len(_CONSONANTS)] + _VOWELS[(h // len(_CONSONANTS)) % len(_VOWELS)]


class HFTokenizer(Tokenizer):
    """A checkpoint's tokenizer.json through the `tokenizers` package.

    BOS/EOS come from tokenizer_config.json (falling back to config.json). When the checkpoint has a
    Jinja `chat_template`, `apply_chat_template` renders it (with add_generation_prompt); otherwise the
    fixed template of `Tokenizer` is used.
    """

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _RustTokenizer

        p = Path(path)
        if not (p / "tokenizer.json").is_file():
            raise ValueError(f"{str(p)!r} has no tokenizer.json")
        self._tok = _RustTokenizer.from_file(str(p / "tokenizer.json"))
        tok_cfg = _read_json(p / "tokenizer_config.json")
        model_cfg = _read_json(p / "config.json")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._special_id(tok_cfg.get("bos_token"), model_cfg.get("bos_token_id"))
        self.eos_token_id = self._special_id(tok_cfg.get("eos_token"), model_cfg.get("eos_token_id"))
        self._chat_template = _pick_template(tok_cfg.get("chat_template"))
        self._bos_text = _token_text(tok_cfg.get("bos_token")) or ""
        self._eos_text = _token_text(tok_cfg.get("eos_token")) or ""

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Ids of `text`; `add_bos` runs the tokenizer's own post-processor (which adds BOS if it has one)."""
        ids = self._tok.encode(text, add_special_tokens=add_bos).ids
        # A chat template that already renders the BOS text must not get a second BOS.
        if add_bos and len(ids) > 1 and ids[0] == ids[1] == self.bos_token_id:
            ids = ids[1:]
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, skipping special tokens."""
        return self._tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> str:
        """The checkpoint's Jinja chat template when it has one, else the fixed template."""
        if self._chat_template is None:
            return super().apply_chat_template(messages)
        checked = [{"role": role, "content": content} for role, content in _checked_messages(messages)]
        return _render_jinja(self._chat_template, checked, self._bos_text, self._eos_text)

    def _special_id(self, token: Any, fallback: Any) -> int | None:
        text = _token_text(token)
        if text is not None and self._tok.token_to_id(text) is not None:
            return self._tok.token_to_id(text)
        if isinstance(fallback, list):
            return fallback[0] if fallback else None
        return fallback


class IncrementalDetokenizer:
    """Text of a growing id stream, piece by piece; never emits half of a multi-byte character.

    Each push decodes a small window of recent ids (from the last emitted boundary) and returns
    what it adds to the text; while the window ends in an incomplete character it holds back.
    Decoding the window with its preceding ids keeps tokenizers that drop a leading space correct.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix_offset = 0  # window start: ids before it are fully emitted
        self._read_offset = 0  # ids before it are emitted, those from the window start give context

    def push(self, ids: list[int]) -> str:
        """Add ids; return the text they complete ("" while a character is still incomplete)."""
        self.ids.extend(ids)
        prefix_text = self.tokenizer.decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self.tokenizer.decode(self.ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end of the stream: whatever is held back (an incomplete character decodes as U+FFFD)."""
        prefix_text = self.tokenizer.decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self.tokenizer.decode(self.ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self.ids)
        return new_text[len(prefix_text) :]


def get_tokenizer(model: str, vocab_size: int) -> Tokenizer:
    """The tokenizer for an `EngineConfig.model`: a checkpoint dir with tokenizer.json -> HFTokenizer;
    a preset name or a directory without one -> ByteTokenizer(vocab_size)."""
    p = Path(model)
    if p.is_dir() and (p / "tokenizer.json").is_file():
        return HFTokenizer(p)
    return ByteTokenizer(vocab_size)


def _checked_messages(messages: list[dict]) -> list[tuple[str, str]]:
    """(role, text) pairs; OpenAI-style content lists are joined from their text parts."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"message {i} must be an object with a string 'role'")
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"message {i} content must be a string or a list of text parts")
        out.append((message["role"], content))
    return out


def _render_jinja(template: str, messages: list[dict], bos_token: str, eos_token: str) -> str:
    # The same environment Hugging Face uses for chat templates (jinja2 comes with streamlit).
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(
            messages=messages, add_generation_prompt=True, bos_token=bos_token, eos_token=eos_token
        )
    except TemplateError as exc:
        raise ValueError(f"chat template failed: {exc}") from exc


def _pick_template(value: Any) -> str | None:
    # tokenizer_config.json holds a string, or a list of {"name", "template"} with a "default" entry.
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
