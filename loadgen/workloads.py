"""Seeded, reproducible workloads: what each request asks for, and how that changes during a run.

A `Workload` turns (request index, send offset) into a `RequestSpec`. Every draw for request `i` comes
from a generator seeded with `(seed, i)`, so the same seed gives the same requests whatever the
concurrency, the order of completion or the shifts in force (a shift only scales what was drawn).

Lengths are given in tokens and turned into characters with `chars_per_token` (1.0 suits the engine's
byte-level tokenizer, where an ASCII character is one token; about 4 suits BPE tokenizers on English).

Kinds:
- `chat`: short user prompts, medium outputs (chat endpoint).
- `summarize`: long documents to summarize, short outputs (completions endpoint).
- `shared-prefix`: one long system prompt shared by every request (or one of `system_prompts` distinct ones,
  drawn per request: many tenants or assistants), short user turns (the prefix-cache case).
- `mixed`: chat and summarize together (`summarize_fraction` of them summarize).
- a JSONL file: one request per line, `prompt` or `messages`, `max_tokens`, optional arrival `timestamp`.

Shifts (`WorkloadShift`) reproduce the workload changes of fault scenarios from a given second on: prompt
lengths times K, answer lengths times K, arrival rate times K, and a changed prompt prefix for a fraction of
requests.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

BUILTIN_WORKLOADS = ("chat", "summarize", "shared-prefix", "mixed")
_SYLLABLES = ("ka", "to", "ri", "mu", "sen", "la", "vo", "pe", "di", "nor", "ath", "el", "qua", "zi", "bel")
_CHANGED_PREFIX_CHARS = 64  # more than a few KV blocks of a byte tokenizer: a changed prefix misses the cache


@dataclass(frozen=True, slots=True)
class WorkloadShift:
    """From `start_s` on: prompts `prompt_len_factor` times longer, answers `output_len_factor` times
    longer (max_tokens times K), arrivals `rate_factor` times faster (concurrency times K in closed-loop
    runs), and `prefix_change_fraction` of requests with a changed prompt prefix (so they miss the prefix
    cache). The latest shift that has started is in force."""

    start_s: float
    prompt_len_factor: float = 1.0
    rate_factor: float = 1.0
    prefix_change_fraction: float = 0.0
    output_len_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.start_s < 0:
            raise ValueError(f"shift start_s must be >= 0, got {self.start_s}")
        if self.prompt_len_factor <= 0 or self.rate_factor <= 0 or self.output_len_factor <= 0:
            raise ValueError("shift factors must be > 0")
        if not 0.0 <= self.prefix_change_fraction <= 1.0:
            raise ValueError("prefix_change_fraction must be in [0, 1]")


NO_SHIFT = WorkloadShift(start_s=0.0)


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A clipped log-normal length in tokens: long-tailed like real traffic, bounded for small models."""

    median: int
    sigma: float
    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.median <= self.high:
            raise ValueError(f"need 1 <= low <= median <= high, got {self}")

    def sample(self, rng: np.random.Generator) -> int:
        """One length in tokens."""
        n = round(self.median * np.exp(self.sigma * rng.standard_normal()))
        return int(np.clip(n, self.low, self.high))


@dataclass(slots=True)
class WorkloadConfig:
    """Every workload default lives here; the CLI is built from it."""

    name: str = "chat"
    seed: int = 0
    chars_per_token: float = 1.0
    chat_prompt: LengthDist = LengthDist(96, 0.6, 16, 512)
    chat_output: LengthDist = LengthDist(128, 0.5, 16, 384)
    summarize_prompt: LengthDist = LengthDist(1024, 0.3, 384, 1536)
    summarize_output: LengthDist = LengthDist(48, 0.4, 8, 128)
    system_prompt_tokens: int = 1024
    system_prompts: int = 1  # shared-prefix: distinct system prompts, one drawn per request
    shared_user_prompt: LengthDist = LengthDist(48, 0.5, 8, 256)
    shared_output: LengthDist = LengthDist(64, 0.5, 8, 256)
    summarize_fraction: float = 0.3  # of `mixed`
    max_prompt_tokens: int | None = None  # clip after shifts (None: let the server refuse what it cannot fit)
    shifts: tuple[WorkloadShift, ...] = ()

    def __post_init__(self) -> None:
        if self.chars_per_token <= 0:
            raise ValueError("chars_per_token must be > 0")
        if not 0.0 <= self.summarize_fraction <= 1.0:
            raise ValueError("summarize_fraction must be in [0, 1]")
        if self.system_prompts < 1:
            raise ValueError("system_prompts must be >= 1")
        self.shifts = tuple(sorted(self.shifts, key=lambda s: s.start_s))


