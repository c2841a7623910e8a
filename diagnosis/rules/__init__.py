"""One rule per cause (one module each). Every rule is a pure function `evaluate(facts)` returning a
Finding, NotEnoughData when the data it needs was not recorded, or None when its evidence is absent."""

from __future__ import annotations

from types import ModuleType

from diagnosis.rules import (
    batch_limit_low,
    cache_affinity_lost,
    compute_slowdown,
    frontend_bottleneck,
    kv_cache_pressure,
    kv_transfer_slow,
    long_outputs,
    long_prompts,
    lost_capacity,
    oversized_batch,
    prefill_interference,
    prefix_cache_miss,
    queueing_overload,
    routing_imbalance,
    rpc_overhead,
    scheduler_stall,
    weight_quant_off,
)

RULES: tuple[ModuleType, ...] = (
    prefix_cache_miss,
    long_prompts,
    queueing_overload,
    oversized_batch,
    prefill_interference,
    kv_cache_pressure,
    scheduler_stall,
    rpc_overhead,
    weight_quant_off,
    kv_transfer_slow,
    compute_slowdown,
    long_outputs,
    batch_limit_low,
    frontend_bottleneck,
    routing_imbalance,
    cache_affinity_lost,
    lost_capacity,
)
RULE_CAUSES: tuple[str, ...] = tuple(rule.CAUSE for rule in RULES)
# What a finding can name: a rule's cause, or `unexplained` when symptoms regressed and none fits.
CAUSES: tuple[str, ...] = (*RULE_CAUSES, "unexplained")
