"""Prometheus text exposition of the server's metrics, under vLLM's names so vLLM dashboards work.

Latency histograms are measured in the front end (what a client sees), except the phase histograms
(queue, prefill, decode), which take the core's timestamps of each request when it ends, as vLLM does;
gauges and the cache and preemption counters come from the core's stats record, which arrives with every
step's OUTPUTS.
Hand-written text format 0.0.4: no client library, no global registry.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from engine.protocol import EngineStats
from engine.request import RequestTimings

# vLLM's buckets, with finer ones below its smallest: a tiny model on a CPU steps in milliseconds.
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
    5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS_S = (
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


# vLLM's buckets for tokens per engine step.
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(slots=True)
class Histogram:
    """Cumulative-on-render histogram: `counts[i]` holds observations in (buckets[i-1], buckets[i]]."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)  # the last slot is +Inf

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, running = [], 0
        for le, n in zip((*self.buckets, math.inf), self.counts, strict=True):
            running += n
            out.append(f'{name}_bucket{{{labels},le="{_fmt(le)}"}} {running}')
        out.append(f"{name}_sum{{{labels}}} {_fmt(self.sum)}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


class ServerMetrics:
    """Everything `/metrics` shows. The front end calls the `observe_*`/`count_*` methods."""

    def __init__(self, model_name: str) -> None:
        self.labels = f'model_name="{_escape(model_name)}"'
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.itl = Histogram(ITL_BUCKETS_S)
        self.e2e = Histogram(E2E_BUCKETS_S)
        # vLLM's phase histograms share its request-latency buckets
        self.queue = Histogram(E2E_BUCKETS_S)
        self.prefill = Histogram(E2E_BUCKETS_S)
        self.decode = Histogram(E2E_BUCKETS_S)
        self.iteration_tokens = Histogram(ITERATION_TOKENS_BUCKETS)  # per engine step, as the core reports
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success: dict[str, int] = {}  # finished_reason -> requests
        self.rejected: dict[str, int] = {}  # HTTP status -> requests refused before reaching the core
        self.block_size = 0
        self.cache_dtype = "auto"
        self.prefix_caching = True
        self.max_num_seqs = 0

    def set_engine_info(self, info: dict[str, object]) -> None:
        """The engine's configuration as the core reported it (ready info, or a limits reply)."""
        self.block_size = int(info.get("block_size", self.block_size))  # type: ignore[call-overload]
        self.cache_dtype = str(info.get("kv_dtype", self.cache_dtype))
        self.prefix_caching = bool(info.get("enable_prefix_caching", self.prefix_caching))
        limits = info.get("limits")
        if isinstance(limits, dict) and "max_num_seqs" in limits:
            self.max_num_seqs = int(limits["max_num_seqs"])

    def count_finished(self, reason: str, prompt_tokens: int, generation_tokens: int) -> None:
        self.success[reason] = self.success.get(reason, 0) + 1
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens

    def observe_phases(self, t: RequestTimings, kv_transfer_ns: int = 0) -> None:
        """A finished request's phases from the core's clock: queue = first scheduled - arrival, prefill =
        first token - first scheduled (less a disaggregated KV transfer, as on the request span), decode =
        last token - first token. A phase the request never reached is not observed."""
        if t.first_scheduled_ns:
            self.queue.observe(max(t.first_scheduled_ns - t.arrival_ns, 0) / 1e9)
        if t.first_scheduled_ns and t.first_token_ns:
            prefill_ns = t.first_token_ns - t.first_scheduled_ns
            self.prefill.observe(max(prefill_ns - min(kv_transfer_ns, prefill_ns), 0) / 1e9)
            self.decode.observe(max(t.last_token_ns - t.first_token_ns, 0) / 1e9)

    def count_rejected(self, status: int) -> None:
        key = str(status)
        self.rejected[key] = self.rejected.get(key, 0) + 1

    def render(self, stats: EngineStats, num_inflight: int) -> str:
        """The whole exposition, from the front end's counters and the core's latest stats."""
        lb, s = self.labels, stats
        out: list[str] = []

        def metric(name: str, kind: str, help_text: str, lines: list[str]) -> None:
            out.extend((f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *lines))

        def one(name: str, kind: str, help_text: str, value: float) -> None:
            metric(name, kind, help_text, [f"{name}{{{lb}}} {_fmt(value)}"])

        one("vllm:num_requests_running", "gauge", "Requests in the running batch.", stats.running)
        one("vllm:num_requests_waiting", "gauge", "Requests waiting for a batch slot.", stats.waiting)
        one("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage; 1 means 100 percent.", stats.kv_usage)
        one(
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prompt tokens looked up.",
            stats.prefix_cache_queries,
        )
        one("vllm:prefix_cache_hits_total", "counter", "Prompt tokens found cached.", s.prefix_cache_hits)
        one(
            "vllm:num_preemptions_total",
            "counter",
            "Preemptions of running requests.",
            stats.preemptions_total,
        )
        one("vllm:prompt_tokens_total", "counter", "Prompt tokens of finished requests.", self.prompt_tokens)
        one("vllm:generation_tokens_total", "counter", "Generated tokens.", self.generation_tokens)
        metric(
            "vllm:request_success_total",
            "counter",
            "Finished requests by finish reason.",
            [
                f'vllm:request_success_total{{{lb},finished_reason="{_escape(r)}"}} {n}'
                for r, n in sorted(self.success.items())
            ],
        )
        for name, hist, help_text in (
            ("vllm:time_to_first_token_seconds", self.ttft, "Time to first token, seen by the server."),
            ("vllm:inter_token_latency_seconds", self.itl, "Time between output tokens."),
            ("vllm:e2e_request_latency_seconds", self.e2e, "Request latency from arrival to last token."),
            ("vllm:request_queue_time_seconds", self.queue, "Time waiting, per finished request."),
            ("vllm:request_prefill_time_seconds", self.prefill, "Time in prefill, per finished request."),
            ("vllm:request_decode_time_seconds", self.decode, "Time in decode, per finished request."),
            ("vllm:iteration_tokens_total", self.iteration_tokens, "Tokens scheduled per engine step."),
        ):
            metric(name, "histogram", help_text, hist.lines(name, lb))
        # vLLM's cache configuration as an info metric; num_gpu_blocks is the pool now (it can be resized)
        config = {
            "block_size": str(self.block_size),
            "cache_dtype": self.cache_dtype,
            "enable_prefix_caching": str(self.prefix_caching),
            "num_gpu_blocks": str(stats.kv_blocks_total),
        }
        config_labels = ",".join(f'{k}="{_escape(v)}"' for k, v in config.items())
        metric(
            "vllm:cache_config_info",
            "gauge",
            "Information of the engine's cache configuration.",
            [f"vllm:cache_config_info{{{config_labels}}} 1"],
        )
        one("stepscope:max_num_seqs", "gauge", "The running-batch limit (max_num_seqs).", self.max_num_seqs)
        one("stepscope:kv_blocks_used", "gauge", "KV-cache blocks held by requests.", stats.kv_blocks_used)
        one("stepscope:kv_blocks_total", "gauge", "KV-cache blocks in the pool.", stats.kv_blocks_total)
        one("stepscope:requests_in_flight", "gauge", "Requests between arrival and finish.", num_inflight)
        one("stepscope:core_events_dropped_total", "counter", "Core events dropped.", stats.events_dropped)
        metric(
            "stepscope:requests_rejected_total",
            "counter",
            "Requests refused by the front end, by HTTP status.",
            [
                f'stepscope:requests_rejected_total{{{lb},status="{s}"}} {n}'
                for s, n in sorted(self.rejected.items())
            ],
        )
        return "\n".join(out) + "\n"


def _fmt(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    if isinstance(v, int) or float(v).is_integer():
        return str(int(v)) if abs(v) < 2**53 else repr(float(v))
    return repr(float(v))


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
