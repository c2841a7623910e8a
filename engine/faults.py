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

`FaultSettings` is the whole fault state; the admin API sets it in one go (`{}` clears every fault).
"""

from __future__ import annotations

import random
import threading
from dataclasses import asdict, dataclass

from engine.protocol import get_codec

MAX_STALL_MS = 10_000.0  # longer than this is not a stall but a hang; refuse it
STALL_PERIOD_S = (0.10, 0.25)  # how often the stalling thread grabs the lock (uniform, seeded)
MAX_KV_MBPS = 1e6  # MB/s; 0 means unthrottled
MAX_FRONTEND_CPU = 1_000_000  # extra tokenizations of each prompt


@dataclass(frozen=True, slots=True)
class FaultSettings:
    """Every engine-side fault; the defaults are a healthy engine."""

    scheduler_stall_ms: float = 0.0
    rpc_codec: str = "binary"
    kv_transfer_mbps: float = 0.0  # disaggregated: KV link throttled to this many MB/s (10^6 B/s); 0: off
    weight_quant_off: bool = False  # an int8-weight engine serves full-precision weights
    frontend_cpu: int = 0  # the front end tokenizes each prompt this many extra times on its event loop

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


class EngineFaults:
    """The core process's faults. `apply(settings, channel)` switches them all; returns the settings."""

    def __init__(self, seed: int = 0) -> None:
        self.stall = SchedulerStall(seed)
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
        if channel is not None:
            channel.codec = get_codec(settings.rpc_codec)  # type: ignore[attr-defined]
        self.settings = settings
        return settings.to_dict()

    def close(self) -> None:
        """Stop every fault thread."""
        self.stall.stop()
