"""Every threshold of the diagnosis, with the reason for its value: one object, `DiagnosisConfig`.

Values were set on healthy runs (two halves of a stationary run on a shared 2-core machine compared with
each other must give no finding) and then checked against each fault at its smaller magnitude; see
docs/diagnosis.md, "Thresholds".
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DiagnosisConfig:
    """Thresholds and sizes of one diagnosis. Frozen: pass a new one (dataclasses.replace) to change it.

    Tuning: a value here may be set from the `dev` cases of `stepscope eval` only (seeds below 1000, with
    their magnitude, onset and load draws) and from healthy runs; the `holdout` cases (seeds 1000 and up)
    are for reporting, never looked at while tuning (`scenarios/protocol.py`, docs/faults.md)."""

    # --- regression detection ----------------------------------------------------------------------
    # P99 up by a quarter is what an on-call engineer acts on; healthy halves on the shared machine moved
    # P99 by up to ~15% (CPU contention from other processes comes and goes in bursts).
    min_ratio_p99: float = 1.25
    # Medians are steadier than tails, but TPOT's median follows load: a Poisson burst raised it by 15-25%
    # in generated healthy runs over a fifth of the window.
    min_ratio_p50: float = 1.2
    # Throughput and goodput are rates: a drop to 80% or less, and more than the drop in demand.
    min_drop_rate: float = 0.80
    # Error rate: at least one request in a hundred more failing, and at least twice the old rate.
    min_error_rate_increase: float = 0.01
    min_error_rate_ratio: float = 2.0
    # One-sided p-value under which a difference is taken as real. Strict, because a window is compared
    # on several metrics at once and the change point is chosen where the halves differ most.
    alpha: float = 0.001
    # Requests of one queue are not independent samples: while a backlog lasts, every request waits. The
    # rank and tail tests widen their variance by the sample's autocorrelation, estimated from the means
    # of blocks this long (batch means; 0 treats requests as independent).
    sample_block_s: float = 5.0
    # Estimated from the baseline alone: the process the current side is tested against. Pooled with the
    # current side, the effect under test counted as noise (a backlog growing after the split, a shift
    # that lands a little after it): an overload's TTFT x131 over 335 requests read p = 0.01, a lost cache
    # affinity's x2.2 over 344 p = 1e-4. Both sides pooled when the baseline spans under 5 blocks.
    inflation_from_baseline: bool = True
    # Below these sample sizes a side says nothing. Scenario runs hold ~50 requests a side, so a "P99" there
    # is the side's upper tail; the exceedance test and the 1.25 ratio keep one slow request from counting.
    min_requests_p50: int = 30
    min_requests_p99: int = 50
    min_intervals: int = 6  # per side, for rate metrics tested across intervals
    # Requests sampled per side for rank tests and tail decomposition (ClickHouse picks them by hash, so
    # the sample is the same on every run). 3,000 keeps a 1% tail at ~30 requests and the API's row cap.
    sample_per_side: int = 3000
    # Goodput counts requests meeting the SLO; without explicit SLOs the baseline's own P99s are the SLO.
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None

    # --- onset / change point ----------------------------------------------------------------------
    # ~120 intervals over the window: enough resolution for the onset, enough requests per interval.
    target_intervals: int = 120
    min_interval_s: float = 1.0
    # The change point keeps at least this share of the window on each side (a split at the edge compares
    # a handful of intervals with everything else).
    min_segment_share: float = 0.2
    # A setting of the engine's (chunked prefill, a batch limit, the KV pool, the weights' dtype) whose one
    # step explains at least this share of its series inside the window places the split there, ahead of
    # the symptoms' change point (a clean step: 0.8-0.95 with the intervals the change straddles).
    setting_step_share: float = 0.75
    # A finding's onset is the change point of its own evidence series, searched this far either side of
    # the split (a share of the analysed span, and at least so many seconds): near enough that a drift
    # elsewhere in the window cannot pull it away, wide enough for a change point a few intervals off.
    onset_search_share: float = 0.15
    onset_search_s: float = 10.0

    # --- attribution -------------------------------------------------------------------------------
    # A cause whose part explains less than this share of its symptom's change is not credible.
    min_share_explained: float = 0.35
    # A finding below this confidence is dropped: evidence was present but explained too little.
    min_confidence: float = 0.30

    # --- rule evidence -----------------------------------------------------------------------------
    # Request mix: prompt lengths moved by half or more (healthy halves: mean within ~5%).
    long_prompt_ratio: float = 1.5
    # ... or only the long prompts got longer (documents, retrieved context) while the short ones, often the
    # bulk of a shared-prefix chat, stayed: the mean up by a quarter and the P99 by half. Dev runs under
    # the scenario mix (a third of requests chat or documents, the rest short turns behind one 384-token
    # system prompt), prompts x3.0 and x3.6: mean x1.41 and x1.97, P90 x0.99 and x1.13, P99 x2.5 and x3.6.
    long_prompt_tail_ratio: float = 1.5
    # "Unchanged" prompt lengths, for rules that need them steady (prefix misses, prefill interference).
    steady_prompt_ratio: float = 1.25
    # Prefix cache: the cached share of prompt tokens fell by at least 0.15 absolute and to half or less.
    # A changed prefix for a fraction F of the requests that shared it leaves (1 - F) of the share: at
    # the faults' F of 0.6-1.0, 0.4 or less. A healthy dev run of the default mix (a third of the requests
    # behind one system prompt, Poisson-mixed) read 53% -> 33% (0.63) across its change point by chance,
    # with E2E P50 x1.35 from the extra prefill.
    cache_share_drop: float = 0.15
    cache_share_ratio: float = 0.5
    # Arrivals up by 30%: past the knee that already doubles queueing; healthy Poisson halves: ~5%.
    arrival_ratio: float = 1.3
    # ...and significantly so (a one-sided Poisson rate test), for the rules that need arrivals flat.
    arrival_p: float = 0.01
    # Demand growth (queueing_overload's arrivals, and what rules out a busier spell of the same demand)
    # must pass the symptoms' bar: the change point is searched where the sides differ most, and a Poisson
    # burst at one rate reaches p ~0.005 there.
    demand_p: float = 0.001
    # Step loop counted as busy when it runs steps this share of wall time (the rest is gaps).
    busy_share: float = 0.7
    # Mean batch size up by half: a configuration change, not drift (healthy halves within ~10%).
    batch_ratio: float = 1.5
    # max_num_seqs (its step-weighted mean) raised by a tenth: someone changed the limit.
    limit_raise_ratio: float = 1.1
    # Step time at equal batch size up by a fifth (healthy: within ~8%; fp32 vs int8 weights: x1.5+).
    equal_batch_ratio: float = 1.2
    # Bytes read per step (at equal batch size) up by a fifth: the weights got bigger.
    bytes_ratio: float = 1.2
    # Preemptions: at least this many per thousand steps more, and KV usage near full in a tenth of the
    # steps (P90; a real shrunk pool's median step was 81% used while it preempted 69 times per 1k steps).
    preemptions_per_kstep: float = 2.0
    kv_full_share: float = 0.9
    # The same from a scraped preemption counter when nothing counts steps: preemptions per minute up by
    # this many. A healthy engine with a pool sized for its load does not preempt at all; 6 a minute is a
    # handful in a minute-long window, past one stray preemption.
    preemptions_per_min: float = 6.0
    # Prefill interference: the P99 of prefill tokens riding with decodes up by half and chunking off in
    # at least this share of the current side's steps.
    prefill_chunk_ratio: float = 1.5
    chunking_off_share: float = 0.5
    # Gaps between steps up by half and by at least 2 ms per step (one Python GIL switch is ~5 ms).
    gap_ratio: float = 1.5
    min_gap_increase_s: float = 0.002
    # Front-end RPC delay up by half and by 1 ms per token.
    rpc_ratio: float = 1.5
    min_rpc_increase_s: float = 0.001
    # The channel is where the time went when the RPC delay grew by at least half the growth of the gaps
    # between steps (a slow codec: delay +13-23 ms against gaps +3.6-5.3 ms from the core's own encoding;
    # a 100 ms stall: delay +1.0 ms against gaps +26 ms).
    rpc_share_of_gap: float = 0.5
    # KV transfer: its share of TTFT up by 10 points and transfer seconds per prompt token up by half.
    kv_transfer_share_increase: float = 0.10
    kv_transfer_per_token_ratio: float = 1.5
    # Compute slowdown: of the growth of wall time per step at equal batch size, the share that is CPU
    # time of the stepping thread. Under contention the thread waits (CPU flat: share ~0); slower compute
    # grows CPU with the wall (share ~1). Halfway tells them apart.
    cpu_growth_share: float = 0.5
    # Without CPU time per step: a host load average above 1.5 runnable tasks per core is contention. Also
    # the bar past which a busier host (rising to it) or an oversubscribed one (past it on both sides, tails
    # only) explains a regression no rule does (`unexplained.host_explains`).
    host_overload_per_cpu: float = 1.5
    # Waiting for a core read directly: the stepping thread's share of its steps' wall time on a core fell
    # to 0.6 of the baseline's or below. It holds across batch sizes, so it sees a neighbour that drove the
    # engine into a backlog whose batches have no match in the baseline. Dev runs: two busy neighbours on
    # the engine's core 0.99 -> 0.30 and 1.0 -> 0.30; every other single-engine fault 0.88-1.0 on both
    # sides; fleets sharing cores with the harness 0.30-0.59, moving x0.83-1.43 between halves.
    cpu_share_fall: float = 0.6
    # Contention from the engine's own work: its core process's CPU (cores' worth) up by 0.1 and x1.25
    # while its stepping thread waits. Dev runs: a noisy neighbour or a CPU quota took it 0.56 -> 0.35,
    # 0.39 -> 0.37, 0.17 -> 0.12; a slow codec's encoding 0.57 -> 0.84, throttled KV transfers 0.22 -> 0.36
    # and 0.29 -> 0.48 (the engine did more work, not the same work more slowly).
    own_cpu_rise: float = 0.1
    own_cpu_ratio: float = 1.25
    # Load noise: a regression with no finding is the load's when the running batch rose by at least this,
    # arrivals held (within its inverse) or rose (not past arrival_ratio with significance), and batch
    # size and prefill in decode steps carry `load_share` of the step period's growth (queue and prefill
    # of TTFT's). Healthy dev runs at one Poisson rate: arrivals 59 -> 82 a side, batch 1.14 -> 1.59,
    # their share of the growth 0.83; arrivals x1.04 bunched in a run's last 21 s near saturation, batch
    # 1.81 -> 2.68, step time at equal batch x1.03, their share 0.96.
    load_noise_ratio: float = 1.1
    load_share: float = 0.6
    # Long outputs: output tokens per request up by half (healthy halves: mean within ~10%).
    long_output_ratio: float = 1.5
    # Batch limit lowered: the current batch's mean at 70% of the new cap or more (it binds).
    batch_at_cap_share: float = 0.7
    # Front end: its part of TTFT up by half and by 5 ms (parsing and tokenizing a chat prompt: ~1 ms).
    frontend_ratio: float = 1.5
    min_frontend_increase_s: float = 0.005
    # Arrivals are stamped when the front end takes a request: one short of CPU takes them late and in
    # bunches, and the rate it records rose 2.66 -> 3.72/s at 3.2/s offered (a dev run, its front end
    # 0.8 -> 253 ms, all of the TTFT change). Risen arrivals veto the front end unless its time explains
    # this share of the TTFT change (the dev overload runs: the front end's time did not grow at all).
    frontend_over_arrivals_share: float = 0.8
    # Request-only traces (no steps to show a busy loop): overload also needs the queue's share of
    # TTFT itself up by this much (absolute), not only more arrivals.
    queue_share_increase: float = 0.1

    # --- fleets (diagnosis/fleet.py) ------------------------------------------------------------------
    # A subset is named when it holds 70% of the regression (current requests x the rise of the symptom's
    # mean over each instance's own baseline) and its lowest log-ratio is 2.5x the highest among the rest,
    # counted as at least log(1.1) (noise): a replica with busy threads in its core rose x1.75 in TPOT
    # while its two peers rose x1.03 and x1.13 on the same cores (a real 3-replica run); logs, because a
    # stall on every replica of a generated fleet raised their TTFT means x2 to x5.
    localize_share: float = 0.7
    localize_lift_gap: float = 2.5
    localize_min_lift: float = 0.1
    # When the fleet's symptoms hold, at most this many instances (those whose means rose most, by
    # localize_min_lift or more) are diagnosed alone: a 256-instance fleet costs a handful of diagnoses.
    alone_max_instances: int = 4
    peer_sample_rows: int = 50_000  # requests read for the peer test of an instance diagnosed alone
    localize_min_requests: int = 10  # fewer baseline requests: the instance is compared with the fleet's
    # An instance that served in the baseline is lost when its current request rate is a tenth or less.
    lost_instance_share: float = 0.1
    # routing_imbalance: one instance's share of requests up 1.5x and by 15 points at fleet arrivals within
    # 1.3x (a shift of traffic, not more of it).
    imbalance_share_ratio: float = 1.5
    imbalance_min_share_increase: float = 0.15
    imbalance_fleet_rate_ratio: float = 1.3
    # cache_affinity_lost: the share of repeated prompt prefixes landing on the instance they went to last
    # fell to 1/affinity_ratio of the baseline while the fleet's distinct keys per request stayed within
    # steady_prompt_ratio (the same prompts, scattered). A dev fleet run of three replicas: prefix aware ->
    # round robin moved it 0.82 -> 0.37 (x2.2), where the instances a shared prefix lands on moved only
    # 1.69 -> 1.91 (a loaded prefix-aware router already overflows to a second replica, and a window's
    # length changes that count).
    affinity_ratio: float = 1.5

    def __post_init__(self) -> None:
        for name in ("alpha", "arrival_p", "demand_p"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"{name} must be in (0, 1)")
        if self.min_ratio_p99 <= 1 or self.min_ratio_p50 <= 1:
            raise ValueError("regression ratios must be > 1")
        if not 0 < self.min_drop_rate < 1:
            raise ValueError("min_drop_rate must be in (0, 1)")
        if self.sample_per_side < 100 or self.target_intervals < 10:
            raise ValueError("sample_per_side must be >= 100 and target_intervals >= 10")
        if not 0 < self.min_segment_share < 0.5:
            raise ValueError("min_segment_share must be in (0, 0.5)")
        if not 0 < self.setting_step_share <= 1:
            raise ValueError("setting_step_share must be in (0, 1]")
