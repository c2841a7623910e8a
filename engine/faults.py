"""Engine-side fault injection: real contention and real serialization cost, switched at run time.

These faults need code inside the engine; every other scenario fault is a workload shift (the load
generator) or a runtime knob (`/admin/limits`), see docs/faults.md.

- `scheduler_stall_ms`: the core loop takes `SchedulerStall.lock` around each `core.step()`; while the
  fault is on, a thread takes the same lock every 100-250 ms and keeps it for the given milliseconds
  (as a housekeeping thread doing I/O under a shared lock would). The step loop really waits: the gap
  between one step's end and the next one's start grows, and nothing is faked or recorded for it.
- `rpc_codec`: the front-end/core channel switches to another codec (`slow:K` does the encoding and
  decoding work K times with the same wire format, so each end switches on its own, mid-stream).
- `kv_transfer_mbps` (disaggregated serving only, docs/disagg.md): a prefill worker's KV sender writes
  through a token bucket of that many megabytes (10^6 bytes) per second, a congested or misrouted link.
- `weight_quant_off` (an engine serving `--weight-dtype int8`): the int8 weights are swapped for
  full-precision Linears of their dequantized values, as when a deployment silently loads the
  unquantized checkpoint: every decode step reads ~4x the weight bytes (fp32) and takes longer at the
  same batch size; the step's `weight_dtype` changes. Clearing it puts the int8 modules back.

- `frontend_cpu` (the front end, not the core): the API server tokenizes each prompt that many extra
  times on its event loop, as a slow tokenizer or heavy request parsing would: the loop gets busy, new
  requests wait in the front end before reaching the core's queue, and the loop's lag grows.
- `busy_threads`: that many threads in the core process spin in Python for 10 ms, sleep 10 ms, over and
  over: a noisy neighbour inside the process (a metrics scraper, a leaked background task) that takes the
  interpreter and a core from the step loop. Steps take longer at the same batch size while the stepping
  thread's own CPU time per step stays put; the other replicas of a fleet are not touched (the fleet's
  `replica_slow`, docs/fleet.md).

`FaultSettings` is the whole fault state; the admin API sets it in one go (`{}` clears every fault).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import asdict, dataclass

from engine.protocol import get_codec

MAX_STALL_MS = 10_000.0  # longer than this is not a stall but a hang; refuse it
STALL_PERIOD_S = (0.10, 0.25)  # how often the stalling thread grabs the lock (uniform, seeded)
MAX_KV_MBPS = 1e6  # MB/s; 0 means unthrottled
MAX_FRONTEND_CPU = 1_000_000  # extra tokenizations of each prompt
MAX_BUSY_THREADS = 64
BUSY_DUTY_S = (0.010, 0.010)  # a busy thread spins this long, then sleeps this long


@dataclass(frozen=True, slots=True)
class FaultSettings:
    """Every engine-side fault; the defaults are a healthy engine."""

    scheduler_stall_ms: float = 0.0
    rpc_codec: str = "binary"
    kv_transfer_mbps: float = 0.0  # disaggregated: KV link throttled to this many MB/s (10^6 B/s); 0: off
    weight_quant_off: bool = False  # an int8-weight engine serves full-precision weights
    frontend_cpu: int = 0  # the front end tokenizes each prompt this many extra times on its event loop
    busy_threads: int = 0  # threads spinning in the core process half the time (a noisy neighbour)

    def __post_init__(self) -> None:
        stall = self.scheduler_stall_ms
        if isinstance(stall, bool) or not isinstance(stall, (int, float)) or not 0 <= stall <= MAX_STALL_MS:
            raise ValueError(f"scheduler_stall_ms must be a number in [0, {MAX_STALL_MS:g}], got {stall!r}")
        if not isinstance(self.rpc_codec, str):
            raise ValueError(f"rpc_codec must be a string, got {self.rpc_codec!r}")
        get_codec(self.rpc_codec)  # raises ValueError naming the choices
        mbps = self.kv_transfer_mbps
        if isinstance(mbps, bool) or not isinstance(mbps, (int, float)) or not 0 <= mbps <= MAX_KV_MBPS:
            raise ValueError(f"kv_transfer_mbps must be a number in [0, {MAX_KV_MBPS:g}], got {mbps!r}")
        k = self.frontend_cpu
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_FRONTEND_CPU:
            raise ValueError(f"frontend_cpu must be an integer in [0, {MAX_FRONTEND_CPU}], got {k!r}")
        n = self.busy_threads
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_BUSY_THREADS:
            raise ValueError(f"busy_threads must be an integer in [0, {MAX_BUSY_THREADS}], got {n!r}")
        if not isinstance(self.weight_quant_off, bool):
            raise ValueError(f"weight_quant_off must be true or false, got {self.weight_quant_off!r}")

    @classmethod
    def from_json(cls, body: dict[str, object]) -> FaultSettings:
        """From an admin request body; unknown keys and bad values raise ValueError."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(body) - known)
        if unknown:
            raise ValueError(f"unknown fault {', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
        return cls(**body)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, object]:
        """JSON-ready, as the admin API answers."""
        return asdict(self)

    @property
    def active(self) -> bool:
        """Whether any fault is on."""
        return self != FaultSettings()


