"""A small continuous-batching simulator that writes what stepscope's instrumentation would: `llm_request`
and `engine.step` spans, as rows of `otel_traces`, so the collector's materialized views fill `requests`
and `steps` (the realistic path).

It models the engine the faults act on: Poisson (or closed-loop) arrivals of chat, shared-prefix (the
tenants' system prompts routed to this replica) and long prompts; a scheduler with a token budget,
`max_num_seqs`, chunked prefill, a paged KV pool with preemption by recompute and a prefix cache (bounded
or not, least recently used evicted); step time linear in batch size and prefill tokens (~8 ms at batch 1,
~18 ms at batch 8, like the `small` preset on 2 CPU cores); gaps between steps; the front end's RPC delay
per token; and shared-machine noise: per-step jitter, rare hiccups, and contention episodes lasting
seconds. A fault is a set of field changes applied at `fault_at_s`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import heapq
import json
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

WEIGHT_BYTES = {"int8": 34_000_000, "fp32": 134_000_000}
WEIGHT_SPEED = {"int8": 1.0, "fp32": 1.7}


@dataclass(frozen=True)
class SimConfig:
    """One run. Times in seconds; `fault` holds the fields that change at `fault_at_s`."""

    seed: int = 0
    t0: float = 1_750_000_000.0
    duration_s: float = 240.0
    fault_at_s: float | None = 120.0
    fault: dict[str, Any] = field(default_factory=dict)
    service: str = "engine"
    instance: str = ""  # service.instance.id; "": SERVICE-0
    vllm: bool = False  # only gen_ai.* request attributes, no step spans
    scrape_s: float = 0.0  # > 0: the engine's /metrics (the vLLM names stepscope's engine serves) scraped
    scrape_limit: bool = True  # the page publishes max_num_seqs (stepscope:max_num_seqs; vLLM's does not)
    # workload
    rate_rps: float = 4.0
    # > 0: the same mean rate bunched, rate_rps * (1 + bunching) and * (1 - bunching) in alternate
    # `bunch_s` spells (a client population that acts together)
    bunching: float = 0.0
    bunch_s: float = 5.0
    clients: int = 0  # > 0: closed loop with this many clients
    prompt_median: int = 96
    prompt_factor: float = 1.0
    output_median: int = 64
    shared_fraction: float = 0.0
    shared_prefix_tokens: int = 512
    prefix_change_fraction: float = 0.0
    # the tenants (system prompts sys0, sys1, ...) whose shared requests the router sends this replica, each
    # as likely; routed by prefix, a tenant's prompts reach one replica, scattered, every replica
    tenants: tuple[int, ...] = (0,)
    long_fraction: float = 0.0
    long_prompt: int = 1500
    # engine
    max_num_seqs: int = 16
    budget: int = 512
    chunked: bool = True
    chunk_threshold: int = 256
    num_kv_blocks: int = 4096
    prefix_cache_blocks: int = 0  # > 0: cached prefixes kept in this many blocks, least recently used evicted
    block: int = 16
    weight_dtype: str = "int8"
    step_base_s: float = 0.0065
    per_seq_s: float = 0.0012
    per_prefill_token_s: float = 0.00012
    gap_base_s: float = 0.0004
    stall_ms: float = 0.0
    stall_prob: float = 0.3
    rpc_delay_s: float = 0.0004
    rpc_encode_per_seq_s: float = 0.00005
    rpc_factor: float = 1.0
    kv_transfer_per_token_s: float = 0.0
    # compute: the stepping thread computes `cpu_share` of a step's wall time; `cpu_wait_factor` > 1 makes
    # it wait for a core that much longer (a noisy neighbour), `clock_factor` > 1 makes the work itself
    # slower (clocks held down); `host_load` is the load average the host counters report
    cpu_share: float = 0.9
    cpu_wait_factor: float = 1.0
    clock_factor: float = 1.0
    host_load: float = 1.5
    host_cpus: int = 2  # the cores the engine may run on (host counter)
    engine_cpu_share: float = 0.55  # cores' worth of CPU the engine core process uses (host counter)
    # the front end: CPU seconds per request on its event loop before the request reaches the core
    frontend_cpu_s: float = 0.0008
    # sampling: 1-in-N steps recorded; requests head-sampled at `head_ratio`, slower ones than
    # `slow_request_s` kept anyway (weight 1), the others standing for 1 / head_ratio each
    steps_every: int = 1
    head_ratio: float = 1.0
    slow_request_s: float = 5.0
    # noise
    jitter: float = 0.12
    hiccup_prob: float = 0.004
    hiccup_s: tuple[float, float] = (0.01, 0.06)  # how much longer a step with a hiccup takes (uniform)
    contention_prob: float = 0.01  # per second: an episode of slower CPU starts
    contention_factor: float = 1.3
    # Load the whole host shares, the same for every replica of a fleet (no draw): (from_s, to_s, factor)
    # windows in which the gaps between steps take `factor` times as long (the loop waits for a core).
    host_swings: tuple[tuple[float, float, float], ...] = ()


@dataclass
class Seq:
    rid: int
    arrival: float
    prompt: int
    output: int
    key: str
    shared_len: int
    computed: int = 0
    generated: int = 0
    to_prefill: int = 0
    cached: int = 0
    first_sched: float | None = None
    first_token: float | None = None
    last_token: float = 0.0
    itl: list[float] = field(default_factory=list)
    preemptions: int = 0
    kv_transfer: float = 0.0
    rpc: list[float] = field(default_factory=list)
    frontend: float = 0.0
    loop_lag: float = 0.0


class Simulator:
    """Runs one SimConfig; `run()` returns (request rows, step rows) as dicts of span fields."""

    def __init__(self, cfg: SimConfig) -> None:
        self.base = cfg
        self.after = dataclasses.replace(cfg, **cfg.fault) if cfg.fault else cfg
        self.rng = np.random.default_rng(cfg.seed)
        self.requests: list[dict[str, Any]] = []
        self.steps: list[dict[str, Any]] = []
        self.cache: dict[str, int] = {}  # cached shared prefix -> its blocks, least recently used first
        # Prompts unique to a request hash to a key of their own on every replica (the engine's key is
        # the first block's hash); only the tenants' system prompts are the same bytes everywhere.
        self.own = f"@{cfg.instance}" if cfg.instance else ""
        self.next_rid = 0
        self.loop_free_at = 0.0  # when the front end's event loop is next free

    def cfg(self, t: float) -> SimConfig:
        fault_at = self.base.fault_at_s
        return self.after if fault_at is not None and t >= fault_at else self.base

    # --- workload -----------------------------------------------------------------------------------
    def through_frontend(self, arrival: float) -> tuple[float, float]:
        """(time the request reaches the core's queue, loop lag it met): the front end's loop serves
        requests one at a time, `frontend_cpu_s` each."""
        c = self.cfg(arrival)
        start = max(arrival, self.loop_free_at)
        self.loop_free_at = start + c.frontend_cpu_s * self.rng.lognormal(0, 0.2)
        return self.loop_free_at, start - arrival

    def new_seq(self, t: float) -> Seq:
        c, rng = self.cfg(t), self.rng
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        out = int(np.clip(round(c.output_median * math.exp(0.5 * rng.standard_normal())), 8, 256))
        u = rng.random()
        if u < c.shared_fraction:
            user = int(np.clip(round(48 * math.exp(0.5 * rng.standard_normal())), 8, 256))
            changed = rng.random() < c.prefix_change_fraction
            tenant = c.tenants[rng.integers(len(c.tenants))] if len(c.tenants) > 1 else c.tenants[0]
            key = f"chg{rid}{self.own}" if changed else f"sys{tenant}"
            return Seq(rid, t, c.shared_prefix_tokens + user, out, key, c.shared_prefix_tokens)
        if u < c.shared_fraction + c.long_fraction:
            n = int(c.long_prompt * math.exp(0.15 * rng.standard_normal()))
            return Seq(rid, t, max(16, n), out, f"r{rid}{self.own}", 0)
        n = round(c.prompt_median * c.prompt_factor * math.exp(0.6 * rng.standard_normal()))
        n = int(np.clip(n, 4, 4096))
        return Seq(rid, t, n, out, f"r{rid}{self.own}" if n >= c.block else "", 0)

    def arrivals(self) -> list[float]:
        times, t = [], 0.0
        while t < self.base.duration_s:
            c = self.cfg(t)
            swing = c.bunching if int(t // c.bunch_s) % 2 == 0 else -c.bunching
            t += self.rng.exponential(1.0 / (c.rate_rps * (1 + swing)))
            times.append(t)
        return times

    # --- engine -------------------------------------------------------------------------------------
    def run(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        base, rng = self.base, self.rng
        arrivals = sorted(rng.uniform(0, 0.5, base.clients)) if base.clients else self.arrivals()
        pending = [self.through_frontend(a)[0:1] + (a,) for a in arrivals]  # (at the core, arrival)
        waiting: deque[Seq] = deque()
        running: list[Seq] = []
        t, prev_end, step_id, contended_until = 0.0, 0.0, 0, -1.0
        while t < base.duration_s:
            while pending and pending[0][0] <= t:
                at_core, arrival = heapq.heappop(pending)
                seq = self.new_seq(arrival)
                seq.frontend = at_core - arrival
                waiting.append(seq)
            if not running and not waiting:
                if not pending:
                    break
                t = pending[0][0]
                continue
            c = self.cfg(t)
            if t > contended_until and rng.random() < c.contention_prob * 0.02:
                contended_until = t + rng.uniform(2, 8)
            slow = c.contention_factor if t < contended_until else 1.0
            batch, preempted = self.schedule(c, running, waiting, t)
            if not batch:
                t += 0.001
                continue
            prefill = sum(n for s, n in batch if s.to_prefill > 0)
            decode = sum(1 for s, n in batch if s.to_prefill == 0)
            gap = c.gap_base_s * rng.lognormal(0, 0.3) + c.rpc_encode_per_seq_s * c.rpc_factor * len(batch)
            if c.stall_ms and rng.random() < c.stall_prob:
                gap += rng.uniform(0.5, 1.0) * c.stall_ms / 1000
            gap *= slow * math.prod(f for a, b, f in c.host_swings if a <= t < b)
            work = c.step_base_s + c.per_seq_s * decode + c.per_prefill_token_s * prefill
            work *= WEIGHT_SPEED[c.weight_dtype] * c.clock_factor * rng.lognormal(0, c.jitter)
            cpu = work * c.cpu_share
            dur = work * slow * c.cpu_wait_factor
            if rng.random() < c.hiccup_prob:
                dur += rng.uniform(*c.hiccup_s)
            start = t + gap
            end = start + dur
            used = sum(self.blocks(s.computed + n, c) for s, n in batch)
            context = sum(s.computed + n for s, n in batch)
            self.steps.append(
                {
                    "start": start,
                    "dur": dur,
                    "id": step_id,
                    "num_running": len(running),
                    "num_waiting": len(waiting),
                    "batch_size": len(batch),
                    "prefill_tokens": prefill,
                    "decode_tokens": decode,
                    "kv_blocks_used": min(used, c.num_kv_blocks),
                    "kv_blocks_total": c.num_kv_blocks,
                    "preemptions": preempted,
                    "prefix_hit_tokens": sum(s.cached for s, n in batch if s.computed == s.cached),
                    "chunked": c.chunked,
                    "max_num_seqs": c.max_num_seqs,
                    "max_num_batched_tokens": c.budget,
                    "gap": start - prev_end if step_id else gap,
                    "bytes_read": WEIGHT_BYTES[c.weight_dtype] + 4096 * context,
                    "weight_dtype": c.weight_dtype,
                    "cpu": cpu,
                    "load": c.host_load * c.cpu_wait_factor * rng.lognormal(0, 0.1),
                    "engine_cpu": c.engine_cpu_share,  # no draw: the other streams stay as they were
                }
            )
            step_id += 1
            self.update(batch, running, end, c, pending)
            prev_end = t = end
        return self.requests, self.steps

    def blocks(self, tokens: int, c: SimConfig) -> int:
        return -(-tokens // c.block)

    def schedule(
        self, c: SimConfig, running: list[Seq], waiting: deque[Seq], t: float
    ) -> tuple[list[tuple[Seq, int]], int]:
        budget, batch, preempted = c.budget, [], 0
        used = sum(self.blocks(s.computed, c) for s in running)
        for s in list(running):
            if s not in running:
                continue
            n = (
                1
                if s.to_prefill == 0
                else (min(s.to_prefill, c.chunk_threshold, budget) if c.chunked else s.to_prefill)
            )
            if n <= 0:
                continue
            need = self.blocks(s.computed + n, c) - self.blocks(s.computed, c)
            while used + need > c.num_kv_blocks and running[-1] is not s:
                victim = running.pop()
                used -= self.blocks(victim.computed, c)
                victim.computed, victim.preemptions = 0, victim.preemptions + 1
                victim.to_prefill = victim.prompt + victim.generated
                victim.cached = 0
                waiting.appendleft(victim)
                preempted += 1
                batch = [(q, m) for q, m in batch if q is not victim]
            if used + need > c.num_kv_blocks:
                continue
            used += need
            batch.append((s, n))
            budget -= n
        while waiting and len(running) < c.max_num_seqs and budget > 0 and not preempted:
            s = waiting[0]
            if s.first_sched is None:
                hit = s.key in self.cache and s.shared_len > 0
                if hit:
                    self.cache[s.key] = self.cache.pop(s.key)  # now the most recently used
                s.cached = (s.shared_len // c.block) * c.block if hit else 0
                s.computed, s.to_prefill = s.cached, s.prompt - s.cached
            n = min(s.to_prefill, c.chunk_threshold, budget) if c.chunked else s.to_prefill
            if not c.chunked and n > budget and any(q.to_prefill for q, _ in batch):
                break
            need = self.blocks(s.computed + n, c) - self.blocks(s.computed, c)
            if used + need > c.num_kv_blocks:
                break
            waiting.popleft()
            s.first_sched = t if s.first_sched is None else s.first_sched
            running.append(s)
            used += need
            batch.append((s, n))
            budget -= n
        return batch, preempted

    def update(
        self, batch: list[tuple[Seq, int]], running: list[Seq], end: float, c: SimConfig, pending: list[float]
    ) -> None:
        rng = self.rng
        for s, n in batch:
            s.computed += n
            if s.to_prefill > 0:
                s.to_prefill -= n
                if s.to_prefill > 0:
                    continue
                if s.shared_len and s.key.startswith("sys"):
                    self.keep(s.key, s.shared_len // c.block, c)
                if s.first_token is not None:
                    continue  # recompute after preemption: the next decode step samples
                s.kv_transfer = c.kv_transfer_per_token_s * (s.prompt - s.cached) * rng.lognormal(0, 0.2)
                s.first_token = s.last_token = end + s.kv_transfer
                s.generated = 1
            else:
                now = end + s.kv_transfer
                s.itl.append(now - s.last_token)
                s.last_token = now
                s.generated += 1
            s.rpc.append(c.rpc_delay_s * c.rpc_factor * rng.lognormal(0, 0.3))
            if s.generated >= s.output:
                running.remove(s)
                self.finish(s)
                if self.base.clients:
                    arrival = end + rng.exponential(0.05)
                    heapq.heappush(pending, (self.through_frontend(arrival)[0], arrival))

    def keep(self, key: str, blocks: int, c: SimConfig) -> None:
        """Cache a shared prefix just computed, evicting the least recently used ones past the bound."""
        self.cache.pop(key, None)
        self.cache[key] = blocks
        bound = c.prefix_cache_blocks or math.inf
        while sum(self.cache.values()) > bound and len(self.cache) > 1:
            del self.cache[next(iter(self.cache))]

    def finish(self, s: Seq) -> None:
        rpc_first, rpc_last = s.rpc[0], s.rpc[-1]
        self.requests.append(
            {
                "start": s.arrival,
                "ttft": s.first_token + rpc_first + 0.001 - s.arrival,
                "e2e": s.last_token + rpc_last + 0.001 - s.arrival,
                "queue": s.first_sched - s.arrival,
                "prefill": s.first_token - s.kv_transfer - s.first_sched,
                "decode": s.last_token - s.first_token,
                "kv_transfer": s.kv_transfer,
                "input": s.prompt,
                "output": s.generated,
                "cached": s.cached,
                "key": s.key if s.key.startswith(("sys", "chg", "r")) else "",
                "preemptions": s.preemptions,
                "itl_mean": float(np.mean(s.itl)) if s.itl else None,
                "itl_max": float(np.max(s.itl)) if s.itl else None,
                "itl_count": len(s.itl),
                "rpc_mean": float(np.mean(s.rpc)),
                "rpc_max": float(np.max(s.rpc)),
                "frontend": s.frontend,
            }
        )


def _hex(rng: np.random.Generator, n: int) -> str:
    return rng.bytes(n).hex()


def _attr(v: float) -> str:
    return repr(float(v))


def spans(cfg: SimConfig) -> tuple[dict[str, list[Any]], list[dict[str, Any]]]:
    """Run the simulation and return otel_traces columns (column name -> values) and the step rows."""
    requests, steps = Simulator(cfg).run()
    rng = np.random.default_rng([cfg.seed, 7])
    cols: dict[str, list[Any]] = {
        k: []
        for k in (
            "Timestamp",
            "TraceId",
            "SpanId",
            "SpanName",
            "SpanKind",
            "ServiceName",
            "ResourceAttributes",
            "ScopeName",
            "SpanAttributes",
            "Duration",
            "StatusCode",
        )
    }
    resource = {
        "service.name": cfg.service,
        "service.instance.id": cfg.instance or f"{cfg.service}-0",
        "stepscope.model": "small",
    }

    def add(name: str, kind: str, start: float, dur: float, attrs: dict[str, str]) -> None:
        ns = int((cfg.t0 + start) * 1e9)
        cols["Timestamp"].append(dt.datetime.fromtimestamp(ns / 1e9, dt.UTC).replace(tzinfo=None))
        cols["TraceId"].append(_hex(rng, 16))
        cols["SpanId"].append(_hex(rng, 8))
        cols["SpanName"].append(name)
        cols["SpanKind"].append(kind)
        cols["ServiceName"].append(cfg.service)
        cols["ResourceAttributes"].append(resource)
        cols["ScopeName"].append("stepscope")
        cols["SpanAttributes"].append(attrs)
        cols["Duration"].append(max(0, int(dur * 1e9)))
        cols["StatusCode"].append("STATUS_CODE_UNSET")

    keep = np.random.default_rng([cfg.seed, 11])
    for i, r in enumerate(requests):
        slow = r["e2e"] > cfg.slow_request_s
        head = keep.random() < cfg.head_ratio
        if not (head or slow):
            continue  # not head-sampled and not slow: the front end drops its span
        a = {
            "gen_ai.request.id": f"req-{cfg.seed}-{i}",
            "gen_ai.latency.time_to_first_token": _attr(r["ttft"]),
            "gen_ai.latency.e2e": _attr(r["e2e"]),
            "gen_ai.latency.time_in_queue": _attr(r["queue"]),
            "gen_ai.latency.time_in_model_prefill": _attr(r["prefill"]),
            "gen_ai.latency.time_in_model_decode": _attr(r["decode"]),
            "gen_ai.response.finish_reasons": json.dumps(["length"]),
        }
        if cfg.vllm:
            a |= {
                "gen_ai.usage.prompt_tokens": str(r["input"]),
                "gen_ai.usage.completion_tokens": str(r["output"]),
            }
        else:
            a |= {
                "gen_ai.usage.input_tokens": str(r["input"]),
                "gen_ai.usage.output_tokens": str(r["output"]),
                "gen_ai.usage.cache_read.input_tokens": str(r["cached"]),
                "stepscope.prefix_cache.key": r["key"],
                "stepscope.preemptions": str(r["preemptions"]),
                "stepscope.itl.count": str(r["itl_count"]),
                "stepscope.rpc.delay_mean_s": _attr(r["rpc_mean"]),
                "stepscope.rpc.delay_max_s": _attr(r["rpc_max"]),
                "stepscope.latency.frontend_s": _attr(r["frontend"]),
                "stepscope.frontend.loop_lag_s": _attr(max(r["frontend"] - cfg.frontend_cpu_s, 0.0)),
                "stepscope.sampling.reason": "head" if head else "slow",
                "stepscope.sampling.weight": _attr(1.0 if slow else 1.0 / cfg.head_ratio),
            }
            if r["itl_mean"] is not None:
                a |= {
                    "stepscope.tpot.mean_s": _attr(r["itl_mean"]),
                    "stepscope.tpot.max_s": _attr(r["itl_max"]),
                }
            if r["kv_transfer"] > 0:
                a["stepscope.latency.kv_transfer_s"] = _attr(r["kv_transfer"])
        add("llm_request", "SPAN_KIND_SERVER", r["start"], r["e2e"], a)
    if cfg.vllm:
        return cols, steps
    for s in steps:
        if s["id"] % cfg.steps_every:
            continue  # 1-in-N step sampling
        a = {
            f"stepscope.step.{k}": str(s[k])
            for k in (
                "num_running",
                "num_waiting",
                "batch_size",
                "prefill_tokens",
                "decode_tokens",
                "kv_blocks_used",
                "kv_blocks_total",
                "preemptions",
                "max_num_seqs",
                "max_num_batched_tokens",
                "bytes_read",
                "weight_dtype",
            )
        }
        a |= {
            "stepscope.step.id": str(s["id"]),
            "stepscope.step.kv_blocks_free": str(s["kv_blocks_total"] - s["kv_blocks_used"]),
            "stepscope.step.prefix_cache_hit_tokens": str(s["prefix_hit_tokens"]),
            "stepscope.step.chunked_prefill": "true" if s["chunked"] else "false",
            "stepscope.step.gap_s": _attr(s["gap"]),
            "stepscope.step.kv_dtype": "fp32",
            "stepscope.step.cpu_s": _attr(s["cpu"]),
            "stepscope.step.sampled_every": str(cfg.steps_every),
        }
        if s["id"] % 50 == 0:  # host counters ride on about one step a second
            a["stepscope.host.load_1m"] = _attr(s["load"])
            a["stepscope.host.cpus"] = str(cfg.host_cpus)
            a["stepscope.host.engine_cpu_share"] = _attr(s["engine_cpu"])
        add("engine.step", "SPAN_KIND_INTERNAL", s["start"], s["dur"], a)
    return cols, steps


def scraped(cfg: SimConfig, steps: list[dict[str, Any]]) -> list[list[Any]]:
    """engine_samples columns (collector.scrape.COLUMNS) of scraping the simulated engine every
    `scrape_s`: gauges as of the last step that ended, counters summed over the steps that ended."""
    labels = (("model_name", "small"),)
    totals = dict.fromkeys(("preemptions_total", "generation_tokens_total", "prompt_tokens_total"), 0.0)
    totals |= {"prefix_queries_total": 0.0, "prefix_hits_total": 0.0}
    rows: list[tuple] = []
    t, i, last = cfg.scrape_s, 0, None
    while t < cfg.duration_s:
        while i < len(steps) and steps[i]["start"] + steps[i]["dur"] <= t:
            s = last = steps[i]
            totals["preemptions_total"] += s["preemptions"]
            totals["generation_tokens_total"] += s["decode_tokens"]
            totals["prompt_tokens_total"] += s["prefill_tokens"]
            totals["prefix_queries_total"] += s["prefill_tokens"] + s["prefix_hit_tokens"]
            totals["prefix_hits_total"] += s["prefix_hit_tokens"]
            i += 1
        if last is not None:
            ns = int((cfg.t0 + t) * 1e9)
            config = labels + (
                ("block_size", str(cfg.block)),
                ("num_gpu_blocks", str(last["kv_blocks_total"])),
            )
            gauges = {
                "num_running": last["num_running"],
                "num_waiting": last["num_waiting"],
                "kv_usage": last["kv_blocks_used"] / last["kv_blocks_total"],
            }
            if cfg.scrape_limit:
                gauges["max_num_seqs"] = last["max_num_seqs"]
            rows += [(ns, name, float(v), labels) for name, v in (gauges | totals).items()]
            rows.append((ns, "cache_config", 1.0, config))
        t += cfg.scrape_s
    return [
        [r[0] for r in rows],
        [cfg.service] * len(rows),
        [f"{cfg.service}-0"] * len(rows),
        [r[1] for r in rows],
        [r[2] for r in rows],
        [r[3] for r in rows],
        [r[1] for r in rows],
        ["scrape"] * len(rows),
    ]


def write(store: Any, cfg: SimConfig) -> dict[str, list[Any]]:
    """Simulate `cfg` and insert its spans into `store`'s otel_traces (the views fill requests and steps),
    and with `scrape_s` its scraped /metrics samples into engine_samples."""
    cols, steps = spans(cfg)
    store.insert("otel_traces", list(cols), list(cols.values()))
    if cfg.scrape_s > 0:
        from collector.scrape import to_arrow

        table = to_arrow(scraped(cfg, steps))
        store.insert("engine_samples", table.column_names, table)
    return cols
