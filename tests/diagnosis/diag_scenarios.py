"""The generated scenarios the diagnosis tests run on: each fault at a realistic magnitude, healthy runs,
and a vLLM-shaped trace. Each run gets its own stretch of time, so one store holds them all."""

from __future__ import annotations

import dataclasses

from diag_simulate import SimConfig

T0 = 1_750_000_000.0
SPACING_S = 1_000.0
DURATION_S = 160.0  # the fault (if any) starts halfway

# name -> (config without t0, the cause a diagnosis should rank first; None: no finding)
SCENARIOS: dict[str, tuple[SimConfig, str | None]] = {
    "healthy_0": (SimConfig(seed=10, fault_at_s=None), None),
    "healthy_1": (SimConfig(seed=11, fault_at_s=None, shared_fraction=0.5), None),
    "healthy_2": (SimConfig(seed=12, fault_at_s=None, long_fraction=0.1, rate_rps=3.0), None),
    # One rate's busier spell: a fifth more arrivals in the second half (short of demand growth), more
    # running sequences, TPOT and TTFT up at an unchanged engine speed. The load explains it: no finding.
    "healthy_busier_spell": (SimConfig(seed=30, fault={"rate_rps": 4.8}), None),
    "prefix_cache_miss": (
        SimConfig(seed=1, shared_fraction=0.8, fault={"prefix_change_fraction": 0.6}),
        "prefix_cache_miss",
    ),
    "long_prompts": (SimConfig(seed=2, fault={"prompt_factor": 4.0}), "long_prompts"),
    "queueing_overload": (SimConfig(seed=3, fault={"rate_rps": 10.0}), "queueing_overload"),
    "oversized_batch": (
        SimConfig(seed=4, clients=24, max_num_seqs=4, fault={"max_num_seqs": 32}),
        "oversized_batch",
    ),
    "prefill_interference": (
        SimConfig(seed=5, long_fraction=0.15, fault={"chunked": False}),
        "prefill_interference",
    ),
    "kv_cache_pressure": (SimConfig(seed=6, rate_rps=5.0, fault={"num_kv_blocks": 64}), "kv_cache_pressure"),
    "scheduler_stall": (SimConfig(seed=7, fault={"stall_ms": 30.0}), "scheduler_stall"),
    "rpc_overhead": (SimConfig(seed=8, fault={"rpc_factor": 20.0}), "rpc_overhead"),
    # A stall whose queue lands the change point on a bunch of arrivals: more arrivals do not open gaps
    # between steps, so the stall still ranks first and queueing_overload stays out.
    "scheduler_stall_arrivals_up": (
        SimConfig(seed=16, fault={"stall_ms": 30.0, "rate_rps": 5.6}),
        "scheduler_stall",
    ),
    "weight_quant_off": (SimConfig(seed=9, fault={"weight_dtype": "fp32"}), "weight_quant_off"),
    "kv_transfer_slow": (
        SimConfig(seed=13, kv_transfer_per_token_s=0.00005, fault={"kv_transfer_per_token_s": 0.0003}),
        "kv_transfer_slow",
    ),
    # A link so slow that the decode worker waits between its steps for the prompts' KV: the gaps grow too,
    # and the link, not the step loop, is the cause.
    "kv_transfer_slow_decode_waits": (
        SimConfig(
            seed=13,
            kv_transfer_per_token_s=0.00005,
            fault={"kv_transfer_per_token_s": 0.001, "gap_base_s": 0.015},
        ),
        "kv_transfer_slow",
    ),
    "vllm_overload": (SimConfig(seed=14, vllm=True, fault={"rate_rps": 10.0}), "queueing_overload"),
    # Request spans only, plus the engine's scraped /metrics: the KV evidence comes from the samples.
    "vllm_kv_cache_pressure": (
        SimConfig(seed=6, vllm=True, scrape_s=1.0, rate_rps=5.0, fault={"num_kv_blocks": 64}),
        "kv_cache_pressure",
    ),
    "vllm_oversized_batch": (
        SimConfig(seed=4, vllm=True, scrape_s=1.0, clients=24, max_num_seqs=4, fault={"max_num_seqs": 32}),
        "oversized_batch",
    ),
    # A noisy neighbour: every step waits for a core (wall x2 at the same CPU time), the host load up.
    "compute_slowdown": (SimConfig(seed=17, fault={"cpu_wait_factor": 2.0}), "compute_slowdown"),
    # A neighbour that slows every step x1.8 where a decode's per-sequence cost dominates a step: the
    # engine falls below the same 2.5 requests/s, then the queue and a full batch follow.
    "compute_slowdown_falls_behind": (
        SimConfig(seed=24, rate_rps=2.5, step_base_s=0.003, per_seq_s=0.004, fault={"cpu_wait_factor": 1.8}),
        "compute_slowdown",
    ),
    # Stalls that take the engine below its arrivals: the batch fills behind them, and that is the
    # stall's doing too.
    "scheduler_stall_falls_behind": (
        SimConfig(seed=25, rate_rps=2.5, step_base_s=0.003, per_seq_s=0.004, fault={"stall_ms": 60.0}),
        "scheduler_stall",
    ),
    # A codec so slow that the core's own encoding takes its stepping thread's core: the steps wait for a
    # core as under a neighbour, but the engine core process's own CPU use rose. The channel, not the host.
    "rpc_overhead_own_cpu": (
        SimConfig(seed=26, fault={"rpc_factor": 20.0, "cpu_wait_factor": 1.5, "engine_cpu_share": 0.85}),
        "rpc_overhead",
    ),
    # Clocks held down: the work itself slower (CPU time grows with the wall).
    "compute_slowdown_clocks": (SimConfig(seed=18, fault={"clock_factor": 1.8}), "compute_slowdown"),
    "long_outputs": (SimConfig(seed=19, fault={"output_median": 200}), "long_outputs"),
    # The same at a rate that leaves about 50 requests a side: too few for a P99 test to see anything, so
    # the E2E median is the symptom (every request decodes for longer).
    "long_outputs_few_requests": (
        SimConfig(seed=28, rate_rps=0.65, fault={"output_median": 256}),
        "long_outputs",
    ),
    "batch_limit_low": (
        SimConfig(seed=20, rate_rps=6.0, fault={"max_num_seqs": 2}),
        "batch_limit_low",
    ),
    # The token budget cut under closed-loop demand: prompts are prefilled a few tokens a step while the
    # running decodes take the rest, and the others wait.
    "batch_limit_low_tokens": (
        SimConfig(seed=23, clients=8, fault={"budget": 24}),
        "batch_limit_low",
    ),
    # The front end's loop busy 0.2 s per request at 4 requests/s: it saturates, requests wait before it.
    "frontend_bottleneck": (SimConfig(seed=21, fault={"frontend_cpu_s": 0.22}), "frontend_bottleneck"),
    # The same with arrivals up x1.4 at the onset: the requests still wait in front of the core, not in
    # its queue, so the front end is the cause (more demand alone would queue at the core).
    "frontend_bottleneck_more_arrivals": (
        SimConfig(seed=21, fault={"frontend_cpu_s": 0.15, "rate_rps": 5.6}),
        "frontend_bottleneck",
    ),
    # Sampled: 1-in-4 steps recorded, 25% of requests head-sampled, slow ones kept anyway.
    "sampled_queueing_overload": (
        SimConfig(seed=3, steps_every=4, head_ratio=0.25, slow_request_s=1.0, fault={"rate_rps": 10.0}),
        "queueing_overload",
    ),
    "sampled_scheduler_stall": (
        SimConfig(seed=7, steps_every=4, head_ratio=0.25, slow_request_s=1.0, fault={"stall_ms": 30.0}),
        "scheduler_stall",
    ),
    # Request-only and flat arrivals: every step slower, which only step spans could show. Not overload.
    "vllm_slower_steps": (
        SimConfig(seed=22, vllm=True, rate_rps=5.0, fault={"clock_factor": 1.8}),
        "unexplained",
    ),
    # Request spans plus scraped samples: longer answers fill the running batch at an unchanged limit.
    "vllm_long_outputs": (
        SimConfig(seed=19, vllm=True, scrape_s=1.0, fault={"output_median": 200}),
        "long_outputs",
    ),
    # The limit lowered, as the scraped stepscope:max_num_seqs shows; and the same on a page without it.
    "vllm_batch_limit_low": (
        SimConfig(seed=20, vllm=True, scrape_s=1.0, rate_rps=6.0, fault={"max_num_seqs": 2}),
        "batch_limit_low",
    ),
    "vllm_batch_limit_low_unpublished": (
        SimConfig(
            seed=20, vllm=True, scrape_s=1.0, scrape_limit=False, rate_rps=6.0, fault={"max_num_seqs": 2}
        ),
        "unexplained",
    ),
    # Only the long prompts got longer: documents x4 while the short turns behind a shared system prompt,
    # 80% of the requests, stayed. The mean moves about x1.3, the P90 not at all, the P99 x4: the rule's
    # tail test names it (without it the run is unexplained).
    "long_prompts_tail": (
        SimConfig(seed=27, shared_fraction=0.8, long_fraction=0.04, fault={"long_prompt": 6000}),
        "long_prompts",
    ),
    # The same 7 requests/s from the middle on, bunched (x1.6 and x0.4 in alternate 5 s spells) near the
    # engine's capacity: over the whole run the running batch and TTFT grow at flat arrivals and an
    # unchanged engine speed, as in the last 20 s of a real healthy run near saturation (arrivals x1.04,
    # batch 1.8 -> 2.7). Against the first half as a given baseline the batch sits at its cap and the
    # bursts' queue is TTFT's tail alone: a burstier traffic shape, which no rule names (`unexplained`).
    "bunched_arrivals": (SimConfig(seed=33, rate_rps=7.0, fault={"bunching": 0.6}), None),
    # A host whose other processes (a fleet's replicas, its router, the load generator) keep more tasks
    # runnable than it has cores, more so from the middle on: every step waits x1.15 as long for a core,
    # short of a compute slowdown, and TTFT follows. The host explains it: no finding.
    "healthy_busier_host": (
        SimConfig(seed=34, host_load=3.0, rate_rps=4.5, fault={"cpu_wait_factor": 1.15}),
        None,
    ),
    # The same slowdown on a host with cores to spare (load 0.75 a core): nothing on the host explains it.
    "slower_on_a_quiet_host": (
        SimConfig(seed=34, rate_rps=4.5, fault={"cpu_wait_factor": 1.15}),
        "unexplained",
    ),
    # A host past its cores throughout (2.5 runnable tasks a core on both sides): from the middle on, the
    # steps that wait for a core wait longer (the same few steps, 0.05-0.15 s late instead of 0.01-0.06 s),
    # so request tails move and medians, step time and demand do not. The host explains it: no finding.
    "tails_on_an_oversubscribed_host": (
        SimConfig(seed=35, host_load=5.0, rate_rps=4.5, fault={"hiccup_s": (0.05, 0.15)}),
        None,
    ),
    # The same tails on a host with cores to spare: nothing on the host explains them, `unexplained` against
    # the first half as a given baseline (over the whole window the tails' backlog reads as a busier spell).
    "tails_on_a_quiet_host": (SimConfig(seed=35, rate_rps=4.5, fault={"hiccup_s": (0.05, 0.15)}), None),
}


def placed(name: str) -> SimConfig:
    """The scenario's config with its own start time and service name."""
    index = list(SCENARIOS).index(name)
    cfg = SCENARIOS[name][0]
    fault_at = None if cfg.fault_at_s is None else DURATION_S / 2
    return dataclasses.replace(
        cfg, t0=T0 + index * SPACING_S, service="engine", duration_s=DURATION_S, fault_at_s=fault_at
    )
