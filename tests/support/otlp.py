"""The loopback OTLP receiver the tests read spans from (in the package, where the benchmarks use it too)."""

from stepscope.otlp_receiver import OtlpReceiver, attrs, value

__all__ = ["OtlpReceiver", "attrs", "value"]
