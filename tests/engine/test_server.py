"""`stepscope serve` end to end: real processes, real HTTP on loopback, the official openai client."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from engine.channel import Channel
from engine.config import EngineConfig, SamplingParams
from engine.core import EngineCore
from engine.core_proc import CoreLoop
from engine.events import StepEvent
from engine.protocol import Add, Outputs, Shutdown, get_codec
from engine.request import EngineRequest
from stepscope.procs import Proc
from tests.support.net import free_port

ADMIN_TOKEN = "test-admin-token"
# The installed console script, as users run it (`python -m stepscope.cli` would load cli.py twice).
STEPSCOPE = str(Path(sys.executable).with_name("stepscope"))


class Server(Proc):
    """A `stepscope serve` subprocess in its own process group."""

    def __init__(self, log: Path, *options: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k != "STEPSCOPE_ADMIN_TOKEN"}
        args = ["serve", "--model", "tiny", "--port", str(self.port), "--num-threads", "1", *options]
        super().__init__(args, log, env, program=[STEPSCOPE])

    def wait_healthy(self, timeout_s: float = 120) -> None:
        self.wait_http(self.url + "/health", timeout_s)

    def core_pid(self) -> int:
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        return int(children[0])

    def metrics(self) -> dict[str, float]:
        return parse_prometheus(httpx.get(self.url + "/metrics").text)

    def wait_idle(self, timeout_s: float = 30) -> dict[str, float]:
        """Poll /metrics until nothing runs and no KV block is held (aborts land a step later)."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            idle = m['vllm:num_requests_running{model_name="tiny"}'] == 0
            if idle and m['stepscope:kv_blocks_used{model_name="tiny"}'] == 0:
                return m
            if time.monotonic() > deadline:
                pytest.fail(f"server did not become idle: {m}")
            time.sleep(0.1)


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_]\w*="(?:[^"\\]|\\.)*",?)*\})? (\S+)$')


def parse_prometheus(text: str) -> dict[str, float]:
    """Samples of a Prometheus text exposition, keyed `name{labels}`; fails on a malformed line."""
    samples, typed = {}, set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram"), line
            typed.add(name)
        elif line and not line.startswith("#"):
            m = _SAMPLE.match(line)
            assert m, f"not a Prometheus sample: {line!r}"
            base = re.sub(r"_(bucket|sum|count)$", "", m[1])
            assert m[1] in typed or base in typed, f"sample without # TYPE: {line!r}"
            samples[m[1] + (m[2] or "")] = float(m[3])
    return samples


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve") / "serve.log", "--admin-token", ADMIN_TOKEN)
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    """One running sequence, one waiting slot, no admin token."""
    s = Server(tmp_path_factory.mktemp("serve") / "small.log", "--max-waiting", "1", "--max-num-seqs", "1")
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


# -- the OpenAI API ------------------------------------------------------------------------------
def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion_returns_text_and_usage(client):
    r = client.completions.create(
        model="tiny", prompt="The capital of France is", max_tokens=6, temperature=0
    )
    assert r.object == "text_completion" and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len("The capital of France is") + 1  # bytes + BOS
    assert 1 <= r.usage.completion_tokens <= 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_completion_returns_an_assistant_message(client):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=5, temperature=0
    )
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)
    assert r.usage.completion_tokens <= 5


def test_prompt_may_be_token_ids(client):
    by_text = client.completions.create(model="tiny", prompt="abc", max_tokens=5, temperature=0)
    by_ids = client.completions.create(model="tiny", prompt=[256, 97, 98, 99], max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_greedy_is_deterministic_and_unchanged_by_batching(client):
    prompts = [f"request number {i} says" for i in range(8)]

    def complete(p: str) -> str:
        return client.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0).choices[0].text

    alone = [complete(p) for p in prompts[:3]]
    with cf.ThreadPoolExecutor(8) as ex:
        together = list(ex.map(complete, prompts))
    assert together[:3] == alone
    assert complete(prompts[0]) == alone[0]


def test_stream_completion_chunks_join_to_the_same_text_and_end_with_usage(client):
    kw = dict(
        model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_stream_chat_starts_with_the_role_and_ends_with_usage(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "count"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_stop_string_trims_the_text_and_finishes_with_stop(client):
    kw = dict(model="tiny", prompt="Stop here:", temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(max_tokens=40, **kw).choices[0].text
    stop = full[6:8]
    expected = full[: full.index(stop)]
    r = client.completions.create(max_tokens=40, stop=[stop, "\x00never"], **kw)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    streamed = list(client.completions.create(max_tokens=40, stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == expected


# -- bad input -----------------------------------------------------------------------------------
def _post(server, path: str, content: bytes | str, headers: dict | None = None) -> httpx.Response:
    return httpx.post(server.url + path, content=content, headers=headers or {}, timeout=30)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": "x"}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 1.5}, "max_tokens"),
        ({"prompt": "x" * 5000, "max_tokens": 4}, "prompt"),
        ({"prompt": "hi", "max_tokens": 2048}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [256, 10**6]}, "prompt"),
        ({"max_tokens": 4}, "prompt"),
        ({"prompt": "hi", "n": 2}, "n"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "stop": 3}, "stop"),
        ({"prompt": "hi", "stream": "yes"}, "stream"),
    ],
)
def test_bad_completion_requests_get_400_in_openai_shape(server, body, param):
    r = _post(server, "/v1/completions", json.dumps(body))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert set(err) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": [{"role": "wizard", "content": "x"}]},
        {"messages": [{"role": "user", "content": 3}]},
    ],
)
def test_bad_chat_requests_get_400(server, body):
    r = _post(server, "/v1/chat/completions", json.dumps(body))
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")


