"""`stepscope serve --disagg` end to end: a router, prefill and decode worker processes, KV over TCP, real
HTTP on loopback, spans exported over OTLP/HTTP to a receiver in this test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from instrumentation import attributes as A
from stepscope.otlp_receiver import OtlpReceiver
from stepscope.procs import Proc
from tests.support.net import free_port, wait_for

STEPSCOPE = str(Path(sys.executable).with_name("stepscope"))
ADMIN = {"Authorization": "Bearer disagg-test"}
LONG = " ".join(f"w{i}" for i in range(150))  # ~600 tokens: 38 blocks of 16
PROMPTS = ["Hello there", "a prompt that spans more than one block of sixteen tokens, surely", LONG]


class Serve(Proc):
    """`stepscope serve --model tiny ...` in its own process group."""

    def __init__(self, log: Path, *options: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        args = ["serve", "--model", "tiny", "--port", str(self.port), *options]
        super().__init__(args, log, {**base, **(env or {})}, program=[STEPSCOPE])
        self.wait_http(self.url + "/health", 120)

    def complete(self, prompt: str, max_tokens: int = 8, **extra) -> httpx.Response:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
        return httpx.post(self.url + "/v1/completions", json=body, timeout=120)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def workers(self, role: str) -> list[dict]:
        return [w for w in self.health()["workers"] if w["role"] == role and w["state"] == "healthy"]


def _all_blocks_free(serve: Serve) -> bool:
    workers = serve.health()["workers"]
    return all(
        w.get("kv_blocks_free") == w.get("kv_blocks_total") for w in workers if w["state"] == "healthy"
    )


def _text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory, receiver):
    """A traced disaggregated server (1 prefill + 1 decode) and a colocated one, same model and seed."""
    tmp = tmp_path_factory.mktemp("disagg")
    env = {"OTEL_BSP_SCHEDULE_DELAY": "200"}
    disagg = Serve(
        tmp / "disagg.log", "--disagg", "--num-threads", "2", "--otlp-endpoint", receiver.url, env=env
    )
    colocated = Serve(tmp / "colocated.log", "--num-threads", "1")
    yield disagg, colocated
    disagg.stop()
    colocated.stop()


def test_disaggregated_greedy_output_equals_colocated(servers):
    disagg, colocated = servers
    for prompt in PROMPTS:
        assert _text(disagg.complete(prompt, 12)) == _text(colocated.complete(prompt, 12)), prompt
    chat = {"messages": [{"role": "user", "content": "hi " * 40}], "max_tokens": 6, "temperature": 0}
    answers = [httpx.post(s.url + "/v1/chat/completions", json=chat, timeout=60).json() for s in servers]
    assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]
    one = [_text(s.complete(LONG, 1)) for s in servers]  # ends at the prefill worker: nothing to transfer
    assert one[0] == one[1]
    wait_for(lambda: _all_blocks_free(disagg))


def test_kv_bytes_received_equal_bytes_sent(servers):
    disagg, _ = servers
    assert _text(disagg.complete(LONG, 4))
    wait_for(lambda: all(w.get("reserved") == 0 for w in disagg.health()["workers"]))
    time.sleep(1)  # the next heartbeat carries the counters
    metrics = httpx.get(disagg.url + "/metrics").text
    sent = _counter(metrics, "stepscope:kv_transfer_bytes_sent_total")
    received = _counter(metrics, "stepscope:kv_transfer_bytes_received_total")
    assert sent == received > 38 * 2 * 2 * 16 * 2 * 16 * 4  # at least the long prompt's 38 blocks
    assert _counter(metrics, "stepscope:kv_transfers_sent_total") == _counter(
        metrics, "stepscope:kv_transfers_received_total"
    )


def _counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_one_trace_spans_router_prefill_and_decode_with_kv_transfer_timed(servers, receiver):
    disagg, _ = servers
    caller = "4bf92f3577b34da6a3ce929d0e0e4736"
    headers = {"traceparent": f"00-{caller}-00f067aa0ba902b7-01"}
    body = {"prompt": LONG, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    assert (
        httpx.post(disagg.url + "/v1/completions", json=body, headers=headers, timeout=60).status_code == 200
    )
    names = {"llm_request", "queue", "prefill", "kv_transfer", "decode"}

    def mine() -> list[dict]:
        return [s for s in receiver.spans if s["trace_id"] == caller and s["name"] in names]

    wait_for(lambda: len([s for s in mine() if s["name"] == "kv_transfer"]) == 2 and len(mine()) >= 6)
    spans = mine()
    roles = {(s["name"], s["resource"].get(A.RESOURCE_ROLE)) for s in spans}
    assert {("llm_request", "router"), ("queue", "prefill"), ("prefill", "prefill")} <= roles
    assert {("kv_transfer", "prefill"), ("kv_transfer", "decode"), ("decode", "decode")} <= roles
    request = next(s for s in spans if s["name"] == "llm_request")
    assert all(s["parent"] == request["span_id"] for s in spans if s is not request)
    assert len({s["resource"].get(A.RESOURCE_INSTANCE) for s in spans}) == 3
    a = request["attrs"]
    blocks = -(-a[A.GEN_AI_USAGE_INPUT_TOKENS] // 16)  # the whole prompt, its partial last block too
    for kv in (s for s in spans if s["name"] == "kv_transfer"):
        assert kv["attrs"][A.KV_TRANSFER_BYTES] > 0 and kv["attrs"][A.KV_TRANSFER_BLOCKS] == blocks
        assert kv["attrs"][A.KV_TRANSFER_BANDWIDTH] > 0
    kv_s = a[A.KV_TRANSFER_S]
    assert kv_s >= 0
    ttft = a[A.GEN_AI_LATENCY_QUEUE] + a[A.GEN_AI_LATENCY_PREFILL] + kv_s
    assert ttft == pytest.approx(a[A.GEN_AI_LATENCY_TTFT], abs=1e-6)


@pytest.fixture(scope="module")
def fragile(tmp_path_factory):
    """1 prefill + 2 decode workers, for killing some."""
    serve = Serve(
        tmp_path_factory.mktemp("fragile") / "serve.log",
        "--disagg", "--num-decode", "2", "--num-threads", "3", "--admin-token", ADMIN["Authorization"][7:],
        "--kv-transfer-timeout", "20",
    )  # fmt: skip
    yield serve
    serve.stop()


def test_a_decode_worker_killed_mid_transfer_has_its_request_retried_and_no_blocks_leak(fragile, servers):
    expected = _text(servers[1].complete(LONG, 8))
    r = httpx.post(fragile.url + "/admin/faults", json={"kv_transfer_mbps": 0.02}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["kv_transfer_mbps"] == 0.02  # 300 KB of KV: ~15 s
    result: list[httpx.Response] = []
    t = threading.Thread(target=lambda: result.append(fragile.complete(LONG, 8)))
    t.start()
    wait_for(lambda: any(w.get("reserved") for w in fragile.workers("decode")), 30)
    victim = next(w for w in fragile.workers("decode") if w.get("reserved"))
    os.kill(victim["pid"], signal.SIGKILL)
    wait_for(lambda: victim["id"] not in [w["id"] for w in fragile.workers("decode")])
    assert httpx.post(fragile.url + "/admin/faults", json={}, headers=ADMIN).status_code == 200
    t.join(60)
    assert result and _text(result[0]) == expected  # retried on the surviving decode worker
    wait_for(lambda: _all_blocks_free(fragile))
    assert "retrying" in fragile.log.read_text()


def test_a_decode_worker_killed_while_streaming_fails_its_request_clearly(fragile):
    stream_body = {
        "prompt": "tell me",
        "max_tokens": 1500,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    lines: list[str] = []
    with httpx.stream("POST", fragile.url + "/v1/completions", json=stream_body, timeout=60) as r:
        for line in r.iter_lines():
            lines.append(line)
            if len(lines) == 6:  # tokens are flowing: kill the decode worker that runs it
                wait_for(lambda: any(w.get("running") for w in fragile.workers("decode")), 10)
                victim = next(w for w in fragile.workers("decode") if w.get("running"))
                os.kill(victim["pid"], signal.SIGKILL)
    assert any("died mid-request" in line for line in lines)
    assert [line for line in lines if line][-1] == "data: [DONE]"


def test_a_restarted_worker_rejoins_and_health_reports_roles(fragile, tmp_path):
    register = fragile.health()["register"]

    def start() -> subprocess.Popen:
        cmd = [
            STEPSCOPE,
            "serve",
            "--model",
            "tiny",
            "--role",
            "decode",
            "--router",
            register,
            "--num-threads",
            "1",
        ]
        return subprocess.Popen(cmd, stdout=(tmp_path / "w.log").open("a"), stderr=subprocess.STDOUT)

    before = len(fragile.workers("decode"))
    worker = start()
    try:
        wait_for(lambda: len(fragile.workers("decode")) == before + 1)
        worker.kill()
        worker.wait()
        wait_for(lambda: len(fragile.workers("decode")) == before)
        worker = start()  # restarted: registers again
        wait_for(lambda: len(fragile.workers("decode")) == before + 1)
        assert _text(fragile.complete("after the rejoin", 4))
    finally:
        worker.kill()
        worker.wait()
    prefill = fragile.workers("prefill")[0]
    os.kill(prefill["pid"], signal.SIGKILL)
    # the router marks the killed prefill worker lost, and then /health answers 503
    wait_for(lambda: fragile.health()["healthy_workers"]["prefill"] == 0)
    assert httpx.get(fragile.url + "/health").status_code == 503
    r = fragile.complete("no prefill worker", 4)
    assert r.status_code == 503 and r.json()["error"]["message"]
