"""Continuous vs static batching vs Hugging Face `generate()`, and how close decode is to the roofline.

    python benchmarks/batching.py [--num-requests 256] [--model small] [--rounds 3] [--device cuda]

The same offline workload (prompt lengths uniform 32-512, output lengths uniform 16-512 with EOS
ignored, all arriving at once, the same max_num_seqs) runs through continuous and static
scheduling and through transformers' generate() on the same weights in padded batches of the
same size. Static mode is the baseline: fixed batches, prompts left-padded to the batch's
longest (pads computed and kept in KV), each batch running until its longest member finishes.
The continuous engine runs as a user would configure it: the same max_num_seqs, chunked prefill
on, and a per-step token budget of --max-num-batched-tokens (2048, vLLM's default for online
serving; the engine's own default of 512 suits latency more than offline throughput).
Throughput counts requested output tokens over wall time. The decode step time at
batch 1/8/32 is a full engine step (schedule + forward + sample) at a context of 256 tokens.
`decode_b1_roofline` is (weight bytes / copy bandwidth) / batch-1 step time, each round of 10 steps
paired with a bandwidth sample taken just before it, and the median taken over 8 rounds.
Continuous and static alternate for `--rounds` rounds; `ratio` is the median of the rounds' ratios (each
listed in `ratio_rounds`), `vs_hf` the median continuous rate over the one generate() run.
The machine (CPU model, instruction sets, cores) is printed first; the last line printed is one JSON
object, also written with the machine, the load and the arguments to
`benchmarks/results/<date>-<commit>-batching.json` (`batching-cuda.json` on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import results
from engine.config import EngineConfig, SamplingParams
from engine.core import EngineCore
from engine.kernels.cpu import cpu_info
from engine.llm import LLM
from engine.packed import PackedLinear
from engine.request import EngineRequest


def make_workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(256) for _ in range(rng.randint(32, 512))], rng.randint(16, 512)) for _ in range(n)
    ]


def engine_config(args: argparse.Namespace, scheduling: str) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        scheduling=scheduling,
        max_num_seqs=args.max_num_seqs,
        kv_cache_bytes=args.kv_cache_gb * 2**30,
        num_threads=args.threads,
        device=args.device,
        dtype=args.dtype,
    )


def run_engine(core: EngineCore, workload: list[tuple[list[int], int]]) -> float:
    """Output tokens per second through the engine, all requests submitted at once."""
    llm = LLM(core=core)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in workload]
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in workload], params)
    elapsed = time.perf_counter() - start
    produced = sum(len(r.token_ids) for r in outputs)
    assert produced == sum(m for _, m in workload), "every request must produce its requested tokens"
    return produced / elapsed


def run_hf(core: EngineCore, workload: list[tuple[list[int], int]], batch_size: int) -> float:
    """The same workload through transformers' generate(), left-padded batches in arrival order."""
    import transformers

    from engine.loader import hf_config_dict, hf_state_dict

    model = core.runner.model
    device, dtype = core.runner.device, core.runner.dtype
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config_dict(core.model_config)))
    hf.load_state_dict(hf_state_dict(model), strict=False)
    hf.to(device=device, dtype=dtype).eval()
    pad = 0
    start = time.perf_counter()
    produced = 0
    for i in range(0, len(workload), batch_size):
        batch = workload[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device)
        new = max(m for _, m in batch)
        with torch.inference_mode():
            hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=None,
            )
        produced += sum(m for _, m in batch)
    return produced / (time.perf_counter() - start)


def decode_step_times(
    core: EngineCore, batch: int, context: int = 256, steps: int = 40, between=None
) -> list[float]:
    """Engine step times (s) with `batch` sequences decoding at `context` tokens of history; `between`,
    if given, is called every `ROUND_STEPS` steps (the batch-1 roofline samples the bandwidth there)."""
    core.update_limits(max_num_seqs=batch, max_num_batched_tokens=max(batch * context, 512))
    sp = SamplingParams(max_tokens=steps + steps // ROUND_STEPS + 8, temperature=0, ignore_eos=True)
    for i in range(batch):
        core.add_request(EngineRequest(f"decode-{batch}-{i}", [(i + j) % 256 for j in range(context)], sp))
    core.step()  # the whole batch prefills in one step
    for _ in range(3):
        core.step()  # warm-up
    times = []
    for i in range(steps):
        if between is not None and i % ROUND_STEPS == 0:
            between()
            core.step()  # the copy evicted the weights from the caches; a real step does not start cold
        t0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t0)
    while core.has_unfinished_requests():
        core.step()
    return times


ROUND_STEPS = 10


def batch1_roofline(core: EngineCore, steps: int = 80) -> tuple[float, float, float]:
    """(median step ms, median copy bandwidth B/s, roofline) at batch 1, in rounds of `ROUND_STEPS` steps,
    each after its own bandwidth sample. The roofline is the median over rounds of (weight bytes /
    that round's bandwidth) / (that round's median step): this host's memory bandwidth moves by tens of
    percent from minute to minute, and a step and a bandwidth taken at different moments would compare
    a quiet instant with a busy one."""
    samples: list[float] = []
    device = core.runner.device
    times = decode_step_times(core, 1, steps=steps, between=lambda: samples.append(copy_bandwidth(device)))
    rounds = [statistics.median(times[i : i + ROUND_STEPS]) for i in range(0, steps, ROUND_STEPS)]
    roofline = statistics.median(core.weight_bytes / bw / t for bw, t in zip(samples, rounds, strict=True))
    return statistics.median(times) * 1000, statistics.median(samples), roofline


