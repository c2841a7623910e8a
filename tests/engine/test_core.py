"""The engine core on the tiny preset: batching, prefix caching, preemption, static mode, events."""

import random

import pytest

from engine.config import EngineConfig, SamplingParams
from engine.core import EngineCore
from engine.events import RequestEvent, StepEvent
from engine.llm import LLM
from engine.request import EngineRequest

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def prompts(n: int, seed: int = 0, lo: int = 5, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def config(**kw) -> EngineConfig:
    return EngineConfig(model="tiny", num_threads=1, **kw)


@pytest.fixture(scope="module")
def alone_outputs() -> tuple[list[list[int]], list[list[int]]]:
    """Each prompt generated on its own: the reference every batching mode must reproduce."""
    ps = prompts(10)
    llm = LLM(config(enable_prefix_caching=False))
    return ps, [llm.generate([p], GREEDY)[0].token_ids for p in ps]


def test_batched_greedy_equals_each_request_alone(alone_outputs):
    ps, alone = alone_outputs
    llm = LLM(config(max_num_seqs=8, max_num_batched_tokens=64))
    assert [g.token_ids for g in llm.generate(ps, GREEDY)] == alone
    llm.core.check_invariants()
    assert llm.core.kv.pool.num_used == 0


def test_static_and_unchunked_modes_give_the_same_greedy_outputs(alone_outputs):
    ps, alone = alone_outputs
    for cfg in (config(scheduling="static", max_num_seqs=4), config(enable_chunked_prefill=False)):
        llm = LLM(cfg)
        assert [g.token_ids for g in llm.generate(ps, GREEDY)] == alone, cfg.scheduling
        assert llm.core.kv.pool.num_used == 0


def test_torch_attention_gives_the_native_kernels_greedy_outputs(alone_outputs):
    """The reference ran with the default backend (the native decode kernel where it builds); gather +
    SDPA must agree token for token, continuous and static (left-padded) alike."""
    ps, alone = alone_outputs
    for cfg in (
        config(kernels="torch", max_num_seqs=8),
        config(kernels="torch", scheduling="static"),
    ):
        assert [g.token_ids for g in LLM(cfg).generate(ps, GREEDY)] == alone, cfg.scheduling


def test_prefix_cache_hit_changes_no_output_and_computes_fewer_tokens():
    system = prompts(1, seed=3, lo=80, hi=80)[0]
    a, b = system + [1, 2, 3], system + [4, 5, 6, 7]
    cold = LLM(config(enable_prefix_caching=False)).generate([b], GREEDY)[0]
    llm = LLM(config())
    llm.generate([a], GREEDY)
    warm = llm.generate([b], GREEDY)[0]
    assert warm.token_ids == cold.token_ids
    assert warm.num_cached_tokens == 80  # five full 16-token blocks of the shared system prompt
    stats = llm.core.stats()
    assert stats["prefix_cache_hits"] == 80
    assert stats["prefix_cache_queries"] == len(a) + len(b)


def test_cache_salt_keeps_tenants_apart():
    p = prompts(1, seed=4, lo=40, hi=40)[0]
    llm = LLM(config())
    llm.generate([p + [1]], GREEDY, cache_salt="tenant-a")
    assert llm.generate([p + [2]], GREEDY, cache_salt="tenant-b")[0].num_cached_tokens == 0
    assert llm.generate([p + [3]], GREEDY, cache_salt="tenant-a")[0].num_cached_tokens == 32


def test_preemption_under_kv_pressure_keeps_outputs_and_leaks_nothing(alone_outputs):
    ps, alone = alone_outputs
    llm = LLM(config(num_kv_blocks=12, max_num_seqs=8, enable_prefix_caching=False))
    gens = llm.generate(ps, GREEDY)
    assert [g.token_ids for g in gens] == alone
    assert sum(g.num_preemptions for g in gens) > 0
    assert llm.core.stats()["preemptions_total"] > 0
    llm.core.check_invariants()
    assert llm.core.kv.num_free_blocks == 12


def test_abort_frees_blocks_and_reports_once():
    core = EngineCore(config())
    for i, p in enumerate(prompts(3, seed=5)):
        core.add_request(
            EngineRequest(f"r{i}", p, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
        )
    core.step()
    core.abort_request("r1")
    core.abort_request("r1")  # a second abort of the same request is a no-op
    outs = core.step()
    aborted = [o for o in outs if o.req_id == "r1"]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].finish_reason == "abort"
    core.check_invariants()
    core.abort_request("r0")
    core.abort_request("r2")
    core.step()
    assert not core.has_unfinished_requests()
    assert core.kv.pool.num_used == 0
    core.check_invariants()


def test_stops_on_max_tokens_eos_and_stop_tokens():
    core = EngineCore(config())
    llm = LLM(core=core)
    p = prompts(1, seed=6)[0]
    free_run = llm.generate([p], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert len(free_run.token_ids) == 8 and free_run.finish_reason == "length"
    stop_at = free_run.token_ids[3]
    stopped = llm.generate([p], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(stop_at,)))[0]
    assert stopped.token_ids == free_run.token_ids[: free_run.token_ids.index(stop_at) + 1]
    assert stopped.finish_reason == "stop"
    core.scheduler.eos_token_id = stop_at  # the same path as the model's EOS
    eos = llm.generate([p], SamplingParams(max_tokens=8, temperature=0))[0]
    assert eos.finish_reason == "stop" and eos.token_ids[-1] == stop_at


def test_seeded_sampling_is_reproducible_whatever_the_batch():
    p = prompts(4, seed=7)
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234)
    alone = LLM(config()).generate([p[0]], sp)[0].token_ids
    together = LLM(config()).generate(p, [sp] + [SamplingParams(max_tokens=10, temperature=1.0)] * 3)
    assert together[0].token_ids == alone


