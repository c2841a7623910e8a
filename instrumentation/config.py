"""Telemetry settings: whether tracing is on, where it exports, how it samples. No OpenTelemetry here.

Both processes of `stepscope serve` read the same `TelemetryConfig`: the front end builds it from the
command line and the standard `OTEL_*` variables, and hands it to the core process as JSON (the core
process also inherits the environment, so the SDK's own variables apply on both sides).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

# The core process's event sink, as `start_core_process(..., event_sink=...)` takes it.
CORE_SINK = "instrumentation.core_sink:make_sink"
STEPS_EVERY_ENV = "STEPSCOPE_TRACE_STEPS_EVERY"
SLOW_REQUEST_ENV = "STEPSCOPE_TRACE_SLOW_S"


class TelemetryError(ValueError):
    """Telemetry cannot be set up as configured (e.g. gRPC asked for but not installed)."""


@dataclass(slots=True)
class TelemetryConfig:
    """Every telemetry default lives here; `stepscope serve` options are built from it."""

    endpoint: str | None = None  # base OTLP URL from --otlp-endpoint; None: the OTEL_EXPORTER_OTLP_* vars
    protocol: str = "http/protobuf"  # OTEL_EXPORTER_OTLP_PROTOCOL: http/protobuf | grpc
    steps_every: int = 1  # export one engine.step span in N; 0: none (request phase spans are never thinned)
    slow_request_s: float = 5.0  # a request slower than this keeps its spans whatever the head sampler said
    sink_buffer_bytes: int = 4 << 20  # core -> exporter socket buffer (capped by net.core.wmem_max);
    # a step's events that do not fit are dropped and counted (about 2 KB a step at batch 16)
    model: str = ""
    instance_id: str = ""  # service.instance.id; "" -> host:pid
    role: str = "colocated"  # stepscope.role: colocated | prefill | decode | router
    epoch_offset_ns: int = 0  # time.time_ns() - time.monotonic_ns(), measured once by the front end

    def __post_init__(self) -> None:
        if self.steps_every < 0:
            raise ValueError(f"steps_every must be >= 0, got {self.steps_every}")
        if self.slow_request_s < 0:
            raise ValueError("slow_request_s must be >= 0")
        if self.protocol not in ("http/protobuf", "grpc"):
            raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL {self.protocol!r}: use http/protobuf or grpc")
        if not self.epoch_offset_ns:
            self.epoch_offset_ns = epoch_offset_ns()

    def to_dict(self) -> dict[str, object]:
        """JSON-ready, for the core process's options."""
        return dataclasses.asdict(self)

    def to_epoch_ns(self, monotonic_ns: int) -> int:
        return monotonic_ns + self.epoch_offset_ns


def epoch_offset_ns() -> int:
    """One offset per process turns CLOCK_MONOTONIC (system-wide on Linux) into epoch nanoseconds."""
    return time.time_ns() - time.monotonic_ns()


def tracing_requested(cli_endpoint: str | None, env: dict[str, str] | None = None) -> bool:
    """On with `--otlp-endpoint` or an OTLP endpoint variable, unless OTEL_SDK_DISABLED=true."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(
        cli_endpoint
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def telemetry_config(
    cli_endpoint: str | None,
    *,
    model: str,
    instance_id: str = "",
    steps_every: int | None = None,
    env: dict[str, str] | None = None,
) -> TelemetryConfig | None:
    """The settings from the command line and the environment; None when tracing is off.
    Raises ValueError on a bad value."""
    env = os.environ if env is None else env
    if not tracing_requested(cli_endpoint, env):
        return None
    default = TelemetryConfig.__dataclass_fields__
    if steps_every is None:
        steps_every = int(env.get(STEPS_EVERY_ENV) or default["steps_every"].default)
    slow = float(env.get(SLOW_REQUEST_ENV) or default["slow_request_s"].default)
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    return TelemetryConfig(
        endpoint=cli_endpoint or None,
        protocol=(protocol or default["protocol"].default).strip(),
        steps_every=steps_every,
        slow_request_s=slow,
        model=model,
        instance_id=instance_id,
    )