class SchedulerStall:
    """The lock the step loop holds around each step, and the thread that grabs it while the fault is on."""

    def __init__(self, seed: int = 0) -> None:
        self.lock = threading.Lock()
        self.stall_ms = 0.0
        self.stalls = 0  # times the thread held the lock (tests and logs)
        self._rng = random.Random(seed)
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def set(self, stall_ms: float) -> None:
        """Start stalling for `stall_ms` at a time (0 stops the thread)."""
        self.stop()
        self.stall_ms = float(stall_ms)
        if self.stall_ms <= 0:
            return
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(self.stall_ms / 1000.0, self._stop), name="stepscope-stall", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop the stalling thread and wait for it to let go of the lock."""
        if self._stop is not None and self._thread is not None:
            self._stop.set()
            self._thread.join()
        self._stop = self._thread = None
        self.stall_ms = 0.0

    def _run(self, hold_s: float, stop: threading.Event) -> None:
        while not stop.wait(self._rng.uniform(*STALL_PERIOD_S)):
            with self.lock:  # waits for the step in progress, then keeps the loop out
                self.stalls += 1
                stop.wait(hold_s)


class BusyThreads:
    """The busy_threads fault: threads that spin and sleep in turn until stopped."""

    def __init__(self) -> None:
        self.count = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def set(self, count: int) -> None:
        self.stop()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=_spin, args=(self._stop,), name=f"stepscope-busy-{i}", daemon=True)
            for i in range(count)
        ]
        for t in self._threads:
            t.start()
        self.count = count

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()
        self._threads, self.count = [], 0


def _spin(stop: threading.Event) -> None:
    spin_s, sleep_s = BUSY_DUTY_S
    while not stop.is_set():
        end = time.perf_counter() + spin_s
        while time.perf_counter() < end:
            pass
        stop.wait(sleep_s)


class EngineFaults:
    """The core process's faults. `apply(settings, channel)` switches them all; returns the settings."""

    def __init__(self, seed: int = 0) -> None:
        self.stall = SchedulerStall(seed)
        self.busy = BusyThreads()
        self.settings = FaultSettings()

    @property
    def step_lock(self) -> threading.Lock:
        """Taken by the core loop around each `core.step()`."""
        return self.stall.lock

    def apply(
        self, settings: FaultSettings, channel: object | None = None, core: object | None = None
    ) -> dict[str, object]:
        """Switch to `settings`: swap the core's weights (first: it may refuse), restart the stall thread
        if its length changed, swap the channel's codec."""
        if core is not None:
            core.set_weights_full_precision(settings.weight_quant_off)  # type: ignore[attr-defined]
        if settings.scheduler_stall_ms != self.stall.stall_ms:
            self.stall.set(settings.scheduler_stall_ms)
        if settings.busy_threads != self.busy.count:
            self.busy.set(settings.busy_threads)
        if channel is not None:
            channel.codec = get_codec(settings.rpc_codec)  # type: ignore[attr-defined]
        self.settings = settings
        return settings.to_dict()

    def close(self) -> None:
        """Stop every fault thread."""
        self.stall.stop()
        self.busy.stop()
