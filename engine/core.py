"""The engine core: scheduler -> model runner -> sampler, one `step()` at a time. (Being written.)

Public API (the contract the front end and the offline helper rely on):

    core = EngineCore(EngineConfig(...))          # builds or loads the model, allocates the KV cache
    core.tokenizer                                # engine.tokenizer.Tokenizer of the model
    core.model_config                             # engine.config.ModelConfig
    core.add_request(EngineRequest(...))          # raises ValueError on a prompt that can never fit
    core.abort_request(req_id)                    # frees its blocks; its RequestOutput(finish_reason="abort") comes next step
    core.step() -> list[RequestOutput]            # one engine iteration; [] when idle
    core.has_unfinished_requests() -> bool
    core.num_waiting / core.num_running
    core.stats() -> dict                          # running, waiting, kv_blocks_used/free/total, kv_usage,
                                                  # prefix_cache_queries/hits (tokens), preemptions_total
    core.drain_events() -> list[StepEvent | RequestEvent]   # typed events, engine/events.py
    core.update_limits(**{name: value}) -> dict   # names from EngineConfig.runtime_fields(); returns the new values
"""