def test_malformed_json_gets_400_not_422(server):
    for content in (b'{"prompt": "hi",', b"[1, 2]", b"\xff\xfe"):
        r = _post(server, "/v1/completions", content, {"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_openai_client_sees_bad_request_errors(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="n=1"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=2)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    assert e.value.body["code"] == "model_not_found"


def test_a_body_over_the_size_limit_gets_413(server):
    r = _post(server, "/v1/completions", b'{"prompt": "' + b"x" * (9 * 2**20) + b'"}')
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]


# -- disconnects, limits, metrics ----------------------------------------------------------------
def test_client_disconnect_mid_stream_aborts_the_request(server):
    before = server.metrics().get('vllm:request_success_total{model_name="tiny",finished_reason="abort"}', 0)
    body = {"prompt": "tell me everything", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it is generating
    m = server.wait_idle()
    assert m['vllm:request_success_total{model_name="tiny",finished_reason="abort"}'] == before + 1


def test_client_disconnect_without_streaming_aborts_the_request(server):
    body = {"prompt": "tell me everything", "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    server.wait_idle()


def test_metrics_are_prometheus_text_with_vllm_names(server, client):
    before = server.metrics()
    client.completions.create(
        model="tiny", prompt="metrics", max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    m = server.metrics()
    lbl = '{model_name="tiny"}'
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "stepscope:kv_blocks_used",
    ):
        assert name + lbl in m
    for hist in (
        "time_to_first_token",
        "inter_token_latency",
        "e2e_request_latency",
        "request_queue_time",
        "request_prefill_time",
        "request_decode_time",
    ):
        name = f"vllm:{hist}_seconds"
        assert m[name + "_count" + lbl] >= before.get(name + "_count" + lbl, 0) + 1
        assert m[name + '_bucket{model_name="tiny",le="+Inf"}'] == m[name + "_count" + lbl]
    assert m["vllm:generation_tokens_total" + lbl] == before["vllm:generation_tokens_total" + lbl] + 3

    # the phases of one request add up to no more than its end-to-end latency
    def grew(name: str) -> float:
        return m[name + lbl] - before.get(name + lbl, 0)

    phases = sum(grew(f"vllm:request_{p}_time_seconds_sum") for p in ("queue", "prefill", "decode"))
    assert 0 < phases <= grew("vllm:e2e_request_latency_seconds_sum")
    assert m["vllm:prompt_tokens_total" + lbl] > before["vllm:prompt_tokens_total" + lbl]
    # every engine step counted with the tokens it scheduled: a prefill (less any cached prefix), then one
    # token per decode step for the two tokens after the first
    steps = "vllm:iteration_tokens_total"
    assert grew(steps + "_count") >= 3
    assert 3 <= grew(steps + "_sum") <= grew("vllm:prompt_tokens_total") + 2
    assert (
        m[steps + '_bucket{model_name="tiny",le="1"}']
        - before.get(steps + '_bucket{model_name="tiny",le="1"}', 0)
        >= 2
    )
    assert any(
        k.startswith('vllm:request_success_total{model_name="tiny",finished_reason="length"') for k in m
    )


def test_admin_limits_need_the_token_and_change_the_core(server):
    url = server.url + "/admin/limits"
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
    old = httpx.get(url, headers=auth).json()
    assert set(old) == {"num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill"}
    try:
        r = httpx.post(url, headers=auth, json={"max_num_seqs": 3})
        assert r.status_code == 200 and r.json()["max_num_seqs"] == 3
        assert httpx.get(url, headers=auth).json()["max_num_seqs"] == 3
        # /metrics serves the configuration a scraper reads (stepscope:max_num_seqs, vLLM's cache info)
        m = server.metrics()
        assert m['stepscope:max_num_seqs{model_name="tiny"}'] == 3
        info = next(k for k in m if k.startswith("vllm:cache_config_info{"))
        assert 'block_size="16"' in info and 'enable_prefix_caching="True"' in info
        assert f'num_gpu_blocks="{old["num_kv_blocks"]}"' in info
        for bad in (
            {"max_num_seqs": 0},
            {"max_num_seqs": "4"},
            {"block_size": 8},
            {"enable_chunked_prefill": 1},
        ):
            r = httpx.post(url, headers=auth, json=bad)
            assert r.status_code == 400 and r.json()["error"]["message"], bad
        assert httpx.get(url, headers=auth).json()["max_num_seqs"] == 3  # refused changes change nothing
    finally:
        httpx.post(url, headers=auth, json={"max_num_seqs": old["max_num_seqs"]})


def test_admin_api_is_disabled_without_a_token(small_server):
    r = httpx.get(small_server.url + "/admin/limits", headers={"Authorization": "Bearer anything"})
    assert r.status_code == 403 and "admin API disabled" in r.json()["error"]["message"]


def test_full_waiting_queue_answers_429_and_recovers(small_server):
    def post(i: int) -> httpx.Response:  # half of them streaming: both paths count as in flight at once
        body = {"prompt": "queue", "max_tokens": 64, "ignore_eos": True, "stream": i % 2 == 1}
        return httpx.post(small_server.url + "/v1/completions", json=body, timeout=60)

    with cf.ThreadPoolExecutor(12) as ex:
        responses = list(ex.map(post, range(12)))
    codes = [r.status_code for r in responses]
    assert 200 in codes and 429 in codes and set(codes) <= {200, 429}
    rejected = next(r for r in responses if r.status_code == 429)
    assert rejected.json()["error"]["type"] == "rate_limit_error"
    small_server.wait_idle()
    assert post(0).status_code == 200


# -- the process -----------------------------------------------------------------------------------
def test_sigterm_stops_the_front_end_and_the_core(small_server):
    core = small_server.core_pid()
    os.killpg(small_server.proc.pid, signal.SIGTERM)
    time.sleep(0.05)
    os.killpg(small_server.proc.pid, signal.SIGTERM)  # a second stop while the first unwinds changes nothing
    assert small_server.proc.wait(30) == 0
    assert "Traceback" not in small_server.log.read_text()
    deadline = time.monotonic() + 30
    while Path(f"/proc/{core}").exists() and "Z" not in _proc_state(core) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{core}").exists() or "Z" in _proc_state(core)


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return "Z"


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--max-num-seqs", "x"], "--max-num-seqs: expected an integer"),
        (["--model", "no-such-model"], "neither a preset"),
        (["--scheduling", "fast"], "expected one of continuous, static"),
        (["--block-size", "3"], "power of two"),
        (["--port", "http"], "--port"),
    ],
)
def test_bad_options_are_one_line_usage_errors(option, message):
    r = subprocess.run([STEPSCOPE, "serve", *option], capture_output=True, text=True)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_core_that_fails_to_start_is_reported(tmp_path):
    cmd = [STEPSCOPE, "serve", "--dtype", "int3", "--port", str(free_port())]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "the engine core failed to start" in r.stderr and "int3" in r.stderr


# -- the core loop, in process -------------------------------------------------------------------
def test_core_loop_hands_events_to_the_sink_once_per_step_and_survives_a_broken_one():
    def run(sink) -> list[Outputs]:
        core = EngineCore(EngineConfig(model="tiny", num_threads=1, num_kv_blocks=64), record_events=True)
        ours, theirs = socket.socketpair()
        loop = threading.Thread(target=CoreLoop(core, Channel(theirs, get_codec()), sink).run)
        loop.start()
        front = Channel(ours, get_codec())
        front.send(Add(EngineRequest("r1", [256, 1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))))
        frames: list[Outputs] = []
        while not any(o.finished for f in frames for o in f.outputs):
            frames += [m for m in front.receive(block=True) if isinstance(m, Outputs)]
        front.send(Shutdown())
        loop.join(30)
        ours.close()
        theirs.close()
        assert not loop.is_alive()
        assert not core.drain_events()  # drained every step: nothing piles up
        return frames

    batches: list[list] = []
    frames = run(batches.append)
    steps = [e for b in batches for e in b if isinstance(e, StepEvent)]
    assert len(steps) == len(frames) == 4  # one prefill step that samples, three decode steps

    def broken(events):
        raise RuntimeError("observer bug")

    frames = run(broken)
    assert sum(len(o.new_token_ids) for f in frames for o in f.outputs) == 4


# -- stop strings, pure --------------------------------------------------------------------------
def test_stop_strings_cut_at_the_first_match_even_across_pieces():
    from engine.openai_protocol import StopStrings

    s = StopStrings(["END", "!!"])
    sent = [s.push(piece) for piece in ("hello E", "N", "D world")]
    assert "".join(sent) == "hello " and s.stopped
    assert sent[0] == "hello"  # the tail " E" could begin "END" (or "!!"): held back


def test_stop_strings_release_the_held_tail_at_the_end():
    from engine.openai_protocol import StopStrings

    s = StopStrings(["END"])
    assert s.push("the E") == "the" and s.push("N") == " " and not s.stopped
    assert s.flush() == "EN"
