"""Static batching as a padded generate() runs: fixed batches, prompts left-padded to the batch's longest."""

from engine.config import EngineConfig, SamplingParams
from engine.core import EngineCore
from engine.llm import LLM
from engine.request import EngineRequest

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 256 for j in range(n)] for i, n in enumerate((5, 40, 17, 33))]


def config(**kw) -> EngineConfig:
    return EngineConfig(model="tiny", num_threads=1, enable_prefix_caching=False, **kw)


def test_static_batch_pads_every_prompt_to_the_longest_in_kv():
    core = EngineCore(config(scheduling="static", max_num_seqs=4, block_size=16))
    for i, p in enumerate(PROMPTS):
        core.add_request(EngineRequest(f"r{i}", p, GREEDY))
    core.step()  # the prefill: 40 cache positions per member (3 blocks), pads included
    running = core.scheduler.running
    assert [s.num_pad_tokens for s in running] == [35, 0, 23, 7]
    assert {len(s.block_table) for s in running} == {3}
    assert [s.num_computed_tokens for s in running] == [len(p) for p in PROMPTS]
    core.check_invariants()


def test_static_outputs_report_real_unpadded_figures():
    continuous = LLM(config()).generate(PROMPTS, GREEDY)
    llm = LLM(config(scheduling="static", max_num_seqs=4))
    outs = []
    for i, p in enumerate(PROMPTS):
        llm.core.add_request(EngineRequest(f"s{i}", p, GREEDY))
    while llm.core.has_unfinished_requests():
        outs.extend(o for o in llm.core.step() if o.finished)
    by_id = {o.req_id: o for o in outs}
    assert [by_id[f"s{i}"].num_prompt_tokens for i in range(4)] == [len(p) for p in PROMPTS]
    assert all(o.num_cached_tokens == 0 for o in outs)
    static = LLM(config(scheduling="static", max_num_seqs=4)).generate(PROMPTS, GREEDY)
    assert [g.token_ids for g in static] == [g.token_ids for g in continuous]
    assert all(len(g.token_ids) == GREEDY.max_tokens for g in static)


def test_static_padding_leaks_no_blocks_and_poisons_no_prefix_cache():
    llm = LLM(EngineConfig(model="tiny", num_threads=1, scheduling="static", max_num_seqs=4))
    llm.generate(PROMPTS, GREEDY)
    llm.core.check_invariants()
    assert llm.core.kv.pool.num_used == 0
    # Only the one unpadded member (40 prompt + 5 computed output tokens) published its 2 full blocks:
    # a padded member's blocks do not hold what its token hashes name.
    assert len(llm.core.kv.pool.cached) == 2
