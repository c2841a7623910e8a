"""The parts around the spans: configuration, the GPU sampler, the core's bounded hand-off to the exporter
process, drop accounting."""

from __future__ import annotations

import dataclasses
import importlib.util
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from span_rig import make_rig, tiny_core

from engine.config import SamplingParams
from engine.events import KVTransferEvent
from engine.request import EngineRequest
from instrumentation import attributes as A
from instrumentation.config import TelemetryConfig, TelemetryError, epoch_offset_ns, telemetry_config
from instrumentation.core_sink import EventSender, decode_events, encode_events, start_exporter
from instrumentation.exporter_proc import Exporter
from instrumentation.gpu import GpuSampler
from instrumentation.providers import Telemetry, otlp_exporters


class StandInNvml:
    """stand-in (fake NVML): two GPUs on any host, driver or not. Carries the pynvml functions
    GpuSampler calls, with the units pynvml returns (percent, bytes, milliwatts, MHz, degrees C)."""

    NVML_CLOCK_SM, NVML_TEMPERATURE_GPU = 1, 0

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        self.initialised = False

    def nvmlInit(self) -> None:
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.initialised = False

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=90 - h, memory=40 + h)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(used=(10 + h) * 2**30, total=141 * 2**30)

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return 450_000

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        assert clock == self.NVML_CLOCK_SM
        return 1980

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        if h == 1:
            raise self.NVMLError("not supported")  # a counter the device lacks is left out
        return 61


class DriverlessNvml(StandInNvml):
    """stand-in (fake NVML): pynvml on a host without an NVIDIA driver, whose nvmlInit raises."""

    def nvmlInit(self) -> None:
        raise self.NVMLError("NVML Shared Library Not Found")


# These two tests are about the gRPC exporter being absent (the default install: it is the `grpc` extra);
# where it is installed the error they check cannot happen.
NO_GRPC = pytest.mark.skipif(
    importlib.util.find_spec("opentelemetry.exporter.otlp.proto.grpc") is not None,
    reason="the optional gRPC exporter is installed, so its missing-exporter error cannot be raised",
)


