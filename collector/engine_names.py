"""Prometheus metric names of vLLM and SGLang, mapped to the stepscope names stored in `engine_samples`.

A rule asks for "the running batch", not for `vllm:num_requests_running` or `sglang:num_running_reqs`: each
engine's name (current and deprecated spellings) maps to one stepscope name here, and everything downstream
(the `engine_intervals` view, the diagnosis) reads only stepscope names. The table in docs/collector.md
("Scraping engines") lists the same maps for people.

Histograms map by their base name; their `_bucket`, `_sum` and `_count` series are stored as
`<name>_bucket` (with the `le` label), `<name>_sum` and `<name>_count`. `_created` series are not stored.
"""

from __future__ import annotations

# stepscope name -> what it is (the unit is in the name, as everywhere in stepscope)
METRICS: dict[str, str] = {
    "num_running": "requests in the running batch (gauge)",
    "num_waiting": "requests waiting for a batch slot (gauge)",
    "kv_usage": "share of the KV cache in use, 0..1 (gauge)",
    "preemptions_total": "preemptions of running requests (counter)",
    "prefix_queries_total": "prompt tokens looked up in the prefix cache (counter)",
    "prefix_hits_total": "prompt tokens found in the prefix cache (counter)",
    "prefix_hit_rate": "prefix-cache hit share reported by the engine, 0..1 (gauge)",
    "cached_tokens_total": "prompt tokens served from the prefix cache (counter)",
    "prompt_tokens_total": "prompt tokens processed (counter)",
    "generation_tokens_total": "tokens generated (counter)",
    "requests_finished_total": "finished requests, label finished_reason (counter; abort counts as aborted)",
    "requests_total": "requests processed (counter)",
    "requests_aborted_total": "requests aborted (counter)",
    "gen_throughput": "generated tokens per second reported by the engine (gauge)",
    "kv_blocks_used": "KV-cache blocks held by requests (gauge)",
    "kv_blocks_total": "KV-cache blocks in the pool (gauge)",
    "max_num_seqs": "the running-batch limit (gauge, or the label of a config info metric)",
    "cache_config": "KV-cache configuration, as labels: block_size, num_gpu_blocks, cache_dtype, "
    "enable_prefix_caching (info)",
    "iteration_tokens": "tokens per engine step (histogram)",
    "ttft_s": "time to first token (histogram)",
    "itl_s": "time between output tokens (histogram)",
    "e2e_s": "request latency, arrival to last token (histogram)",
    "queue_s": "time in the waiting queue (histogram)",
    "prefill_s": "time in prefill (histogram)",
    "decode_s": "time in decode (histogram)",
}

HISTOGRAMS = frozenset({"iteration_tokens", "ttft_s", "itl_s", "e2e_s", "queue_s", "prefill_s", "decode_s"})

# vLLM (v1 names first; deprecated and v0 spellings after them). Labels kept: model_name, engine,
# finished_reason, and every label of vllm:cache_config_info.
VLLM: dict[str, str] = {
    "vllm:num_requests_running": "num_running",
    "vllm:num_requests_waiting": "num_waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",  # deprecated
    "vllm:num_preemptions_total": "preemptions_total",
    "vllm:prefix_cache_queries_total": "prefix_queries_total",
    "vllm:prefix_cache_hits_total": "prefix_hits_total",
    "vllm:gpu_prefix_cache_queries_total": "prefix_queries_total",  # deprecated
    "vllm:gpu_prefix_cache_hits_total": "prefix_hits_total",  # deprecated
    "vllm:gpu_prefix_cache_hit_rate": "prefix_hit_rate",  # v0
    "vllm:prompt_tokens_total": "prompt_tokens_total",
    "vllm:generation_tokens_total": "generation_tokens_total",
    "vllm:request_success_total": "requests_finished_total",
    "vllm:cache_config_info": "cache_config",
    "vllm:iteration_tokens_total": "iteration_tokens",
    "vllm:time_to_first_token_seconds": "ttft_s",
    "vllm:inter_token_latency_seconds": "itl_s",
    "vllm:time_per_output_token_seconds": "itl_s",  # deprecated
    "vllm:e2e_request_latency_seconds": "e2e_s",
    "vllm:request_queue_time_seconds": "queue_s",
    "vllm:request_prefill_time_seconds": "prefill_s",
    "vllm:request_decode_time_seconds": "decode_s",
}

# SGLang (`--enable-metrics`). Labels kept: model_name and the rank labels.
SGLANG: dict[str, str] = {
    "sglang:num_running_reqs": "num_running",
    "sglang:num_queue_reqs": "num_waiting",
    "sglang:token_usage": "kv_usage",
    "sglang:cache_hit_rate": "prefix_hit_rate",
    "sglang:gen_throughput": "gen_throughput",
    "sglang:prompt_tokens_total": "prompt_tokens_total",
    "sglang:generation_tokens_total": "generation_tokens_total",
    "sglang:cached_tokens_total": "cached_tokens_total",
    "sglang:num_requests_total": "requests_total",
    "sglang:num_aborted_requests_total": "requests_aborted_total",
    "sglang:max_running_requests": "max_num_seqs",
    "sglang:time_to_first_token_seconds": "ttft_s",
    "sglang:inter_token_latency_seconds": "itl_s",
    "sglang:time_per_output_token_seconds": "itl_s",
    "sglang:e2e_request_latency_seconds": "e2e_s",
    "sglang:queue_time_seconds": "queue_s",
}

# stepscope's own engine serves the vLLM names plus these.
STEPSCOPE: dict[str, str] = {
    "stepscope:kv_blocks_used": "kv_blocks_used",
    "stepscope:kv_blocks_total": "kv_blocks_total",
    "stepscope:max_num_seqs": "max_num_seqs",
}

NAMES: dict[str, str] = VLLM | SGLANG | STEPSCOPE
_SUFFIXES = ("_bucket", "_sum", "_count")


def stepscope_name(sample_name: str) -> str | None:
    """The stepscope name of one exposed sample (`vllm:num_requests_running`,
    `vllm:time_to_first_token_seconds_bucket`, ...), or None when it is not mapped (or is a `_created`
    series)."""
    if sample_name.endswith("_created"):
        return None
    name = NAMES.get(sample_name)
    if name is not None and name not in HISTOGRAMS:
        return name
    for suffix in _SUFFIXES:
        if sample_name.endswith(suffix):
            base = NAMES.get(sample_name[: -len(suffix)])
            if base in HISTOGRAMS:
                return base + suffix
    return None


def otlp_names() -> dict[str, str]:
    """Exposed name -> stepscope name as metrics arrive over OTLP from an OpenTelemetry Collector's
    Prometheus receiver: the same names, and counters also without `_total` (the receiver's name
    normalisation trims it)."""
    out = dict(NAMES)
    for exposed, name in NAMES.items():
        if exposed.endswith("_total") and name not in HISTOGRAMS:
            out.setdefault(exposed.removesuffix("_total"), name)
    return out


def sql_maps() -> dict[str, str]:
    """`from_array, to_array` literals for ClickHouse's `transform`, filled into the migration that
    creates the OTLP views: `engine_scalar_names` (gauges, counters, info) and `engine_histogram_names`."""
    names = otlp_names()
    out = {}
    for key, wanted in (("engine_scalar_names", False), ("engine_histogram_names", True)):
        pairs = sorted((k, v) for k, v in names.items() if (v in HISTOGRAMS) == wanted)
        out[key] = f"[{', '.join(_quote(k) for k, _ in pairs)}], [{', '.join(_quote(v) for _, v in pairs)}]"
    return out


def _quote(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"
