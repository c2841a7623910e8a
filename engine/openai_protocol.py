"""OpenAI API shapes: request validation, response and stream-chunk bodies, errors, stop strings.

Validation is by hand rather than through pydantic so every refusal is a 400 in OpenAI's error
shape naming the offending `param`, never FastAPI's 422. Sampling defaults come from
`SamplingParams`, the one place they live.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from engine.config import SamplingParams

_DEFAULTS = SamplingParams()
DEFAULT_MAX_TOKENS = _DEFAULTS.max_tokens  # completions; chat defaults to the rest of the context
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
SSE_DONE = b"data: [DONE]\n\n"


class APIError(Exception):
    """A refusal the client caused (or, for 5xx, one it should retry); rendered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(slots=True)
class GenerateRequest:
    """A validated completion or chat request, not yet tokenized."""

    model: str | None
    prompt: str | None = None  # completions: text ...
    prompt_token_ids: list[int] | None = None  # ... or token ids
    messages: list[dict[str, str]] | None = None  # chat
    max_tokens: int | None = None  # None: the endpoint's default
    temperature: float = _DEFAULTS.temperature
    top_p: float = _DEFAULTS.top_p
    top_k: int = _DEFAULTS.top_k
    seed: int | None = _DEFAULTS.seed
    ignore_eos: bool = _DEFAULTS.ignore_eos
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    cache_salt: str = ""

    def sampling(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
        )


def parse_json(raw: bytes) -> dict[str, object]:
    """The request body as a JSON object, or a 400."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def parse_completion(body: dict[str, object]) -> GenerateRequest:
    """A `/v1/completions` body. `prompt` is a string or a list of token ids (one prompt only)."""
    req = _parse_common(body, "max_tokens")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        req.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        req.prompt_token_ids = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        raise APIError(400, "a list of prompts is not supported; send one prompt per request", "prompt")
    else:
        raise APIError(400, "prompt must be a string or a non-empty list of token ids", "prompt")
    if body.get("echo"):
        raise APIError(400, "echo is not supported", "echo")
    return req


def parse_chat(body: dict[str, object]) -> GenerateRequest:
    """A `/v1/chat/completions` body; `max_completion_tokens` is the newer name of `max_tokens`."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    req = _parse_common(body, name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", "messages")
    req.messages = [_chat_message(m, i) for i, m in enumerate(messages)]
    return req


def _parse_common(body: dict[str, object], max_tokens_name: str) -> GenerateRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, "model must be a string", "model")
    n = _int(body, "n", 1, lo=1)
    if n != 1 or _int(body, "best_of", 1, lo=1) != 1:
        raise APIError(400, "only n=1 is supported", "n")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise APIError(400, "logprobs are not supported", "logprobs")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise APIError(400, "stream_options must be an object", "stream_options")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise APIError(400, "user must be a string", "user")
    return GenerateRequest(
        model=model,
        max_tokens=_int(body, max_tokens_name, None, lo=1),
        temperature=_number(body, "temperature", _DEFAULTS.temperature, lo=0.0),
        top_p=_number(body, "top_p", _DEFAULTS.top_p, lo=0.0, lo_open=True, hi=1.0),
        top_k=_top_k(body),
        seed=_int(body, "seed", _DEFAULTS.seed),
        ignore_eos=_bool(body, "ignore_eos", _DEFAULTS.ignore_eos),
        stop=_stop(body.get("stop")),
        stream=_bool(body, "stream", False),
        include_usage=_bool(stream_options or {}, "include_usage", False, param="stream_options"),
        cache_salt=_str(body, "cache_salt", ""),
    )


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(body: dict, name: str, default: int | None, lo: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise APIError(400, f"{name} must be an integer, got {json.dumps(v)[:40]}", name)
    if lo is not None and v < lo:
        raise APIError(400, f"{name} must be >= {lo}, got {v}", name)
    return v


def _number(
    body: dict, name: str, default: float, lo: float, lo_open: bool = False, hi: float = 1e9
) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise APIError(400, f"{name} must be a number, got {json.dumps(v)[:40]}", name)
    if v < lo or (lo_open and v == lo) or v > hi:
        interval = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise APIError(400, f"{name} must be in {interval}, got {v}", name)
    return float(v)


def _top_k(body: dict) -> int:
    v = _int(body, "top_k", _DEFAULTS.top_k, lo=-1)
    return 0 if v == -1 else v  # vLLM spells "no top-k" as -1; the engine as 0


def _bool(body: dict, name: str, default: bool, param: str | None = None) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise APIError(400, f"{name} must be true or false", param or name)
    return v


def _str(body: dict, name: str, default: str) -> str:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, str):
        raise APIError(400, f"{name} must be a string", name)
    return v


def _stop(v: object) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise APIError(400, "stop must be a string or a list of strings", "stop")
    return [s for s in v if s]


def _chat_message(m: object, i: int) -> dict[str, str]:
    param = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
        raise APIError(400, f"{param} must be an object with a role in {list(CHAT_ROLES)}", param)
    content = m.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):  # content parts: only text is supported
        if not all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        ):
            raise APIError(400, f"{param}.content: only text parts are supported", f"{param}.content")
        content = "".join(p["text"] for p in content)
    elif not isinstance(content, str):
        raise APIError(400, f"{param}.content must be a string or a list of text parts", f"{param}.content")
    return {"role": m["role"], "content": content}


# -- responses -----------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, object]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_body(
    rid: str,
    created: int,
    model: str,
    text: str | None,
    finish_reason: str | None,
    usage_: dict | None = None,
) -> dict[str, object]:
    """A completion (stream chunk when `usage_` is None and not final); `text=None` means no choice."""
    choices = (
        [] if text is None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
    )
    body: dict[str, object] = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body


def chat_body(
    rid: str, created: int, model: str, content: str, finish_reason: str | None, usage_: dict
) -> dict[str, object]:
    message = {"role": "assistant", "content": content}
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage_,
    }


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict | None,
    finish_reason: str | None = None,
    usage_: dict | None = None,
) -> dict[str, object]:
    """A `chat.completion.chunk`; `delta=None` gives the final usage chunk with no choices."""
    choices = (
        []
        if delta is None
        else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    )
    body: dict[str, object] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body


def sse(obj: dict[str, object]) -> bytes:
    """One server-sent event as OpenAI streams it."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


# -- stop strings --------------------------------------------------------------------------------
class StopStrings:
    """Applies stop strings to a growing text; holds back a tail that could be the start of one.

    `push(text)` returns what is safe to send now; `stopped` turns true at the first stop string,
    whose text (and everything after it) is never sent. `flush()` gives the held tail at the end.
    """

    def __init__(self, stop: list[str]) -> None:
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def push(self, new_text: str) -> str:
        scanned = len(self.text)
        self.text += new_text
        hits = [i for s in self.stop if (i := self.text.find(s, max(0, scanned - len(s) + 1))) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
            return self.flush()
        end = max(len(self.text) - self.hold, self.sent)
        out, self.sent = self.text[self.sent : end], end
        return out

    def flush(self) -> str:
        out, self.sent = self.text[self.sent :], len(self.text)
        return out
