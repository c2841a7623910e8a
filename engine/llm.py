"""Offline generation: drive an `EngineCore` to completion over a list of prompts (tests, benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig, SamplingParams
from engine.core import EngineCore
from engine.request import EngineRequest, RequestOutput


@dataclass(slots=True)
class Generation:
    req_id: str
    token_ids: list[int]
    finish_reason: str | None
    num_cached_tokens: int
    num_preemptions: int


class LLM:
    """`LLM(EngineConfig(model="tiny")).generate([[1, 2, 3]], SamplingParams(temperature=0))`."""

    def __init__(self, config: EngineConfig | None = None, core: EngineCore | None = None) -> None:
        self.core = core or EngineCore(config or EngineConfig())
        self._next_id = 0

    def generate(
        self,
        prompts: list[list[int]] | list[str],
        sampling: SamplingParams | list[SamplingParams],
        cache_salt: str = "",
    ) -> list[Generation]:
        """Run every prompt to completion, all submitted at once; results in prompt order."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        ids = []
        for prompt, sp in zip(prompts, params, strict=True):
            tokens = self.core.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            req_id = f"offline-{self._next_id}"
            self._next_id += 1
            self.core.add_request(EngineRequest(req_id, list(tokens), sp, cache_salt=cache_salt))
            ids.append(req_id)
        results = self.run_to_completion()
        return [results[i] for i in ids]

    def run_to_completion(self) -> dict[str, Generation]:
        tokens: dict[str, list[int]] = {}
        done: dict[str, Generation] = {}
        while self.core.has_unfinished_requests():
            for out in self.core.step():
                tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
                if out.finished:
                    done[out.req_id] = _generation(out, tokens.pop(out.req_id))
        return done


def _generation(out: RequestOutput, token_ids: list[int]) -> Generation:
    return Generation(out.req_id, token_ids, out.finish_reason, out.num_cached_tokens, out.num_preemptions)
