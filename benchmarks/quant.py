"""Int8 weights and int8 KV cache on the `bench` preset: decode speed, KV capacity, greedy agreement.

    python benchmarks/quant.py [--model bench] [--threads 2] [--context 64]

- Decode step time at batch 1, 8 and 32 with fp32 and int8 weights: two engines, the same requests,
  their steps interleaved (fp32, int8, fp32, ...) so that a noisy neighbour slows both alike; the
  median full engine step (schedule + forward + sample) after warm-up, and the bytes each step reads.
- KV capacity: the most sequences of `--seq-len` tokens whose blocks the real block manager grants
  from a pool of `--kv-budget-mb`, sized the way the engine sizes it, with fp32 and int8 KV (and bf16,
  the CUDA default, for the ratio a GPU deployment sees).
- Greedy agreement over 64-token continuations: the fp32 engine's greedy continuation of 4 prompts;
  then, teacher-forced along it, the fraction of positions where the quantized model's greedy choice
  is the fp32 model's (`greedy_agreement`, int8 weights; `kv_int8_greedy_agreement`). The continuation
  runs as one chunk there; `greedy_agreement_decode` feeds it one token per forward instead, so every
  position goes through the decode kernel (on x86 CPUs int8 activations too, engine/quant.py), as served.
  Free-running int8 decoding is also reported as the matching prefix until the first different token
  (`greedy_prefix_agreement`): on random weights one flip sends the rest elsewhere (docs/engine.md).

The last line printed is one JSON object; the same goes to `benchmarks/results/<date>-<commit>-quant.json`
with the CPU model, core count, load average before and after, and the arguments (stepscope/results.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

from engine.block_manager import KVCacheManager
from engine.config import EngineConfig, SamplingParams, preset
from engine.core import EngineCore, kv_block_bytes
from engine.events import StepEvent
from engine.llm import LLM
from engine.reference import SingleSequence, continuation_logits
from engine.request import EngineRequest
from engine.sequence import Sequence
from stepscope import results

BATCHES = (1, 8, 32)
CONTINUATION = 64


def decode_steps(cores: dict[str, EngineCore], batch: int, context: int, steps: int) -> dict[str, tuple]:
    """Per core: (median step ms, bytes read per step) with `batch` sequences decoding, steps interleaved."""
    sp = SamplingParams(max_tokens=steps + 6, temperature=0, ignore_eos=True)
    for name, core in cores.items():
        core.update_limits(max_num_seqs=batch, max_num_batched_tokens=max(batch * context, 512))
        for i in range(batch):
            prompt = [(7 * i + j) % 30000 + 1 for j in range(context)]
            core.add_request(EngineRequest(f"{name}-{batch}-{i}", prompt, sp))
        for _ in range(4):
            core.step()  # the prefill, then warm-up decodes
        core.drain_events()
    times: dict[str, list[float]] = {name: [] for name in cores}
    for _ in range(steps):
        for name, core in cores.items():
            t0 = time.perf_counter()
            core.step()
            times[name].append(time.perf_counter() - t0)
    result = {}
    for name, core in cores.items():
        bytes_read = [e.bytes_read for e in core.drain_events() if isinstance(e, StepEvent)]
        while core.has_unfinished_requests():
            core.step()
        core.drain_events()
        result[name] = (_median(times[name]) * 1000, _median(bytes_read))
    return result


def kv_capacity(model: str, kv_dtype: str, model_dtype: torch.dtype, budget: int, seq_len: int) -> int:
    """Sequences of `seq_len` tokens the block manager admits at once from a pool of `budget` bytes."""
    config = EngineConfig(model=model, kv_dtype=kv_dtype, kv_cache_bytes=budget)  # type: ignore[arg-type]
    num_blocks = budget // kv_block_bytes(config, preset(model), model_dtype)
    manager = KVCacheManager(num_blocks, config.block_size, enable_prefix_caching=False)
    n = 0
    while True:
        seq = Sequence.from_request(EngineRequest(f"s{n}", [n % 250 + 1] * seq_len, SamplingParams()))
        if not manager.allocate_slots(seq, seq_len):
            return n
        n += 1


def agreement(fp32: EngineCore, int8: EngineCore, prompts: list[list[int]]) -> dict[str, float]:
    """Teacher-forced agreement (int8 weights; int8 KV) along the fp32 continuations, and the free-running
    matching prefix of int8 weights."""
    sp = SamplingParams(max_tokens=CONTINUATION, temperature=0, ignore_eos=True)
    reference = [g.token_ids for g in LLM(core=fp32).generate(prompts, [sp] * len(prompts))]
    free = [g.token_ids for g in LLM(core=int8).generate(prompts, [sp] * len(prompts))]
    same = {"w8": 0, "w8_decode": 0, "kv8": 0}
    with torch.inference_mode():
        for prompt, cont in zip(prompts, reference, strict=True):
            base = continuation_logits(fp32.runner.model, prompt, cont).argmax(-1)  # [C]
            w8 = continuation_logits(int8.runner.model, prompt, cont).argmax(-1)
            kv8 = continuation_logits(fp32.runner.model, prompt, cont, kv_int8=True).argmax(-1)
            same["w8"] += int((w8 == base).sum())
            same["w8_decode"] += int((decode_choices(int8.runner.model, prompt, cont) == base).sum())
            same["kv8"] += int((kv8 == base).sum())
    total = CONTINUATION * len(prompts)
    prefix = sum(_common_prefix(a, b) for a, b in zip(reference, free, strict=True))
    return {
        "greedy_agreement": round(same["w8"] / total, 4),
        "greedy_agreement_decode": round(same["w8_decode"] / total, 4),
        "kv_int8_greedy_agreement": round(same["kv8"] / total, 4),
        "greedy_prefix_agreement": round(prefix / total, 4),
    }


def decode_choices(model: torch.nn.Module, prompt: list[int], cont: list[int]) -> torch.Tensor:
    """Teacher forcing one token per forward (batch-1 decode steps): the greedy choice at each of cont's
    positions, [C]."""
    seq = SingleSequence(model, len(prompt) + len(cont))
    logits = [seq.feed(prompt)[-1]]
    logits += [seq.feed([token])[-1] for token in cont[:-1]]
    return torch.stack(logits).argmax(-1)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=64, help="tokens of history per decoding sequence")
    ap.add_argument("--steps", type=int, default=15, help="timed decode steps per batch size")
    ap.add_argument("--kv-budget-mb", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    load_before = os.getloadavg()
    torch.set_num_threads(args.threads)

    base = dict(model=args.model, num_kv_blocks=512, num_threads=args.threads, seed=args.seed)
    cores = {
        w: EngineCore(EngineConfig(weight_dtype=w, **base), record_events=True)  # type: ignore[arg-type]
        for w in ("fp32", "int8")
    }
    decode = {b: decode_steps(cores, b, args.context, args.steps) for b in BATCHES}
    for b, r in decode.items():
        print(f"batch {b}: fp32 {r['fp32'][0]:.1f} ms, int8 {r['int8'][0]:.1f} ms per step", flush=True)

    budget = args.kv_budget_mb * 2**20
    capacity = {
        name: kv_capacity(args.model, kv, dtype, budget, args.seq_len)
        for name, kv, dtype in (("fp32", "auto", torch.float32), ("bf16", "auto", torch.bfloat16),
                                ("int8", "int8", torch.float32))
    }  # fmt: skip
    print(f"sequences of {args.seq_len} tokens in {args.kv_budget_mb} MiB of KV: {capacity}", flush=True)

    rng = random.Random(args.seed)
    vocab = cores["fp32"].model_config.vocab_size
    prompts = [[rng.randrange(1, vocab) for _ in range(32)] for _ in range(4)]
    agree = agreement(cores["fp32"], cores["int8"], prompts)
    print(f"agreement over {CONTINUATION}-token continuations: {agree}", flush=True)

    result = {
        "model": args.model,
        "threads": args.threads,
        "context": args.context,
        **{f"decode_ms_b{b}_{w}": round(r[w][0], 2) for b, r in decode.items() for w in ("fp32", "int8")},
        **{f"w8_decode_speedup_b{b}": round(r["fp32"][0] / r["int8"][0], 3) for b, r in decode.items()},
        "bytes_per_step_b1_fp32": decode[1]["fp32"][1],
        "bytes_per_step_b1_int8": decode[1]["int8"][1],
        "kv_budget_mb": args.kv_budget_mb,
        "seq_len": args.seq_len,
        **{f"kv_max_seqs_{k}": v for k, v in capacity.items()},
        "kv_int8_capacity_ratio": round(capacity["int8"] / capacity["fp32"], 3),
        "kv_int8_capacity_ratio_vs_bf16": round(capacity["int8"] / capacity["bf16"], 3),
        **agree,
    }
    path = results.write("quant", result, vars(args), load_before)
    print(f"wrote {path}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