def test_bad_requests_are_refused_at_the_door():
    core = EngineCore(config(num_kv_blocks=4))
    with pytest.raises(ValueError, match="empty"):
        core.add_request(EngineRequest("e", [], GREEDY))
    with pytest.raises(ValueError, match="context"):
        core.add_request(EngineRequest("long", [1] * core.model_config.max_model_len, GREEDY))
    with pytest.raises(ValueError, match="KV blocks"):
        core.add_request(EngineRequest("big", [1] * 100, GREEDY))
    assert not core.has_unfinished_requests()


def test_runtime_limits_change_between_steps_and_reject_bad_values():
    core = EngineCore(config(num_kv_blocks=64))
    assert core.update_limits(max_num_seqs=3, enable_chunked_prefill=False)["max_num_seqs"] == 3
    with pytest.raises(ValueError, match="runtime knob"):
        core.update_limits(block_size=32)
    with pytest.raises(ValueError):
        core.update_limits(max_num_seqs=0)
    assert core.limits()["max_num_seqs"] == 3  # the refused change left nothing half-applied
    core.update_limits(num_kv_blocks=16)
    assert core.stats()["kv_blocks_total"] == 16
    core.update_limits(num_kv_blocks=128)
    assert core.stats()["kv_blocks_free"] == 128
    gens = LLM(core=core).generate(prompts(6, seed=8), GREEDY)
    assert all(len(g.token_ids) == 12 for g in gens)
    core.check_invariants()


def test_long_prompt_does_not_starve_short_ones():
    core = EngineCore(config(max_num_batched_tokens=64, max_num_seqs=4))
    core.add_request(EngineRequest("long", [7] * 600, GREEDY))
    core.add_request(EngineRequest("short", [8] * 10, GREEDY))
    first_tokens = {}
    step = 0
    while core.has_unfinished_requests():
        step += 1
        for out in core.step():
            first_tokens.setdefault(out.req_id, step)
    assert first_tokens["short"] < first_tokens["long"]  # the short one is not queued behind 600 tokens


def test_events_describe_every_step_and_request_when_recording():
    core = EngineCore(config(max_num_batched_tokens=32), record_events=True)
    llm = LLM(core=core)
    llm.generate(prompts(3, seed=9, lo=40, hi=50), GREEDY)
    events = core.drain_events()
    steps = [e for e in events if isinstance(e, StepEvent)]
    finished = [e for e in events if isinstance(e, RequestEvent) and e.kind == "finished"]
    assert len(finished) == 3 and {e.num_output_tokens for e in finished} == {12}
    assert [s.step_id for s in steps] == list(range(len(steps)))
    assert sum(s.decode_tokens for s in steps) == 3 * 11  # the first token of each comes from its prefill
    assert sum(s.prefill_tokens for s in steps) == sum(e.num_prompt_tokens for e in finished)
    assert all(s.start_ns <= s.schedule_end_ns <= s.forward_end_ns <= s.end_ns for s in steps)
    for e in finished:
        assert e.arrival_ns <= e.first_scheduled_ns <= e.first_token_ns <= e.last_token_ns
        assert e.itl_count == 11
    assert core.drain_events() == []
    silent = EngineCore(config())
    LLM(core=silent).generate(prompts(1), GREEDY)
    assert silent.drain_events() == []
