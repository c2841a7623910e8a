"""End to end: a real `stepscope collector --alert-rules` receives OTLP spans with a TTFT breach; the webhook
receiver in the test gets one firing (with the breakdown and findings) and then one resolved; the CLI shows
the history. Short interval, `for` and window keep it quick; assertions are on order and counts."""

from __future__ import annotations

import json
import os
import random
import time

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from webhook_receiver import Receiver

from stepscope.cli import main
from tests.support.collector import start_collector

RULES = """
[notify]
webhook = "http://127.0.0.1:{wport}/hook"
interval = "1s"
diagnosis_timeout = "20s"

[[rule]]
name = "ttft-p99"
metric = "ttft"
percentile = 99
threshold = "2s"
window = "4s"
for = "2s"
severity = "page"
min_requests = 5
service = "e2e-alerts"
"""


def kv(key: str, value: float | int | str) -> KeyValue:
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    if isinstance(value, float):
        return KeyValue(key=key, value=AnyValue(double_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=value))


def export(http: httpx.Client, url: str, ttfts: list[float]) -> None:
    """One OTLP/HTTP protobuf request of llm_request spans ending now, queue = 80% of TTFT."""
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.append(kv("service.name", "e2e-alerts"))
    ss = rs.scope_spans.add()
    for ttft in ttfts:
        e2e = ttft + 0.5
        s = ss.spans.add()
        s.trace_id, s.span_id, s.name, s.kind = os.urandom(16), os.urandom(8), "llm_request", 2
        end = time.time_ns()
        s.start_time_unix_nano, s.end_time_unix_nano = end - int(e2e * 1e9), end
        s.attributes.extend([
            kv("gen_ai.latency.time_to_first_token", ttft), kv("gen_ai.latency.e2e", e2e),
            kv("gen_ai.latency.time_in_queue", ttft * 0.8),
            kv("gen_ai.latency.time_in_model_prefill", ttft * 0.2),
            kv("gen_ai.usage.input_tokens", 300), kv("gen_ai.usage.output_tokens", 20),
        ])  # fmt: skip
    http.post(
        f"{url}/v1/traces",
        content=req.SerializeToString(),
        headers={"Content-Type": "application/x-protobuf"},
    ).raise_for_status()


def test_breach_fires_once_with_the_diagnosis_and_resolves_after_recovery(tmp_path, capsys):
    receiver = Receiver()
    rules = tmp_path / "rules.toml"
    rules.write_text(RULES.format(wport=receiver.port))
    collector = start_collector(
        f"chdb://{tmp_path / 'db'}", tmp_path / "collector.log", "--alert-rules", str(rules), store_up=True
    )
    url = collector.url
    rng = random.Random(3)
    phases = []  # (phase, statuses received so far), to check what arrived when
    try:
        with httpx.Client(timeout=30) as http:
            for phase, seconds in (("healthy", 5.0), ("breach", 7.0), ("recovery", 40.0)):
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline:
                    low, high = (2.5, 4.0) if phase == "breach" else (0.05, 0.3)
                    export(http, url, [rng.uniform(low, high) for _ in range(4)])
                    time.sleep(0.2)
                    if phase == "recovery" and any(b["status"] == "resolved" for b in receiver.got):
                        break
                phases.append((phase, [b["status"] for b in receiver.got]))
        time.sleep(1.5)  # a late duplicate would show up here
        statuses = [b["status"] for b in receiver.got]
        assert phases[0] == ("healthy", [])
        assert statuses == ["firing", "resolved"], (tmp_path / "collector.log").read_text()[-3000:]
        firing, resolved = receiver.got
        (alert,) = firing["alerts"]
        assert alert["labels"]["alertname"] == "ttft-p99" and alert["labels"]["severity"] == "page"
        assert alert["status"] == "firing" and alert["endsAt"] == "0001-01-01T00:00:00Z"
        ann = alert["annotations"]
        assert (
            "TTFT P99" in ann["summary"] and "queue" in ann["breakdown"] and "80% of it" in ann["breakdown"]
        )
        assert ann["findings"] and isinstance(json.loads(ann["findings_json"]), list)
        assert resolved["alerts"][0]["startsAt"] == alert["startsAt"]
        assert resolved["alerts"][0]["endsAt"] > alert["startsAt"]
        log = (tmp_path / "collector.log").read_text()
        assert "ALERT FIRING ttft-p99" in log and "ALERT RESOLVED ttft-p99" in log

        assert main(["alerts", "history", "--api", url, "--json"]) == 0
        rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        transitions = [(r["previous"], r["state"]) for r in reversed(rows) if r["rule"] == "ttft-p99"]
        assert transitions[-2:] == [("pending", "firing"), ("firing", "resolved")]
        assert main(["alerts", "list", str(rules), "--api", url]) == 0
        assert capsys.readouterr().out.startswith("RESOLVED  ttft-p99: p99 ttft service=e2e-alerts > 2s")
        assert main(["alerts", "test", str(rules), "--api", url]) == 0  # one evaluation, no notification
        assert (
            "ttft-p99: p99 ttft service=e2e-alerts > 2s over 4s for 2s [page]  => " in capsys.readouterr().out
        )
        history = tmp_path / "history.jsonl"
        assert (
            main(["alerts", "run", "--rules", str(rules), "--api", url, "--once", "--history", str(history)])
            == 0
        )
        assert len(receiver.got) == 2  # the standalone evaluator starts inactive; nothing to say yet
    finally:
        collector.stop()
        receiver.close()