def test_nvml_counters_become_step_attributes_and_gauges_in_si_units():
    nvml, logs = StandInNvml(), []
    sampler = GpuSampler(nvml=nvml, log=logs.append)
    assert sampler.source == "nvml" and nvml.initialised and logs == []
    values = sampler.sample()
    gpu0 = A.GPU_PREFIX + "0."
    assert values[gpu0 + A.GPU_SM_UTILIZATION] == 0.9 and values[gpu0 + A.GPU_MEM_BW_UTILIZATION] == 0.4
    assert values[gpu0 + A.GPU_MEMORY_USED_BYTES] == 10 * 2**30
    assert values[gpu0 + A.GPU_POWER_W] == 450.0 and values[gpu0 + A.GPU_SM_CLOCK_MHZ] == 1980
    assert (
        values[gpu0 + A.GPU_TEMPERATURE_C] == 61 and A.GPU_PREFIX + "1." + A.GPU_TEMPERATURE_C not in values
    )

    rig = make_rig()
    sampler.register_gauges(rig.telemetry.meter)
    rig.steps.gpu = sampler.take_fresh
    rig.run(tiny_core(), [[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0))
    steps = sorted(rig.spans(A.SPAN_STEP), key=lambda s: s.attributes[A.STEP_ID])
    assert steps[0].attributes[gpu0 + A.GPU_SM_UTILIZATION] == 0.9  # the nearest step carries the sample
    assert all(gpu0 + A.GPU_SM_UTILIZATION not in s.attributes for s in steps[1:])  # once per sample
    points = _metric_points(rig.metrics, A.METRIC_GPU_PREFIX + A.GPU_SM_UTILIZATION)
    assert sorted((p.attributes[A.GPU_INDEX], p.value) for p in points) == [(0, 0.9), (1, 0.89)]


def test_without_nvml_it_says_so_once_and_samples_host_cpu():
    logs = []
    sampler = GpuSampler(nvml=DriverlessNvml(), log=logs.append)
    assert sampler.source == "host" and len(logs) == 1 and "NVML Shared Library Not Found" in logs[0]
    _burn_cpu()
    value = sampler.sample()[A.HOST_CPU_UTILIZATION]
    assert 0 < value <= 1 and len(logs) == 1


def test_stepscope_nvml_0_samples_the_host_cpu_even_where_a_driver_is(monkeypatch):
    monkeypatch.setenv("STEPSCOPE_NVML", "0")
    logs = []
    sampler = GpuSampler(log=logs.append)  # pynvml is never opened, driver or not
    assert sampler.source == "host" and len(logs) == 1 and "STEPSCOPE_NVML=0" in logs[0]
    sample = sampler.sample()  # the host's counters only, no GPU attribute
    assert A.HOST_CPU_UTILIZATION in sample and not any(k.startswith(A.GPU_PREFIX) for k in sample)


def test_the_hand_off_to_the_exporter_is_bounded_drops_and_counts_and_never_waits():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sender = EventSender(ours, buffer_bytes=16384)
    step = _events_of_a_run()[3]
    for _ in range(200):  # nobody reads: the buffer fills, later steps are dropped, nothing blocks
        sender(step)
    assert sender.dropped > 0 and sender.sent > 0 and sender.sent + sender.dropped == 200 * len(step)
    received = []
    while True:
        try:
            received.append(decode_events(theirs.recv(1 << 20, socket.MSG_DONTWAIT)))
        except BlockingIOError:
            break
    assert sum(len(events) for _, events in received) == sender.sent
    sender.close()  # the final count travels, then EOF
    assert decode_events(theirs.recv(1 << 20)) == (sender.dropped, []) and theirs.recv(1 << 20) == b""


def test_events_cross_the_hand_off_unchanged():
    steps = _events_of_a_run()
    transfer = KVTransferEvent("send", "r1", 10, 20, "00-" + "1" * 32 + "-" + "2" * 16 + "-01", 4096, 2, 1e9)
    for events in steps:
        assert decode_events(encode_events(events, dropped=7)) == (7, events)
    _, (received,) = decode_events(encode_events([transfer]))  # as attributes: its module is not imported
    assert vars(received) == dataclasses.asdict(transfer)


def test_spans_built_from_handed_off_events_are_the_in_process_ones():
    steps = _events_of_a_run()
    offset = epoch_offset_ns()  # as the front end hands it to the core
    direct, handed = make_rig(epoch_offset_ns=offset), make_rig(epoch_offset_ns=offset)
    for events in steps:
        direct.steps.consume(events)
        handed.steps.consume(decode_events(encode_events(events))[1])
    assert _span_shapes(handed.spans()) == _span_shapes(direct.spans())
    assert {s.name for s in direct.spans()} >= {A.SPAN_STEP, A.SPAN_QUEUE, A.SPAN_PREFILL, A.SPAN_DECODE}


def test_a_failing_span_builder_stops_tracing_not_the_core(capsys):
    exporter = Exporter(make_rig().telemetry)

    def broken(events):
        raise RuntimeError("bug in span building")

    exporter.tracer.consume = broken
    step = _events_of_a_run()[0]
    exporter.handle(encode_events(step))
    exporter.handle(encode_events(step))  # still accepted; nothing raises
    assert exporter.failed and capsys.readouterr().err.count("tracing stops") == 1


def test_events_the_core_dropped_are_reported_in_the_dropped_metric():
    exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    telemetry = Telemetry(TelemetryConfig(model="tiny"), exporter, [reader], process="core", batch=False)
    Exporter(telemetry).handle(encode_events([], dropped=4))
    points = {p.attributes[A.DROPPED_KIND]: p.value for p in _metric_points(reader, A.METRIC_DROPPED)}
    assert points == {"spans": 0, "events": 4}


@NO_GRPC
def test_an_exporter_that_cannot_start_fails_the_sink_with_its_reason():
    with pytest.raises(TelemetryError, match=r"stepscope\[grpc\]"):
        start_exporter(TelemetryConfig(protocol="grpc", endpoint="http://127.0.0.1:9"))


def test_spans_to_an_unreachable_endpoint_are_counted_as_dropped(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    config = TelemetryConfig(endpoint="http://127.0.0.1:9", model="tiny")  # port 9: discard, closed
    telemetry = Telemetry.open(config, process="core")
    tracer = telemetry.tracer("test")
    for _ in range(50):
        tracer.start_span("x").end()
    telemetry.shutdown(timeout_s=10)
    assert telemetry.dropped_spans == 50


def test_tracing_is_on_with_an_endpoint_and_off_without_or_when_disabled():
    assert telemetry_config(None, model="m", env={}) is None
    assert telemetry_config("http://x:4318", model="m", env={"OTEL_SDK_DISABLED": "true"}) is None
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "STEPSCOPE_TRACE_STEPS_EVERY": "4"}
    config = telemetry_config(None, model="m", env=env)
    assert config.endpoint is None and config.steps_every == 4 and config.protocol == "http/protobuf"
    assert telemetry_config("http://x", model="m", steps_every=2, env=env).steps_every == 2
    with pytest.raises(ValueError, match="steps_every"):
        telemetry_config("http://x", model="m", steps_every=-1, env={})


@NO_GRPC
def test_grpc_without_its_exporter_is_a_clear_error():
    with pytest.raises(TelemetryError, match=r"stepscope\[grpc\]"):
        otlp_exporters(TelemetryConfig(protocol="grpc"))


def test_the_core_process_imports_no_opentelemetry_when_tracing_is_off():
    code = (
        "import sys, engine.core, engine.core_proc, engine.serve_cli\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_core_process_imports_no_opentelemetry_when_tracing_is_on():
    code = (  # its sink only encodes events; spans are built in the exporter process
        "import sys, engine.core, engine.core_proc, instrumentation.core_sink\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _metric_points(reader: InMemoryMetricReader, name: str) -> list:
    data = reader.get_metrics_data()
    return [
        p
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == name
        for p in m.data.data_points
    ]


def _events_of_a_run() -> list[list]:
    """Each step's drained events of a small traced run (prefill chunks, decode, a finish)."""
    core = tiny_core(max_num_batched_tokens=32, enable_chunked_prefill=True)
    sampling = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for i, n in enumerate((40, 5, 9)):
        trace = f"00-{i + 1:032x}-{i + 1:016x}-01"
        core.add_request(EngineRequest(f"r{i}", list(range(1, n + 1)), sampling, trace_context=trace))
    steps = []
    while core.has_unfinished_requests():
        core.step()
        steps.append(core.drain_events())
    return steps


def _span_shapes(spans) -> list[tuple]:
    """Spans without their random ids: names, times, attributes, the parent's name or remote id, links."""
    by_id = {s.context.span_id: s.name for s in spans}
    return sorted(
        (
            s.name,
            s.start_time,
            s.end_time,
            tuple(sorted(s.attributes.items())),
            by_id.get(s.parent.span_id, s.parent.span_id) if s.parent else None,
            tuple((ln.context.span_id, tuple(sorted(ln.attributes.items()))) for ln in s.links),
        )
        for s in spans
    )


def _burn_cpu() -> None:
    x = 0
    for i in range(2_000_000):
        x += i * i


def test_the_front_ends_prefix_key_is_the_cores_first_block_hash():
    from engine.block_manager import hash_block
    from instrumentation.request_spans import prefix_key

    prompt = list(range(40))
    assert prefix_key(prompt, 16) == hash_block(b"", prompt[:16]).hex()
    assert prefix_key(prompt, 16, "tenant-a") == hash_block(b"", prompt[:16], "tenant-a").hex()
    assert prefix_key(prompt[:15], 16) == ""
