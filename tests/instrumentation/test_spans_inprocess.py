"""Spans from a real EngineCore through the real SDK into an InMemorySpanExporter: the tree, the
attributes and their units, the links from steps to requests, and timings that add up."""

from __future__ import annotations

import itertools
import random

from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import SpanKind, StatusCode
from span_rig import make_rig, tiny_core

from engine.config import SamplingParams
from instrumentation import attributes as A

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
CALLER_TRACE, CALLER_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
MS = 1_000_000


def prompts(n: int, seed: int = 0, lo: int = 5, hi: int = 70) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def children(rig, parent) -> list:
    return [s for s in rig.spans() if s.parent is not None and s.parent.span_id == parent.context.span_id]


def test_each_request_has_queue_prefill_decode_children_inside_its_span(rig):
    rig.run(tiny_core(max_num_batched_tokens=32), prompts(6), GREEDY)
    reqs = rig.spans(A.SPAN_REQUEST)
    assert len(reqs) == 6
    for req in reqs:
        assert req.kind is SpanKind.SERVER
        kids = children(rig, req)
        names = [k.name for k in kids]
        assert names.count(A.SPAN_QUEUE) == 1 and names.count(A.SPAN_DECODE) == 1
        assert names.count(A.SPAN_PREFILL) >= 1
        for kid in kids:
            assert kid.context.trace_id == req.context.trace_id
            assert req.start_time <= kid.start_time <= kid.end_time <= req.end_time


def test_long_prompts_are_prefilled_in_chunks_that_add_up_to_the_prompt(rig):
    rig.run(tiny_core(max_num_batched_tokens=16, enable_prefix_caching=False), [[7] * 50], GREEDY)
    (req,) = rig.spans(A.SPAN_REQUEST)
    chunks = sorted((k for k in children(rig, req) if k.name == A.SPAN_PREFILL), key=lambda s: s.start_time)
    assert [c.attributes[A.CHUNK_INDEX] for c in chunks] == list(range(len(chunks)))
    assert len(chunks) == 4
    assert sum(c.attributes[A.CHUNK_TOKENS] for c in chunks) == 50
    assert [c.attributes[A.PREFILL_COMPUTED_BEFORE] for c in chunks] == [0, 16, 32, 48]


def test_request_attributes_are_vllm_compatible_with_seconds_as_doubles(rig):
    core = tiny_core()
    rig.run(core, [[1, 2, 3] * 20], GREEDY)
    rig.run(core, [[1, 2, 3] * 20], GREEDY)  # the second hits the prefix cache
    reqs = sorted(rig.spans(A.SPAN_REQUEST), key=lambda s: s.attributes[A.GEN_AI_REQUEST_ID])
    for req in reqs:
        a = req.attributes
        for key in (A.GEN_AI_LATENCY_TTFT, A.GEN_AI_LATENCY_E2E, A.GEN_AI_LATENCY_QUEUE, A.TPOT_MEAN_S,
                    A.GEN_AI_LATENCY_PREFILL, A.GEN_AI_LATENCY_DECODE, A.TPOT_MAX_S):  # fmt: skip
            assert isinstance(a[key], float) and a[key] >= 0, key
        assert a[A.GEN_AI_USAGE_INPUT_TOKENS] == a[A.GEN_AI_USAGE_PROMPT_TOKENS] == 60
        assert a[A.GEN_AI_USAGE_OUTPUT_TOKENS] == a[A.GEN_AI_USAGE_COMPLETION_TOKENS] == 6
        assert a[A.GEN_AI_REQUEST_MAX_TOKENS] == 6 and a[A.GEN_AI_REQUEST_TEMPERATURE] == 0.0
        assert a[A.GEN_AI_REQUEST_TOP_P] == 1.0 and a[A.GEN_AI_REQUEST_MODEL] == "tiny"
        assert tuple(a[A.GEN_AI_RESPONSE_FINISH_REASONS]) == ("length",)
        assert a[A.ITL_COUNT] == 5 and a[A.PREEMPTIONS] == 0
        assert a[A.TPOT_MAX_S] >= a[A.TPOT_MEAN_S]
        assert [e.name for e in req.events] == [A.EVENT_FIRST_TOKEN]
    assert reqs[0].attributes[A.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] == 0
    assert reqs[1].attributes[A.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] == 48  # three full blocks of 16
    assert reqs[0].attributes[A.PREFIX_KEY] == reqs[1].attributes[A.PREFIX_KEY] != ""


