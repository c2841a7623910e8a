"""Sampling: greedy is argmax, seeded draws are reproducible and ignore their batch neighbours."""

from __future__ import annotations

import torch

from engine.config import SamplingParams
from engine.sampler import make_generator, sample

VOCAB = 300


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_take_the_argmax() -> None:
    logits = _logits(5)
    assert sample(logits, [SamplingParams(temperature=0)] * 5, [None] * 5) == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible() -> None:
    logits = _logits(1)
    params = [SamplingParams(temperature=1.0, seed=7)]
    first = [sample(logits, params, [g])[0] for g in [make_generator(7, "cpu")] for _ in range(20)]
    second = [sample(logits, params, [g])[0] for g in [make_generator(7, "cpu")] for _ in range(20)]
    assert first == second
    assert len(set(first)) > 1  # it does sample, not argmax


def test_seeded_request_does_not_depend_on_its_batch_neighbours() -> None:
    logits = _logits(4)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=3)
    alone_gen, batched_gen = make_generator(3, "cpu"), make_generator(3, "cpu")
    neighbours = [SamplingParams(temperature=1.5), SamplingParams(temperature=0), SamplingParams(top_k=5)]
    for _ in range(10):
        alone = sample(logits[2:3], [seeded], [alone_gen])[0]
        batch = sample(
            logits, [neighbours[0], neighbours[1], seeded, neighbours[2]], [None, None, batched_gen, None]
        )
        assert batch[2] == alone
        assert batch[1] == int(logits[1].argmax())


def test_top_k_one_equals_greedy() -> None:
    logits = _logits(6, seed=1)
    params = [SamplingParams(temperature=1.3, top_k=1)] * 6
    assert sample(logits, params, [None] * 6) == logits.argmax(-1).tolist()


def test_tiny_top_p_equals_greedy() -> None:
    logits = _logits(6, seed=2)
    params = [SamplingParams(temperature=0.7, top_p=1e-6)] * 6
    assert sample(logits, params, [None] * 6) == logits.argmax(-1).tolist()


def test_top_k_draws_stay_inside_the_top_k() -> None:
    logits = _logits(1, seed=4)
    allowed = set(logits[0].topk(3).indices.tolist())
    gen = make_generator(0, "cpu")
    draws = {sample(logits, [SamplingParams(temperature=2.0, top_k=3)], [gen])[0] for _ in range(50)}
    assert draws <= allowed and len(draws) > 1


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1] + [0.0] * (VOCAB - 3)]))
    gen = make_generator(1, "cpu")
    draws = [sample(logits, [SamplingParams(temperature=1.0)], [gen])[0] for _ in range(2000)]
    assert set(draws) <= {0, 1, 2}
    assert abs(draws.count(0) / 2000 - 0.7) < 0.05
