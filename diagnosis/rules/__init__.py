"""One rule per cause (one module each). Every rule is a pure function `evaluate(facts)` returning a
Finding, NotEnoughData when the data it needs was not recorded, or None when its evidence is absent."""

from __future__ import annotations

from types import ModuleType

from diagnosis.rules import (
    kv_cache_pressure,
    kv_transfer_slow,
    long_prompts,
    oversized_batch,
    prefill_interference,
    prefix_cache_miss,
    queueing_overload,
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
)
CAUSES: tuple[str, ...] = tuple(rule.CAUSE for rule in RULES)