def test_queue_plus_prefill_is_ttft_and_decode_ends_at_the_last_token(rig):
    rig.run(tiny_core(max_num_batched_tokens=24, max_num_seqs=3), prompts(8, seed=1), GREEDY)
    for req in rig.spans(A.SPAN_REQUEST):
        a = req.attributes
        ttft = a[A.GEN_AI_LATENCY_TTFT]
        assert abs(a[A.GEN_AI_LATENCY_QUEUE] + a[A.GEN_AI_LATENCY_PREFILL] - ttft) < 1e-3
        assert 0 < ttft <= a[A.GEN_AI_LATENCY_E2E] <= (req.end_time - req.start_time) / 1e9
        kids = children(rig, req)
        (queue,) = [k for k in kids if k.name == A.SPAN_QUEUE]
        (decode,) = [k for k in kids if k.name == A.SPAN_DECODE]
        prefills = [k for k in kids if k.name == A.SPAN_PREFILL]
        first_token = req.events[0].timestamp
        # the spans, as a trace viewer draws them, say the same as the attributes
        assert queue.start_time == req.start_time
        assert abs((queue.end_time - queue.start_time) / 1e9 - a[A.GEN_AI_LATENCY_QUEUE]) < 1e-3
        prefill_s = (max(p.end_time for p in prefills) - min(p.start_time for p in prefills)) / 1e9
        assert abs((queue.end_time - queue.start_time) / 1e9 + prefill_s - ttft) < 1e-3
        assert abs(max(p.end_time for p in prefills) - first_token) < MS
        assert decode.start_time == first_token
        assert abs((decode.end_time - decode.start_time) / 1e9 - a[A.GEN_AI_LATENCY_DECODE]) < 1e-6


def test_steps_link_to_every_request_they_served_with_the_tokens_it_got(rig):
    rig.run(tiny_core(max_num_batched_tokens=32, enable_prefix_caching=False), prompts(5, seed=2), GREEDY)
    reqs = {s.context.span_id: s for s in rig.spans(A.SPAN_REQUEST)}
    steps = rig.spans(A.SPAN_STEP)
    tokens = dict.fromkeys(reqs, 0)
    for step in steps:
        assert step.parent is None  # a step belongs to no one request: it links to them
        assert sum(link.attributes[A.LINK_TOKENS] for link in step.links) == (
            step.attributes[A.STEP_PREFILL_TOKENS] + step.attributes[A.STEP_DECODE_TOKENS]
        )
        assert len(step.links) == step.attributes[A.STEP_BATCH_SIZE]
        for link in step.links:
            tokens[link.context.span_id] += link.attributes[A.LINK_TOKENS]
    for span_id, req in reqs.items():  # every token computed once: the prompt, then each output but the last
        a = req.attributes
        assert tokens[span_id] == a[A.GEN_AI_USAGE_INPUT_TOKENS] + a[A.GEN_AI_USAGE_OUTPUT_TOKENS] - 1


def test_step_spans_carry_the_batch_and_have_schedule_forward_sample_children(rig):
    core = tiny_core(max_num_seqs=4)
    rig.run(core, prompts(6, seed=3), GREEDY)
    steps = rig.spans(A.SPAN_STEP)
    assert len(steps) == core.step_id
    for step in steps:
        a = step.attributes
        assert a[A.STEP_KV_BLOCKS_USED] + a[A.STEP_KV_BLOCKS_FREE] <= a[A.STEP_KV_BLOCKS_TOTAL]
        assert a[A.STEP_WEIGHT_DTYPE] == a[A.STEP_KV_DTYPE] == "fp32"
        assert a[A.STEP_CHUNKED_PREFILL] is True and a[A.STEP_MAX_NUM_SEQS] == 4
        assert 1 <= a[A.STEP_BATCH_SIZE] <= 4 and a[A.STEP_NUM_RUNNING] <= 4
        assert isinstance(a[A.STEP_GAP_S], float) and a[A.STEP_PREEMPTIONS] == 0
        kids = sorted(children(rig, step), key=lambda s: s.start_time)
        assert [k.name for k in kids] == [A.SPAN_STEP_SCHEDULE, A.SPAN_STEP_FORWARD, A.SPAN_STEP_SAMPLE]
        assert kids[0].start_time == step.start_time and kids[-1].end_time == step.end_time
        assert all(a.end_time == b.start_time for a, b in itertools.pairwise(kids))


