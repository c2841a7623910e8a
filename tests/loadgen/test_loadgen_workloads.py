"""Workloads: seeded and reproducible, sized in tokens, and shifted from the requested second on."""

import json

import pytest

from loadgen.workloads import LengthDist, Workload, WorkloadConfig, WorkloadShift


def _prompt_chars(spec) -> int:
    if spec.messages is not None:
        return sum(len(m["content"]) for m in spec.messages)
    return len(spec.prompt)


@pytest.mark.parametrize("name", ["chat", "summarize", "shared-prefix", "mixed"])
def test_the_same_seed_gives_the_same_requests(name):
    a = Workload.load(name, WorkloadConfig(seed=5))
    b = Workload.load(name, WorkloadConfig(seed=5))
    c = Workload.load(name, WorkloadConfig(seed=6))
    for i in (0, 1, 17):
        assert a.request(i) == b.request(i)
    assert [a.request(i).body("m") for i in range(5)] != [c.request(i).body("m") for i in range(5)]


def test_chat_prompts_are_short_and_outputs_medium_summaries_the_reverse():
    chat = [Workload.load("chat").request(i) for i in range(300)]
    summ = [Workload.load("summarize").request(i) for i in range(300)]
    cfg = WorkloadConfig()
    assert all(cfg.chat_prompt.low <= r.prompt_tokens_est <= cfg.chat_prompt.high for r in chat)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert mean([r.prompt_tokens_est for r in summ]) > 5 * mean([r.prompt_tokens_est for r in chat])
    assert mean([r.max_tokens for r in chat]) > 2 * mean([r.max_tokens for r in summ])
    assert all(r.endpoint == "/v1/chat/completions" for r in chat)
    assert all(r.endpoint == "/v1/completions" for r in summ)


def test_prompt_lengths_are_in_tokens_converted_with_chars_per_token():
    one = Workload.load("summarize", WorkloadConfig(seed=1)).request(3)
    four = Workload.load("summarize", WorkloadConfig(seed=1, chars_per_token=4.0)).request(3)
    assert one.prompt_tokens_est == four.prompt_tokens_est
    assert len(one.prompt) == one.prompt_tokens_est
    assert len(four.prompt) == 4 * four.prompt_tokens_est
    assert one.prompt.isascii()


def test_shared_prefix_requests_share_one_long_system_prompt():
    wl = Workload.load("shared-prefix")
    systems = {wl.request(i).messages[0]["content"] for i in range(20)}
    users = {wl.request(i).messages[1]["content"] for i in range(20)}
    assert len(systems) == 1 and len(next(iter(systems))) == WorkloadConfig().system_prompt_tokens
    assert len(users) == 20


def test_mixed_holds_both_kinds_in_the_configured_share():
    wl = Workload.load("mixed", WorkloadConfig(summarize_fraction=0.3))
    kinds = [wl.request(i).kind for i in range(2000)]
    assert set(kinds) == {"chat", "summarize"}
    assert kinds.count("summarize") / len(kinds) == pytest.approx(0.3, abs=0.04)


def test_prompt_length_shift_applies_from_the_requested_second_only():
    shift = WorkloadShift(start_s=30.0, prompt_len_factor=3.0)
    base = Workload.load("chat", WorkloadConfig(seed=2))
    shifted = Workload.load("chat", WorkloadConfig(seed=2, shifts=(shift,)))
    for i in range(50):
        assert shifted.request(i, at_s=29.9) == base.request(i, at_s=29.9)
        after, before = shifted.request(i, at_s=30.0), base.request(i, at_s=30.0)
        assert after.prompt_tokens_est == round(before.prompt_tokens_est * 3)
        assert _prompt_chars(after) == after.prompt_tokens_est
        assert after.max_tokens == before.max_tokens  # only the prompt changes


def test_max_prompt_tokens_clips_shifted_prompts():
    shift = WorkloadShift(start_s=0.0, prompt_len_factor=10.0)
    wl = Workload.load("summarize", WorkloadConfig(max_prompt_tokens=1500, shifts=(shift,)))
    assert max(wl.request(i).prompt_tokens_est for i in range(50)) == 1500


def test_prefix_change_hits_the_requested_fraction_from_its_second_on():
    shift = WorkloadShift(start_s=10.0, prefix_change_fraction=0.4)
    wl = Workload.load("shared-prefix", WorkloadConfig(seed=3, shifts=(shift,)))
    system = wl.system_prompt
    assert not any(wl.request(i, at_s=9.0).prefix_changed for i in range(500))
    after = [wl.request(i, at_s=10.0) for i in range(1000)]
    changed = [r for r in after if r.prefix_changed]
    assert len(changed) / len(after) == pytest.approx(0.4, abs=0.05)
    for r in changed[:20]:
        first = r.messages[0]["content"]
        assert first[:16] != system[:16] and len(first) == len(system)  # a cache miss from the first block
    assert all(r.messages[0]["content"] == system for r in after if not r.prefix_changed)


def test_rate_shifts_are_reported_for_the_arrival_process():
    shifts = (WorkloadShift(start_s=5.0, rate_factor=2.0), WorkloadShift(start_s=1.0, prompt_len_factor=2.0))
    wl = Workload.load("chat", WorkloadConfig(shifts=shifts))
    assert wl.rate_changes() == [(1.0, 1.0), (5.0, 2.0)]
    assert wl.shift_at(0.5).prompt_len_factor == 1.0
    assert wl.shift_at(3.0).prompt_len_factor == 2.0
    assert wl.shift_at(6.0).rate_factor == 2.0  # the latest shift in force; factors do not compound


def test_jsonl_replay_keeps_prompts_messages_max_tokens_and_timestamps(tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = [
        {"prompt": "hello there", "max_tokens": 7, "timestamp": 100.5},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "timestamp": 101.0},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    wl = Workload.load(str(path))
    a, b = wl.request(0), wl.request(1)
    assert (a.prompt, a.max_tokens, a.endpoint) == ("hello there", 7, "/v1/completions")
    assert (b.messages, b.max_tokens, b.endpoint) == (rows[1]["messages"], 3, "/v1/chat/completions")
    assert list(wl.replay_timestamps()) == [0.0, 0.5]
    assert wl.request(2).prompt == "hello there"  # cycles past the end


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("{not json", ":1: not JSON"),
        ('{"max_tokens": 3}', "needs a 'prompt'"),
        ('{"prompt": "a", "max_tokens": 0}', "max_tokens"),
    ],
)
def test_bad_jsonl_lines_are_named(tmp_path, text, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text(text + "\n")
    with pytest.raises(ValueError, match=needle):
        Workload.load(str(path))


def test_an_unknown_workload_name_is_refused():
    with pytest.raises(ValueError, match="neither"):
        Workload.load("nonsense")


def test_request_bodies_stream_with_usage_and_ignore_eos():
    body = Workload.load("chat").request(0).body("tiny")
    assert body["stream"] is True and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["model"] == "tiny" and body["max_tokens"] >= 1


def test_length_dist_stays_within_bounds():
    import numpy as np

    d = LengthDist(100, 1.5, 10, 300)
    rng = np.random.default_rng(0)
    xs = [d.sample(rng) for _ in range(2000)]
    assert min(xs) == 10 and max(xs) == 300
    assert 80 <= sorted(xs)[1000] <= 120  # the median holds