@dataclass(slots=True)
class RequestSpec:
    """One request to send: a completion `prompt` or chat `messages`, and how many tokens to generate."""

    index: int
    kind: str
    max_tokens: int
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    prompt_tokens_est: int = 0
    timestamp_s: float | None = None  # replayed arrival offset
    prefix_changed: bool = False

    @property
    def endpoint(self) -> str:
        """The OpenAI path this request goes to."""
        return "/v1/chat/completions" if self.messages is not None else "/v1/completions"

    def body(self, model: str) -> dict[str, Any]:
        """The streaming request body (`ignore_eos` so output lengths follow the workload)."""
        b: dict[str, Any] = {
            "model": model,
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "temperature": 0.0,
        }
        if self.messages is not None:
            b["messages"] = self.messages
        else:
            b["prompt"] = self.prompt
        return b


class TextMaker:
    """Seeded pseudo-words of a fixed vocabulary, cut to an exact number of characters."""

    def __init__(self, seed: int, vocab_size: int = 2048) -> None:
        rng = np.random.default_rng([seed, 0xC0FFEE])
        parts = rng.integers(0, len(_SYLLABLES), size=(vocab_size, 3))
        sizes = rng.integers(1, 4, size=vocab_size)
        self.words = ["".join(_SYLLABLES[j] for j in row[:k]) for row, k in zip(parts, sizes, strict=True)]

    def text(self, n_chars: int, rng: np.random.Generator) -> str:
        """Exactly `n_chars` characters of space-separated words (ASCII: one byte each)."""
        if n_chars <= 0:
            return ""
        idx = rng.integers(0, len(self.words), size=n_chars // 4 + 2)
        out = " ".join(self.words[i] for i in idx)
        while len(out) < n_chars:
            out += " " + " ".join(self.words[i] for i in rng.integers(0, len(self.words), size=64))
        return out[:n_chars]


class Workload:
    """Makes the request for index `i` sent at offset `at_s`; seeded, shift-aware, cheap to call."""

    def __init__(self, config: WorkloadConfig, replay_rows: list[dict[str, Any]] | None = None) -> None:
        if config.name not in BUILTIN_WORKLOADS and not replay_rows:
            known = ", ".join(BUILTIN_WORKLOADS)
            raise ValueError(f"unknown workload {config.name!r}; choose {known} or a .jsonl file")
        self.config = config
        self.rows = replay_rows or []
        self.text = TextMaker(config.seed)
        self.system_prompt = self.text.text(self._chars(config.system_prompt_tokens), self._rng(-1))
        self.system_prompts = [self.system_prompt] + [
            self.text.text(
                self._chars(config.system_prompt_tokens), np.random.default_rng([config.seed, 0, 1000 + i])
            )
            for i in range(config.system_prompts - 1)
        ]
        self._timestamps = self._replay_timestamps()

    @classmethod
    def load(cls, name_or_path: str, config: WorkloadConfig | None = None) -> Workload:
        """A built-in workload by name, or a JSONL replay file (checked line by line)."""
        config = replace(config or WorkloadConfig(), name=name_or_path)
        if name_or_path in BUILTIN_WORKLOADS:
            return cls(config)
        return cls(config, replay_rows=read_jsonl(Path(name_or_path)))

    def shift_at(self, at_s: float) -> WorkloadShift:
        """The shift in force at `at_s` (the identity before the first one)."""
        current = NO_SHIFT
        for s in self.config.shifts:
            if s.start_s <= at_s:
                current = s
        return current

    def rate_changes(self) -> list[tuple[float, float]]:
        """`(start_s, rate_factor)` of every shift, for the arrival process."""
        return [(s.start_s, s.rate_factor) for s in self.config.shifts]

    def replay_timestamps(self) -> np.ndarray | None:
        """Arrival offsets of a replay file whose rows all carry `timestamp` (relative to the first)."""
        return self._timestamps

    def _replay_timestamps(self) -> np.ndarray | None:
        if not self.rows or any("timestamp" not in r for r in self.rows):
            return None
        ts = np.array([float(r["timestamp"]) for r in self.rows])
        return ts - ts.min()

    def request(self, index: int, at_s: float = 0.0) -> RequestSpec:
        """The request with this index, as it is sent at offset `at_s`."""
        rng = self._rng(index)
        shift = self.shift_at(at_s)
        if self.rows:
            spec = self._replay(index, rng, shift.prompt_len_factor)
        else:
            kind = self.config.name
            if kind == "mixed":
                kind = "summarize" if rng.random() < self.config.summarize_fraction else "chat"
            spec = _KINDS[kind](self, index, rng, shift.prompt_len_factor)
        # a separate stream, so that turning the shift on changes no other draw
        if np.random.default_rng([self.config.seed, index, 1]).random() < shift.prefix_change_fraction:
            self._change_prefix(spec, self._rng(index, 2))
        if shift.output_len_factor != 1.0:
            spec.max_tokens = max(1, round(spec.max_tokens * shift.output_len_factor))
        return spec

    # --- kinds -------------------------------------------------------------------------------------
    def _chat(self, index: int, rng: np.random.Generator, factor: float) -> RequestSpec:
        n = self._scaled(self.config.chat_prompt.sample(rng), factor)
        out = self.config.chat_output.sample(rng)
        user = self.text.text(self._chars(n), rng)
        messages = [{"role": "user", "content": user}]
        return RequestSpec(index, "chat", out, messages=messages, prompt_tokens_est=n)

    def _summarize(self, index: int, rng: np.random.Generator, factor: float) -> RequestSpec:
        n = self._scaled(self.config.summarize_prompt.sample(rng), factor)
        out = self.config.summarize_output.sample(rng)
        head = "Summarize:\n"
        doc = self.text.text(max(self._chars(n) - len(head), 0), rng)
        return RequestSpec(index, "summarize", out, prompt=head + doc, prompt_tokens_est=n)

    def _shared_prefix(self, index: int, rng: np.random.Generator, factor: float) -> RequestSpec:
        n = self._scaled(self.config.shared_user_prompt.sample(rng), factor)
        out = self.config.shared_output.sample(rng)
        system = (
            self.system_prompts[int(rng.integers(len(self.system_prompts)))]
            if len(self.system_prompts) > 1
            else self.system_prompt
        )
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": self.text.text(self._chars(n), rng)},
        ]
        est = n + self.config.system_prompt_tokens
        return RequestSpec(index, "shared-prefix", out, messages=messages, prompt_tokens_est=est)

    def _replay(self, index: int, rng: np.random.Generator, factor: float) -> RequestSpec:
        row = self.rows[index % len(self.rows)]
        ts = self._timestamps
        spec = RequestSpec(index, "replay", int(row.get("max_tokens", 128)))
        if ts is not None and index < len(ts):
            spec.timestamp_s = float(ts[index])
        if "messages" in row:
            spec.messages = [dict(m) for m in row["messages"]]
            last = spec.messages[-1]
            last["content"] = self._scale_text(last["content"], factor, rng)
            chars = sum(len(m["content"]) for m in spec.messages)
            spec.prompt_tokens_est = round(chars / self.config.chars_per_token)
        else:
            spec.prompt = self._scale_text(row["prompt"], factor, rng)
            spec.prompt_tokens_est = round(len(spec.prompt) / self.config.chars_per_token)
        return spec

    # --- helpers -----------------------------------------------------------------------------------
    def _rng(self, index: int, stream: int = 0) -> np.random.Generator:
        key = [self.config.seed, index + 1, stream] if index >= 0 else [self.config.seed]
        return np.random.default_rng(key)

    def _chars(self, tokens: int) -> int:
        return max(round(tokens * self.config.chars_per_token), 0)

    def _scaled(self, tokens: int, factor: float) -> int:
        n = max(round(tokens * factor), 1)
        cap = self.config.max_prompt_tokens
        return min(n, cap) if cap else n

    def _scale_text(self, text: str, factor: float, rng: np.random.Generator) -> str:
        if factor == 1.0:
            return text
        target = self._chars(self._scaled(round(len(text) / self.config.chars_per_token), factor))
        if target <= len(text):
            return text[:target]
        return text + " " + self.text.text(target - len(text) - 1, rng)

    def _change_prefix(self, spec: RequestSpec, rng: np.random.Generator) -> None:
        spec.prefix_changed = True
        if spec.messages is not None:
            first = spec.messages[0]
            first["content"] = self._replace_head(first["content"], rng)
        else:
            spec.prompt = self._replace_head(spec.prompt or "", rng)

    def _replace_head(self, text: str, rng: np.random.Generator) -> str:
        n = min(len(text), _CHANGED_PREFIX_CHARS)
        return self.text.text(n, rng) + text[n:]


# The request maker of each built-in kind (`mixed` draws one of chat and summarize per request).
_KINDS: dict[str, Callable[[Workload, int, np.random.Generator, float], RequestSpec]] = {
    "chat": Workload._chat,
    "summarize": Workload._summarize,
    "shared-prefix": Workload._shared_prefix,
}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Replay rows from a JSONL file; a bad line raises ValueError naming the line."""
    if not path.is_file():
        raise ValueError(f"workload {str(path)!r} is neither {', '.join(BUILTIN_WORKLOADS)} nor a file")
    rows: list[dict[str, Any]] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(row, dict) or not ({"prompt", "messages"} & row.keys()):
            raise ValueError(f"{path}:{n}: needs a 'prompt' or 'messages' field")
        if "max_tokens" in row and (not isinstance(row["max_tokens"], int) or row["max_tokens"] < 1):
            raise ValueError(f"{path}:{n}: max_tokens must be a positive integer")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no requests")
    return rows