def test_an_incoming_traceparent_makes_llm_request_its_child(rig):
    rig.run(tiny_core(), prompts(2), GREEDY, traceparent=f"00-{CALLER_TRACE}-{CALLER_SPAN}-01")
    for req in rig.spans(A.SPAN_REQUEST):
        assert f"{req.context.trace_id:032x}" == CALLER_TRACE
        assert f"{req.parent.span_id:016x}" == CALLER_SPAN and req.parent.is_remote


def test_a_preempted_request_gets_a_second_queue_span_and_recompute_prefills(rig):
    # 7 blocks of 16 tokens for 4 requests that each grow past 60 tokens: someone must be preempted
    core = tiny_core(num_kv_blocks=7, max_num_seqs=4, enable_prefix_caching=False)
    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    rig.run(core, prompts(4, seed=4, lo=20, hi=30), long)
    preempted = [s for s in rig.spans(A.SPAN_REQUEST) if s.attributes[A.PREEMPTIONS] > 0]
    assert preempted and sum(s.attributes[A.STEP_PREEMPTIONS] for s in rig.spans(A.SPAN_STEP)) > 0
    for req in preempted:
        kids = children(rig, req)
        queues = [k for k in kids if k.name == A.SPAN_QUEUE]
        assert len(queues) == 1 + req.attributes[A.PREEMPTIONS]
        assert sum(bool(q.attributes.get(A.QUEUE_AFTER_PREEMPTION)) for q in queues) == len(queues) - 1
        assert any(k.attributes.get(A.PREFILL_RECOMPUTE) for k in kids if k.name == A.SPAN_PREFILL)


def test_step_spans_can_be_sampled_one_in_n_while_request_phases_stay_whole():
    rig = make_rig(steps_every=3)
    core = tiny_core()
    rig.run(core, prompts(3, seed=5), GREEDY)
    ids = sorted(s.attributes[A.STEP_ID] for s in rig.spans(A.SPAN_STEP))
    assert ids == [i for i in range(core.step_id) if i % 3 == 0]
    assert len(rig.spans(A.SPAN_DECODE)) == 3


def test_step_spans_off_leaves_request_spans_and_their_phases_as_vllm_emits():
    rig = make_rig(steps_every=0)
    rig.run(tiny_core(), prompts(3, seed=5), GREEDY)
    assert not rig.spans(A.SPAN_STEP)
    assert len(rig.spans(A.SPAN_REQUEST)) == len(rig.spans(A.SPAN_DECODE)) == 3
    assert rig.spans(A.SPAN_PREFILL) and rig.spans(A.SPAN_QUEUE)


def test_unsampled_fast_requests_are_dropped_but_slow_and_failed_ones_kept():
    rig = make_rig(head_sampler=ALWAYS_OFF)
    rig.run(tiny_core(), prompts(3, seed=6), GREEDY, abort={1})
    (kept,) = rig.spans(A.SPAN_REQUEST)  # only the aborted one
    assert kept.status.status_code is StatusCode.ERROR
    assert kept.attributes[A.SAMPLING_REASON] == "error"
    assert {s.parent.span_id for s in rig.spans(A.SPAN_QUEUE)} == {kept.context.span_id}
    assert not rig.spans(A.SPAN_DECODE) and rig.telemetry.processor.unsampled == 2

    slow = make_rig(head_sampler=ALWAYS_OFF, slow_request_s=0.0)  # every request counts as slow
    slow.run(tiny_core(), prompts(3, seed=6), GREEDY)
    assert {s.attributes[A.SAMPLING_REASON] for s in slow.spans(A.SPAN_REQUEST)} == {"slow"}
    assert len(slow.spans(A.SPAN_REQUEST)) == len(slow.spans(A.SPAN_DECODE)) == 3


def test_tracing_never_changes_greedy_outputs(rig):
    ps = prompts(6, seed=7)
    untraced = tiny_core(max_num_batched_tokens=32)
    untraced.record_events = False
    for i, p in enumerate(ps):
        from engine.request import EngineRequest

        untraced.add_request(EngineRequest(f"req-{i}", p, GREEDY))
    plain: dict[str, list[int]] = {}
    while untraced.has_unfinished_requests():
        for out in untraced.step():
            plain.setdefault(out.req_id, []).extend(out.new_token_ids)
    traced = rig.run(tiny_core(max_num_batched_tokens=32), ps, GREEDY)
    assert traced == [plain[f"req-{i}"] for i in range(len(ps))]
    assert untraced.drain_events() == []
