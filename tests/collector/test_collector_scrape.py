"""The collector scrapes engines' Prometheus pages (vLLM, SGLang, stepscope's own) into engine_samples.

Pages are recorded exposition text (tests/data/scrape) served over real HTTP on loopback; the collector
is a real process on a real chDB store."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2 as M

from collector.scrape import ScrapeError, parse_exposition
from stepscope.procs import free_port

DATA = Path(__file__).resolve().parents[1] / "data" / "scrape"


def page(name: str) -> str:
    return (DATA / name).read_text()


def by_metric(samples: list) -> dict[str, list]:
    out: dict[str, list] = {}
    for metric, value, labels, source in samples:
        out.setdefault(metric, []).append((value, labels, source))
    return out


# --- the parser on recorded pages --------------------------------------------------------------------
def test_vllm_page_maps_to_stepscope_names_with_labels_and_without_created_series() -> None:
    got = by_metric(parse_exposition(page("vllm_v1.txt")))
    assert got["num_running"] == [
        (12.0, {"engine": "0", "model_name": "Qwen/Qwen3-0.6B"}, "vllm:num_requests_running")
    ]
    assert got["kv_usage"][0][0] == 0.875
    assert got["preemptions_total"][0][0] == 7.0
    assert got["prefix_hits_total"][0][0] / got["prefix_queries_total"][0][0] == pytest.approx(0.7)
    reasons = {labels["finished_reason"]: v for v, labels, _ in got["requests_finished_total"]}
    assert reasons == {"stop": 90.0, "length": 10.0, "abort": 2.0}
    # vllm:iteration_tokens_total is a histogram whose name ends in _total
    assert got["iteration_tokens_count"][0][0] == 450.0
    assert {labels["le"] for _, labels, _ in got["iteration_tokens_bucket"]} >= {"16.0", "+Inf"}
    config = got["cache_config"][0][1]
    assert (config["block_size"], config["num_gpu_blocks"], config["enable_prefix_caching"]) == (
        "16",
        "27306",
        "True",
    )
    assert not any(source.endswith("_created") for rows in got.values() for _, _, source in rows)
    assert "python_gc_objects_collected" not in str(got)  # unmapped families are not stored


def test_deprecated_vllm_names_map_to_the_same_stepscope_names() -> None:
    got = by_metric(parse_exposition(page("vllm_v0_deprecated.txt")))
    assert got["kv_usage"] == [(0.25, {"model_name": "meta-llama/Llama-3.1-8B"}, "vllm:gpu_cache_usage_perc")]
    assert got["prefix_queries_total"][0][2] == "vllm:gpu_prefix_cache_queries_total"
    assert got["itl_s_count"][0][2] == "vllm:time_per_output_token_seconds_count"


def test_sglang_page_maps_running_queue_usage_hit_rate_and_latency_histograms() -> None:
    got = by_metric(parse_exposition(page("sglang.txt")))
    assert got["num_running"][0][0] == 162.0 and got["num_waiting"][0][0] == 2826.0
    assert got["kv_usage"][0][0] == 0.28 and got["prefix_hit_rate"][0][0] == pytest.approx(0.4921)
    assert got["gen_throughput"][0][0] == pytest.approx(86.508)
    assert got["num_running"][0][1]["tp_rank"] == "0"
    for h in ("ttft_s", "itl_s", "e2e_s", "queue_s"):
        assert got[f"{h}_count"][0][0] > 0 and len(got[f"{h}_bucket"]) > 5


@pytest.mark.parametrize(
    "text",
    [
        "<html><body>502 Bad Gateway</body></html>",
        "hello world",
        'vllm:num_requests_running{model_name="x} 1',
    ],
)
def test_garbage_is_refused_with_the_parsers_message(text: str) -> None:
    with pytest.raises(ScrapeError, match="not Prometheus text exposition"):
        parse_exposition(text)


# --- a real collector scraping real HTTP targets ------------------------------------------------------
class Target:
    """A /metrics page on loopback whose answer a test can change, stop and start again."""

    def __init__(self, text: str, token: str | None = None) -> None:
        self.text, self.status, self.token = text, 200, token
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self._server: http.server.ThreadingHTTPServer | None = None
        self.start()

    def start(self) -> None:
        target = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if target.token and self.headers.get("Authorization") != f"Bearer {target.token}":
                    status, body = 401, b"no"
                else:
                    status, body = target.status, target.text.encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


@pytest.fixture
def targets() -> Iterator[list[Target]]:
    made: list[Target] = []
    yield made
    for t in made:
        t.stop()


def wait_for(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("condition not reached in time")


def target_health(collector, url: str) -> dict:
    return next(t for t in collector.health()["scrape"]["targets"] if t["url"] == url)


def test_scraped_samples_land_in_engine_samples_and_intervals(start_collector, targets) -> None:
    vllm, sglang = Target(page("vllm_v1.txt")), Target(page("sglang.txt"))
    targets += [vllm, sglang]
    c = start_collector("--scrape", f"{vllm.url},{sglang.url}", "--scrape-interval", "200ms")
    c.wait_count("SELECT count() FROM engine_intervals WHERE seconds > 0", 4)
    rows = c.sql(
        "SELECT instance, any(num_running), any(kv_usage), any(block_size), any(prefix_caching) "
        "FROM engine_intervals GROUP BY instance ORDER BY instance"
    ).json()["rows"]
    by_instance = {r[0]: r[1:] for r in rows}
    assert by_instance[f"127.0.0.1:{vllm.port}"] == [12.0, 0.875, 16, 1]
    assert by_instance[f"127.0.0.1:{sglang.port}"][:2] == [162.0, 0.28]
    # a counter that did not move between scrapes increased by nothing
    assert c.scalar("SELECT max(preemptions) FROM engine_intervals WHERE seconds > 0") == 0
    health = target_health(c, vllm.url)
    assert health["up"] is True and health["samples"] == 135 and health["last_error"] == ""


def test_a_target_that_goes_down_and_comes_back_is_retried_and_others_keep_going(
    start_collector,
    targets,
) -> None:
    flaky, steady = Target(page("vllm_v1.txt")), Target(page("sglang.txt"))
    targets += [flaky, steady]
    c = start_collector("--scrape", f"{flaky.url},{steady.url}", "--scrape-interval", "200ms")
    wait_for(lambda: target_health(c, flaky.url)["up"])
    flaky.stop()
    wait_for(lambda: not target_health(c, flaky.url)["up"])
    down = target_health(c, flaky.url)
    assert down["last_error"] and down["consecutive_failures"] >= 1
    wait_for(lambda: target_health(c, flaky.url)["consecutive_failures"] >= 3)
    assert target_health(c, flaky.url)["next_delay_s"] > 0.2  # backing off
    scrapes = target_health(c, steady.url)["scrapes"]
    wait_for(lambda: target_health(c, steady.url)["scrapes"] > scrapes + 2)
    assert target_health(c, steady.url)["up"]
    flaky.start()
    wait_for(lambda: target_health(c, flaky.url)["up"])
    # the outage is a query too: `up` rows with the error, per instance
    where = f"metric = 'up' AND value = 0 AND instance = '127.0.0.1:{flaky.port}'"
    c.wait_count(f"SELECT count() FROM engine_samples WHERE {where}", 1)
    errors = c.sql(f"SELECT DISTINCT labels['error'] FROM engine_samples WHERE {where}").json()["rows"]
    assert any("Connection" in row[0] for row in errors)


def test_garbage_keeps_the_collector_up_and_the_error_visible(start_collector, targets) -> None:
    bad = Target("<html><body>502 Bad Gateway</body></html>")
    targets.append(bad)
    c = start_collector("--scrape", bad.url, "--scrape-interval", "200ms")
    wait_for(lambda: target_health(c, bad.url)["failures"] >= 1)
    assert "not Prometheus text exposition" in target_health(c, bad.url)["last_error"]
    bad.status = 503
    wait_for(lambda: "HTTP 503" in target_health(c, bad.url)["last_error"])
    assert httpx.get(f"{c.url}/health", timeout=10).status_code == 200
    bad.status, bad.text = 200, page("vllm_v0_deprecated.txt")
    wait_for(lambda: target_health(c, bad.url)["up"])


def test_config_file_targets_carry_instance_service_and_bearer_token(
    start_collector, targets, tmp_path
) -> None:
    locked = Target(page("vllm_v1.txt"), token="s3cret")
    targets.append(locked)
    config = tmp_path / "collector.toml"
    config.write_text(
        f'scrape_interval = "200ms"\n\n[[scrape]]\nurl = "{locked.url}"\ninstance = "vllm-0"\n'
        'service = "vllm"\nbearer_token = "s3cret"\n'
    )
    c = start_collector("--config", str(config))
    c.wait_count("SELECT count() FROM engine_samples WHERE metric = 'num_running'", 1)
    assert c.sql("SELECT DISTINCT service, instance FROM engine_samples").json()["rows"] == [
        ["vllm", "vllm-0"]
    ]


def test_a_bad_scrape_config_is_a_usage_error(tmp_path) -> None:
    import subprocess

    config = tmp_path / "bad.toml"
    config.write_text('[[scrape]]\nurl = "http://127.0.0.1:1/metrics"\ncolour = "blue"\n')
    for args in (
        ["--config", str(config)],
        ["--scrape", "ftp://x/metrics"],
        ["--scrape", "http://a/m", "--scrape-interval", "fast"],
    ):
        done = subprocess.run(
            ["stepscope", "collector", "--store", f"chdb://{tmp_path / 'd'}", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def test_otlp_metrics_with_engine_names_land_in_engine_samples(start_collector) -> None:
    """As an OpenTelemetry Collector's Prometheus receiver sends a scraped vLLM page."""
    c = start_collector()
    now = time.time_ns()

    def attrs(**kv: str) -> list[KeyValue]:
        return [KeyValue(key=k, value=AnyValue(string_value=v)) for k, v in kv.items()]

    gauge = M.Metric(
        name="vllm:num_requests_running",
        gauge=M.Gauge(
            data_points=[
                M.NumberDataPoint(
                    time_unix_nano=now, as_double=9, attributes=attrs(model_name="m", engine="0")
                )
            ]
        ),
    )
    counter = M.Metric(
        name="vllm:num_preemptions_total",
        sum=M.Sum(
            aggregation_temporality=M.AGGREGATION_TEMPORALITY_CUMULATIVE,
            is_monotonic=True,
            data_points=[
                M.NumberDataPoint(time_unix_nano=now, as_double=4, attributes=attrs(model_name="m"))
            ],
        ),
    )
    hist = M.Metric(
        name="vllm:time_to_first_token_seconds",
        histogram=M.Histogram(
            aggregation_temporality=M.AGGREGATION_TEMPORALITY_CUMULATIVE,
            data_points=[
                M.HistogramDataPoint(
                    time_unix_nano=now,
                    count=10,
                    sum=1.5,
                    explicit_bounds=[0.1, 0.5],
                    bucket_counts=[6, 3, 1],
                    attributes=attrs(model_name="m"),
                )
            ],
        ),
    )
    other = M.Metric(
        name="http_requests_total",
        gauge=M.Gauge(data_points=[M.NumberDataPoint(time_unix_nano=now, as_double=1)]),
    )
    resource = M.ResourceMetrics(
        resource={"attributes": attrs(**{"service.name": "vllm", "service.instance.id": "10.0.0.7:8000"})},
        scope_metrics=[M.ScopeMetrics(metrics=[gauge, counter, hist, other])],
    )
    body = ExportMetricsServiceRequest(resource_metrics=[resource]).SerializeToString()
    r = httpx.post(f"{c.url}/v1/metrics", content=body, headers={"Content-Type": "application/x-protobuf"})
    assert r.status_code == 200, r.text
    c.wait_count("SELECT count() FROM engine_samples WHERE origin = 'otlp'", 7)
    rows = c.sql(
        "SELECT metric, labels['le'], value FROM engine_samples WHERE origin = 'otlp' AND service = 'vllm' "
        "AND instance = '10.0.0.7:8000' ORDER BY metric, value"
    ).json()["rows"]
    assert rows == [
        ["num_running", "", 9.0],
        ["preemptions_total", "", 4.0],
        ["ttft_s_bucket", "0.1", 6.0],
        ["ttft_s_bucket", "0.5", 9.0],
        ["ttft_s_bucket", "+Inf", 10.0],
        ["ttft_s_count", "", 10.0],
        ["ttft_s_sum", "", 1.5],
    ]
