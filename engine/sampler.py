"""Next-token sampling for a batch: greedy, temperature, top-k, top-p; per-request seeds.

A seeded request draws its noise only from its own generator, and every operation here works row
by row, so its tokens do not depend on which other requests share the batch.
"""

from __future__ import annotations

import torch

from engine.config import SamplingParams


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator for one seeded request, on the device its logits live on."""
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(seed)
    return generator


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """logits [B, V] float32 -> one token id per row.

    Rows with temperature 0 take the argmax; the others sample after temperature, top-k and top-p,
    drawing from `generators[i]` when given (seeded requests) and from the global RNG otherwise.
    An all-greedy batch costs one argmax.
    """
    tokens = logits.argmax(dim=-1)  # [B]
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        picked = _sample_rows(logits[rows], [params[i] for i in rows], [generators[i] for i in rows])
        tokens[rows] = picked
    return tokens.tolist()


def _sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """logits [N, V] of non-greedy rows -> token ids [N]."""
    vocab = logits.shape[-1]
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    scaled = logits / temps[:, None]  # [N, V]
    if any(0 < p.top_k < vocab or p.top_p < 1 for p in params):
        scaled = _top_k_top_p(scaled, params)
    probs = scaled.softmax(dim=-1)  # [N, V]
    return (probs / _exponential_noise(probs, generators)).argmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, then outside its top-p nucleus (HF order)."""
    vocab = logits.shape[-1]
    dev = logits.device
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=dev)
    # top_p 1 rows must keep every token, even where the float cumsum reaches 1 early
    top_p = torch.tensor([p.top_p if p.top_p < 1 else 2.0 for p in params], dtype=logits.dtype, device=dev)
    # stable: among equal logits the lowest id ranks first, as in argmax, so top_k=1 is greedy
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [N, V]
    ranks = torch.arange(vocab, device=dev)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # drop a token when the tokens ranked above it already reach top_p (the first always stays)
    outside = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _exponential_noise(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Exp(1) noise [N, V]: argmax(probs / noise) is a draw from probs (the exponential race)."""
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        noise[unseeded] = torch.empty_like(probs[unseeded]).exponential_()
    for i, generator in enumerate(generators):
        if generator is not None:
            noise[i].exponential_(generator=generator)
    # exponential_ may return exactly 0; 0/0 would be NaN, which argmax would pick
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)
