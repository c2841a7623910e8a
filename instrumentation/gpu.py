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
import time
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
            (A.GPU_SM_CLOCK_MAX_MHZ, lambda: nvml.nvmlDeviceGetMaxClockInfo(h, nvml.NVML_CLOCK_SM)),
            (A.GPU_CLOCKS_EVENT_REASONS, lambda: _clock_event_reasons(nvml, h)),
            (A.GPU_PROCESSES, lambda: len(nvml.nvmlDeviceGetComputeRunningProcesses(h))),
        ):
            with contextlib.suppress(nvml.NVMLError, AttributeError):  # unsupported here: leave it out
                out[name] = float(get())
        return out

    def read() -> dict[str, float]:
        return {
            f"{A.GPU_PREFIX}{i}.{name}": value
            for i, h in enumerate(handles)
            for name, value in read_one(h).items()
        }

    return read


def _clock_event_reasons(nvml: Any, h: Any) -> int:
    """Why the clocks are held down (NVML's bitmask; the idle bit masked off: idling is not throttling)."""
    get = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
    get = get or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    return int(get(h)) & ~0x1


class HostCpu:
    """Host counters between two reads of /proc: CPU utilization and steal (all cores, 0..1), the load
    average, runnable tasks, and, given the engine core's `pid`, the cores' worth of CPU it used. What a
    noisy neighbour looks like from inside: load and runnable tasks above the cores, the engine's share
    of a core down while its steps take longer."""

    def __init__(self, path: str = "/proc/stat", pid: int | None = None) -> None:
        self.path, self.pid = path, pid
        self.cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.last = self._times()
        self.last_proc = (time.monotonic(), self._proc_ticks())

    def _times(self) -> tuple[int, int, int]:
        with open(self.path) as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        steal = fields[7] if len(fields) > 7 else 0
        return sum(fields), idle, steal

    def _proc_ticks(self) -> int | None:
        if self.pid is None:
            return None
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return int(fields[11]) + int(fields[12])  # utime + stime, clock ticks
        except (OSError, IndexError, ValueError):
            return None

    def read(self) -> dict[str, float]:
        total, idle, steal = self._times()
        d_total, d_idle, d_steal = total - self.last[0], idle - self.last[1], steal - self.last[2]
        self.last = (total, idle, steal)
        out = {
            A.HOST_CPU_UTILIZATION: 1 - d_idle / d_total if d_total > 0 else 0.0,
            A.HOST_CPU_STEAL: d_steal / d_total if d_total > 0 else 0.0,
            A.HOST_LOAD_1M: os.getloadavg()[0],
            A.HOST_CPUS: float(self.cpus),
        }
        running = _procs_running(self.path)
        if running is not None:
            out[A.HOST_PROCS_RUNNING] = float(running)
        now, ticks = time.monotonic(), self._proc_ticks()
        then, before = self.last_proc
        self.last_proc = (now, ticks)
        if ticks is not None and before is not None and now > then:
            out[A.HOST_ENGINE_CPU_SHARE] = (ticks - before) / os.sysconf("SC_CLK_TCK") / (now - then)
        return out


def _procs_running(path: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("procs_running"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


class GpuSampler:
    """Samples every `interval_s` on a daemon thread. `nvml`: the pynvml module (default) or a
    stand-in with the same functions; without a usable NVML (or with `STEPSCOPE_NVML=0` and no `nvml`
    given) it says so once and samples the host only. Host counters (`HostCpu`, with the engine core's
    `pid`) are sampled either way."""

    def __init__(
        self,
        nvml: Any = None,
        interval_s: float = 1.0,
        log: Callable[[str], None] | None = None,
        pid: int | None = None,
    ):
        self.interval_s = interval_s
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.source = "nvml"
        host = HostCpu(pid=pid)
        try:
            if nvml is None:
                if os.environ.get(NVML_ENV) == "0":
                    raise RuntimeError(f"turned off by {NVML_ENV}=0")
                import pynvml as nvml
            gpus = _nvml_reader(nvml)
            self._read = lambda: gpus() | host.read()
        except Exception as e:  # no driver, no library, no GPU: the usual case on a CPU machine
            self.source = "host"
            self._read = host.read
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
