"""GPU counters from NVML (nvidia-ml-py), sampled on a thread; host CPU utilization where NVML is absent.

Per GPU: SM utilization, memory-bandwidth utilization, memory used/total, power, SM clock and
temperature. The latest sample is exported as observable gauges and attached, once per sample, to
the next `engine.step` span (`stepscope.gpu.<i>.<name>`, or `stepscope.host.cpu_utilization`).
A counter the device does not support is left out; NVML failing mid-run stops sampling, quietly.
`STEPSCOPE_NVML=0` in the environment turns NVML off: the host CPU is sampled, as without a driver.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from instrumentation import attributes as A

NVML_ENV = "STEPSCOPE_NVML"  # "0": never open NVML, sample the host CPU


def _nvml_reader(nvml: Any) -> Callable[[], dict[str, float]]:
    """Initialise NVML and return a function reading every GPU's counters (raises if NVML is absent)."""
    nvml.nvmlInit()
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    if not handles:
        nvml.nvmlShutdown()
        raise RuntimeError("NVML reports no GPU")

    def read_one(h: Any) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, get in (
            (A.GPU_SM_UTILIZATION, lambda: nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100),
            (A.GPU_MEM_BW_UTILIZATION, lambda: nvml.nvmlDeviceGetUtilizationRates(h).memory / 100),
            (A.GPU_MEMORY_USED_BYTES, lambda: nvml.nvmlDeviceGetMemoryInfo(h).used),
            (A.GPU_MEMORY_TOTAL_BYTES, lambda: nvml.nvmlDeviceGetMemoryInfo(h).total),
            (A.GPU_POWER_W, lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000),  # NVML reports mW
            (A.GPU_SM_CLOCK_MHZ, lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)),
            (A.GPU_TEMPERATURE_C, lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
        ):
            with contextlib.suppress(nvml.NVMLError):  # not supported on this device: leave it out
                out[name] = float(get())
        return out

    def read() -> dict[str, float]:
        return {
            f"{A.GPU_PREFIX}{i}.{name}": value
            for i, h in enumerate(handles)
            for name, value in read_one(h).items()
        }

    return read


class HostCpu:
    """Host CPU utilization (all cores, 0..1) between two reads of /proc/stat."""

    def __init__(self, path: str = "/proc/stat") -> None:
        self.path = path
        self.last = self._times()

    def _times(self) -> tuple[int, int]:
        with open(self.path) as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields), idle

    def read(self) -> dict[str, float]:
        total, idle = self._times()
        d_total, d_idle = total - self.last[0], idle - self.last[1]
        self.last = (total, idle)
        return {A.HOST_CPU_UTILIZATION: 1 - d_idle / d_total if d_total > 0 else 0.0}


class GpuSampler:
    """Samples every `interval_s` on a daemon thread. `nvml`: the pynvml module (default) or a
    stand-in with the same functions; without a usable NVML (or with `STEPSCOPE_NVML=0` and no
    `nvml` given) it says so once and samples the host CPU."""

    def __init__(self, nvml: Any = None, interval_s: float = 1.0, log: Callable[[str], None] | None = None):
        self.interval_s = interval_s
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.source = "nvml"
        try:
            if nvml is None:
                if os.environ.get(NVML_ENV) == "0":
                    raise RuntimeError(f"turned off by {NVML_ENV}=0")
                import pynvml as nvml
            self._read = _nvml_reader(nvml)
        except Exception as e:  # no driver, no library, no GPU: the usual case on a CPU machine
            self.source = "host"
            self._read = HostCpu().read
            self.log(f"stepscope telemetry: NVML not available ({e}); sampling host CPU utilization instead")
        self.latest: dict[str, float] = {}
        self._fresh = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> dict[str, float]:
        """Read the counters now; they become `latest` and are offered to the next step span."""
        try:
            values = self._read()
        except Exception:  # a device gone mid-run: keep serving, stop sampling
            self._stop.set()
            return self.latest
        self.latest, self._fresh = values, True
        return values

    def take_fresh(self) -> dict[str, float] | None:
        """The latest sample if no step span has carried it yet (the nearest step gets it)."""
        if not self._fresh:
            return None
        self._fresh = False
        return self.latest

    def start(self) -> GpuSampler:
        self._thread = threading.Thread(target=self._run, name="stepscope-gpu-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def register_gauges(self, meter: Any) -> None:
        """One observable gauge per counter name, a point per GPU (`stepscope.gpu.index`)."""
        from opentelemetry.metrics import Observation

        def observe(name: str) -> Callable[[object], list[Observation]]:
            def callback(options: object) -> list[Observation]:
                points = []
                for key, value in list(self.latest.items()):
                    if key == name:  # the host counter
                        points.append(Observation(value))
                    elif key.startswith(A.GPU_PREFIX) and key.endswith("." + name):
                        index = key[len(A.GPU_PREFIX) :].split(".", 1)[0]
                        points.append(Observation(value, {A.GPU_INDEX: int(index)}))
                return points

            return callback

        if self.source == "host":
            meter.create_observable_gauge(A.HOST_CPU_UTILIZATION, [observe(A.HOST_CPU_UTILIZATION)], "1")
            return
        for name, unit in (
            (A.GPU_SM_UTILIZATION, "1"),
            (A.GPU_MEM_BW_UTILIZATION, "1"),
            (A.GPU_MEMORY_USED_BYTES, "By"),
            (A.GPU_MEMORY_TOTAL_BYTES, "By"),
            (A.GPU_POWER_W, "W"),
            (A.GPU_SM_CLOCK_MHZ, "MHz"),
            (A.GPU_TEMPERATURE_C, "Cel"),
        ):
            meter.create_observable_gauge(A.METRIC_GPU_PREFIX + name, [observe(name)], unit)
