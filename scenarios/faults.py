"""The scenario faults: each one's name, help, default value, eval magnitudes and the knobs it turns.

A plain table with no import of the project, so that a command can list or parse faults without loading
the engine, the load generator or the collector. `scenarios.runner` applies a fault to a running system;
each fault changes the real system, none writes a span, a timing or an attribute (docs/faults.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Limits = dict[str, object]
# A length distribution in tokens: (median, sigma, low, high), loadgen.workloads.LengthDist's fields.
Length = tuple[int, float, int, int]
# The diagnosis tests a P99 only with 50 requests on each side of the change (diagnosis/config.py): a run
# should bring a few more than that to each side of its onset.
MIN_REQUESTS_PER_SIDE = 55


def min_duration_s(rate: float, onset_share: float = 0.5) -> float:
    """The shortest run whose both sides of the onset get `MIN_REQUESTS_PER_SIDE` requests at `rate`."""
    return MIN_REQUESTS_PER_SIDE / rate / min(onset_share, 1 - onset_share)


@dataclass(frozen=True, slots=True)
class Fault:
    """One scenario fault: how its value turns into a workload shift, runtime limits or engine faults."""

    name: str
    help: str
    default: float | None  # None: the fault takes no value
    magnitudes: tuple[float | None, ...]  # two fixed points (`scenario list`); the range spans them
    # The range `stepscope eval --grid full` draws its two magnitudes from (docs/faults.md); integer
    # bounds draw integers. None: the span of `magnitudes`.
    magnitude_range: tuple[float, float] | None = None
    shift: Callable[[float], dict[str, float]] | None = None  # -> WorkloadShift fields
    limits: Callable[[float, Limits], Limits] | None = None  # (value, current limits) -> changes
    engine: Callable[[float], dict[str, object]] | None = None  # -> /admin/faults body
    serve_args: tuple[str, ...] = ()  # `stepscope serve` options the run needs from its start
    # The workload the fault needs to show, in both halves (WorkloadConfig fields over
    # `scenarios.config.workloads()`; a tuple is a length distribution: `Length`).
    workload: dict[str, Any] = field(default_factory=dict)
    # Closed-loop clients in all (both streams) instead of the open-loop rate: demand that queues.
    clients: int | None = None
    # Busy processes of another program started on the engine's cores at the onset (a noisy neighbour).
    neighbours: Callable[[float], int] | None = None
    # Fleets (`--replicas N`): faults sent to the router's /admin/faults with the targeted instance (the
    # router's own, or an engine fault for that replica alone), or a process action on the targeted
    # replica (scenarios/fleet.py): "kill", or "throttle" (held to 1/value of the time). A fleet fault
    # needs at least two replicas.
    router: Callable[[float], dict[str, object]] | None = None
    action: str | None = None
    fleet: bool = False


FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        Fault(
            "prefix_cache_miss",
            "a fraction F of requests get a changed system prompt",
            0.9,
            (0.6, 0.9),
            shift=lambda v: {"prefix_change_fraction": v},
            # An application's long system prompt (instructions, tools, few-shot examples): a miss then
            # costs 1k tokens of prefill. With the default 384 tokens TTFT P50 moved x2 and no test could
            # tell it from noise at ~50 requests a side.
            workload={"system_prompt_tokens": 1024},
            # Eval draws from 0.6 to 0.9: a holdout run at 0.63 regressed nothing (TTFT moved within what
            # ~70 requests a side can show), so the full grid draws from 0.75 to 1.
            magnitude_range=(0.75, 1.0),
        ),
        Fault(
            "long_prompts",
            "prompt lengths times K",
            3.0,
            (2.5, 4.0),
            shift=lambda v: {"prompt_len_factor": v},
        ),
        Fault(
            "overload",
            "arrival rate times K",
            6.0,
            (5.0, 7.0),
            shift=lambda v: {"rate_factor": v},
            # At 35% of capacity, K = 3 lands at 1.05x: within the calibration's noise of the knee. The
            # eval draws the load from 25-55% of capacity, so K from 5 keeps arrivals at 1.25x or more.
        ),
        Fault(
            "oversized_batch",
            "max_num_seqs raised to N",
            48,
            (32, 64),
            limits=lambda v, cur: {"max_num_seqs": int(v)},
            # Demand that queues at the old cap (a batch pipeline keeping 24 requests in flight): only
            # then does a higher cap change the batch. Open-loop arrivals below the knee keep the batch
            # at arrivals x latency (Little's law) whatever the cap.
            clients=24,
        ),
        Fault(
            "prefill_interference",
            "chunked prefill turned off while long prompts arrive among chat traffic",
            None,
            (None, None),
            # As vLLM requires with chunking off, the token budget covers a whole prompt: documents are
            # prefilled in one step together with the running decodes (with the 256-token budget a long
            # prompt would instead wait for the batch to empty and run alone).
            limits=lambda v, cur: {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096},
            # Longer documents and chat answers, and six clients keeping requests in flight (below the
            # cap of 8: no queueing at it), so that long prefills land among running decodes whatever
            # the machine's speed.
            workload={
                "summarize_prompt": (1536, 0.25, 1024, 2048),
                "chat_output": (48, 0.3, 24, 96),
            },
            clients=6,
        ),
        Fault(
            "kv_cache_pressure",
            "the KV block pool cut to a fraction F",
            0.1,
            (0.15, 0.1),
            # 768 -> 76 blocks at 0.1 (115 at 0.15; the longest prompt needs 65): a full batch of 8
            # (about 100-150 blocks) no longer fits, so running sequences are preempted. At 0.15, 33
            # preemptions moved ITL max P99 x1.7 and TTFT P99 x1.4: past the significance bar in one
            # quiet run of two.
            limits=lambda v, cur: {"num_kv_blocks": max(int(int(cur["num_kv_blocks"]) * v), 1)},  # type: ignore[call-overload]
            # A busy engine whose demand queues past its cap of 8 (12 closed-loop clients), as a pool
            # sized for the peak sees: at 35% of capacity on an open loop the batch was ~1 and even 76
            # blocks preempted once in a run; with exactly 8 clients the loop regulated itself (fewer
            # sequences fit, each step got faster and no client waited longer: TTFT P50 x1.4 and E2E
            # x0.9 at 0.117 over 43 preemptions, no test passed).
            clients=12,
            # From 0.09 (69 blocks: the longest prompt needs 65) to 0.12 (92 blocks): a dev eval run at
            # 0.144 (110 blocks) regressed nothing.
            magnitude_range=(0.09, 0.12),
        ),
        Fault(
            "scheduler_stall",
            "a thread holds the step loop's lock for MS ms every 100-250 ms",
            100,
            (60, 150),
            engine=lambda v: {"scheduler_stall_ms": float(v)},
            # Eval draws from 60 to 150 ms: one at 108 regressed nothing, beside 64 and 99 that did. Then
            # from 120 to 200: a dev run at 124 (half of capacity) regressed nothing twice, under the
            # default mix and under chat alone: the gaps between steps grew 0.6 -> 26 ms and TPOT P50
            # x1.6, but a stall slows every request in flight at once, and counted as such (5 s blocks)
            # the shift read p=0.002. At 186 with the same draws TPOT P50 moved x7 (p=7e-8). The full
            # grid draws from 180 to 260.
            magnitude_range=(180, 260),
        ),
        Fault(
            "rpc_overhead",
            "the front-end/core channel switched to a codec K times slower",
            # At 400 a quiet run's RPC delay grew 1.1 -> 6.5 ms a token against a 24 ms TPOT: TPOT P50
            # x1.15, under the regression bar. Dev eval runs at half of capacity: RPC delay 0.8 -> 54 ms
            # and TPOT P50 x1.8 at 1267, 1 -> 211 ms and x2.0 at 1945 (both regressed nothing at ~70
            # requests a side: a healthy run's halves differ by as much), x3.1 at 1491.
            1500,
            (1500, 2500),
            engine=lambda v: {"rpc_codec": f"slow:{int(v)}"},
            # Eval draws from 1500 to 2500 regressed nothing in three runs of four (1764, 1945, 2394): the
            # full grid draws from 3000 to 4500.
            magnitude_range=(3000, 4500),
        ),
        Fault(
            "kv_transfer_slow",
            "disaggregated serving: the prefill -> decode KV link throttled to MB/s (docs/disagg.md)",
            20,
            (30, 10),
            engine=lambda v: {"kv_transfer_mbps": float(v)},
            serve_args=("--disagg",),  # 1 prefill + 1 decode worker on the same cores
            # A dev eval run at 26 MB/s (0.42 of capacity) regressed nothing: the transfer's tail stayed
            # hidden behind the prefill; at 13 MB/s every symptom regressed. The full grid draws 8-20.
            magnitude_range=(8, 20),
        ),
        Fault(
            "weight_quant_off",
            "an int8-weight engine switched to full-precision weights (the wrong checkpoint)",
            None,
            (None, None),
            engine=lambda v: {"weight_quant_off": True},
            serve_args=("--weight-dtype", "int8"),  # healthy half int8, the fault half fp32
            # Full-precision weights double a decode step's bytes (a small batch's step of 10 ms became
            # 16-23 ms) while prefill, compute-bound, got no slower. Among the default mix's documents
            # (15-token answers between long prefills: TPOT P99 15x its P50) TPOT P50 moved x1.5-2.7 and
            # passed the test in one dev run of two. A chat service's longer answers, no documents.
            workload={
                "summarize_fraction": 0.0,
                "chat_output": (32, 0.3, 16, 64),
                "shared_output": (32, 0.3, 16, 64),
            },
        ),
        Fault(
            "cpu_contention",
            "N busy processes of another program on the engine's cores from the onset",
            2,
            (2, 4),
            neighbours=lambda v: int(v),
        ),
        Fault(
            "long_outputs",
            "answers K times longer (max_tokens times K)",
            4.0,
            (3.0, 6.0),
            shift=lambda v: {"output_len_factor": v},
        ),
        Fault(
            "batch_limit_low",
            "max_num_seqs lowered to N",
            3,
            (2, 4),
            limits=lambda v, cur: {"max_num_seqs": int(v)},
            # Eight clients keep the batch at the cap of 8 with nobody waiting: a lower cap binds at once
            # (open-loop arrivals below the knee keep the batch at ~1.5, under any cap of 2 or more).
            clients=8,
        ),
        Fault(
            "frontend_cpu",
            "the front end tokenizes each prompt K extra times on its event loop",
            # The byte tokenizer takes ~5 us for a mean prompt: 50000 times is ~0.25 s of the loop's CPU per
            # request, a slow tokenizer and request parsing that the loop does for every request in turn.
            50000,
            (30000, 100000),
            engine=lambda v: {"frontend_cpu": int(v)},
            # Eval draws from 30000 to 100000: one at 59604 regressed nothing beside 45896 that did; the full
            # grid draws from 60000 to 120000.
            magnitude_range=(60000, 120000),
            # A chat service, no documents: a dev run at 114175 under the default mix held each request
            # 0.4 -> 200 ms in the front end and moved TTFT P50 from ~60 to ~300 ms, but the documents'
            # prefills had swung the baseline's TTFT P50 from 58 ms to 1.4 s within 5 s windows, and no test
            # told the two apart.
            workload={"summarize_fraction": 0.0},
        ),
        Fault(
            "replica_slow",
            "fleet: one replica's processes held to 1/X of the time (--fault-instance K)",
            # Stopped and resumed every 10 ms, as a CPU quota holds a container: its steps take K times
            # as long at the same CPU time, and the cores it leaves go to its peers (busy threads inside
            # it instead took the cores from every replica on a shared host: all of them slowed).
            3.0,
            (2.5, 4.0),
            action="throttle",
            fleet=True,
        ),
        Fault(
            "replica_down",
            "fleet: one replica killed mid-run (--fault-instance K)",
            None,
            (None, None),
            action="kill",
            fleet=True,
        ),
        Fault(
            "cache_affinity_lost",
            "fleet: the router switches from prefix_aware to round_robin",
            None,
            (None, None),
            router=lambda v: {"cache_affinity_lost": True},
            # Several tenants' long system prompts: routed by prefix, each replica caches its share of them;
            # scattered, every replica must hold all of them and its pool (5k tokens) cannot. With six
            # prompts and a 4k pool, scattering still kept about two thirds of the hits: a dev run at a third
            # of capacity moved TTFT P50 x1.4 and passed no test.
            workload={"system_prompts": 12, "system_prompt_tokens": 1024},
            serve_args=("--num-kv-blocks", "320"),
            fleet=True,
        ),
        Fault(
            "routing_skew",
            "fleet: a fraction F of requests pinned to one replica (--fault-instance K)",
            0.8,
            (0.6, 0.9),
            router=lambda v: {"routing_skew": float(v)},
            # Ten requests kept in flight on replicas capped at 4 sequences: about 3 a replica while
            # balanced; pinned, the one replica holds most of them, runs 4 and queues the rest while its
            # peers idle. The cores are shared by the replicas here, so only the cap makes one replica
            # the bottleneck that a GPU of its own would be (an open loop at a third of the fleet's
            # capacity fit on one replica unqueued).
            serve_args=("--max-num-seqs", "4"),
            clients=10,
            fleet=True,
        ),
    )
}


def value_range(fault: Fault) -> tuple[float, float] | None:
    """The range `stepscope eval --grid full` draws `fault`'s magnitudes from (None: it takes no value)."""
    if fault.default is None:
        return None
    if fault.magnitude_range is not None:
        return fault.magnitude_range
    values = [m for m in fault.magnitudes if m is not None]
    return (min(values), max(values))


def open_loop(fault: Fault) -> bool:
    """Whether `fault`'s demand is the open-loop rate (a share of capacity), not closed-loop clients."""
    return fault.clients is None


def parse_fault(text: str) -> tuple[str, float | None]:
    """`NAME` or `NAME=VALUE` -> (name, value with the default filled in); ValueError when bad."""
    name, _, raw = text.partition("=")
    fault = FAULTS.get(name)
    if fault is None:
        raise ValueError(f"unknown fault {name!r}; choose one of {', '.join(FAULTS)}")
    if not raw:
        return name, fault.default
    if fault.default is None:
        raise ValueError(f"fault {name} takes no value")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"fault {name}: expected a number, got {raw!r}") from None
    if value <= 0 or (name in ("prefix_cache_miss", "kv_cache_pressure", "routing_skew") and value > 1):
        raise ValueError(f"fault {name}: value out of range: {raw}")
    if name == "replica_slow" and value <= 1:
        raise ValueError(f"fault {name}: the slowdown must be above 1, got {raw}")
    return name, value