def decode_step_ms(core: EngineCore, batch: int) -> float:
    """Median engine step time (ms) with `batch` sequences decoding."""
    return statistics.median(decode_step_times(core, batch)) * 1000


def copy_bandwidth(device: torch.device, nbytes: int = 512 * 2**20, repeats: int = 3) -> float:
    """Memory-copy bandwidth (B/s) of `device`, the median of `repeats` copies, counting read plus write
    traffic (the STREAM convention)."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return statistics.median(2 * nbytes / _timed(lambda: dst.copy_(src), device) for _ in range(repeats))


def _timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def linear_kernels(core: EngineCore) -> dict[str, object]:
    """Which kernels the engine's float32 linears take: native up to how many rows (built for which vector
    unit: `$STEPSCOPE_KERNEL_ISA` may hold it below the CPU's), oneDNN above."""
    linears = [m for m in core.runner.model.modules() if isinstance(m, PackedLinear)]
    if not linears:
        return {"native_max_rows": 0, "onednn": False}
    head = linears[0]
    width = head._native.panel_width if head._native is not None else 0
    isa = cpu_info().kernel_isa if head._native is not None else None
    return {
        "native_max_rows": head.native_max_rows,
        "panel_width": width,
        "kernel_isa": isa,
        "onednn": head._packed is not None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="continuous engine's budget")
    ap.add_argument("--kv-cache-gb", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="continuous/static rounds, ratio = median")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu|cuda|cuda:N (default: %(default)s)")
    ap.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA)|fp32|bf16|fp16")
    args = ap.parse_args()
    load_before = os.getloadavg()
    cpu = cpu_info()
    print(f"cpu: {cpu.model}; {cpu.cores} cores; {' '.join(cpu.isa) or 'no vector extensions'}", flush=True)
    torch.set_num_threads(args.threads)
    workload = make_workload(args.num_requests, args.seed)

    core = EngineCore(engine_config(args, "continuous"))
    on_cuda = core.runner.device.type == "cuda"
    gpu = torch.cuda.get_device_name(core.runner.device) if on_cuda else None
    if gpu:
        print(f"device: {gpu}; dtype {core.runner.dtype}", flush=True)
    kernels = linear_kernels(core)
    print(f"linear kernels: {kernels}", flush=True)
    b1_ms, bandwidth, roofline = batch1_roofline(core)
    decode = {1: b1_ms} | {b: decode_step_ms(core, b) for b in (8, 32)}
    core.update_limits(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    mb, gbs = core.weight_bytes / 1e6, bandwidth / 1e9
    print(f"decode step ms: {decode}; weights {mb:.0f} MB; copy bandwidth {gbs:.1f} GB/s", flush=True)

    static_core = EngineCore(engine_config(args, "static"))
    continuous_rounds, static_rounds = [], []
    for i in range(args.rounds):
        continuous_rounds.append(run_engine(core, workload))
        static_rounds.append(run_engine(static_core, workload))
        ratio_i = continuous_rounds[-1] / static_rounds[-1]
        print(
            f"round {i + 1}: continuous {continuous_rounds[-1]:.0f} tok/s, static {static_rounds[-1]:.0f} "
            f"tok/s, ratio {ratio_i:.3f}",
            flush=True,
        )
    continuous, static = statistics.median(continuous_rounds), statistics.median(static_rounds)
    ratios = [c / s for c, s in zip(continuous_rounds, static_rounds, strict=True)]
    hf = None if args.skip_hf else run_hf(core, workload, args.max_num_seqs)
    if hf is not None:
        print(f"transformers generate(): {hf:.0f} tok/s", flush=True)
    result = {
        "model": args.model,
        "num_requests": args.num_requests,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "cpu_model": cpu.model,
        "cpu_cores": cpu.cores,
        "cpu_isa": list(cpu.isa),
        "threads": args.threads,
        "device": str(core.runner.device),
        "gpu": gpu,
        "dtype": str(core.runner.dtype).removeprefix("torch."),
        "linear_kernels": kernels,
        "continuous_tok_s": round(continuous, 1),
        "static_tok_s": round(static, 1),
        "ratio": round(statistics.median(ratios), 3),
        "ratio_rounds": [round(r, 3) for r in ratios],
        "continuous_tok_s_rounds": [round(c, 1) for c in continuous_rounds],
        "static_tok_s_rounds": [round(s, 1) for s in static_rounds],
        "hf_tok_s": None if hf is None else round(hf, 1),
        "vs_hf": None if hf is None else round(continuous / hf, 3),
        "decode_b1_ms": round(decode[1], 2),
        "decode_b8_ms": round(decode[8], 2),
        "decode_b32_ms": round(decode[32], 2),
        "decode_b8_over_b1": round(decode[8] / decode[1], 2),
        "weight_bytes": core.weight_bytes,
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 2),
        "decode_b1_roofline": round(roofline, 3),
    }
    name = "batching-cuda" if on_cuda else "batching"
    if kernels.get("kernel_isa") not in (None, cpu.vector_isa):  # kernels held below the CPU's vector unit
        name += f"-{kernels['kernel_isa']}"
    path = results.write(name, result, vars(args), load_before)
    print(f"written to {path}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
