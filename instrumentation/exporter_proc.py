"""The exporter process: builds the core's spans and exports them, beside the core rather than in it.

    python -m instrumentation.exporter_proc --fd N --config JSON    (started by core_sink.make_sink)

It opens the OpenTelemetry providers (`Telemetry.open`, process `core`), says `ready` (or why it
cannot start) on the socket, then reads the core's step datagrams (`core_sink.encode_events`),
turns them into spans with `StepTracer` (the same builder the in-process tests use, so the spans are
identical) and leaves them to the SDK's batch processor. It wakes at most every `poll_s` and builds
everything that arrived meanwhile. The GPU / host CPU sampler runs here too, so its counters land on
the nearest step span as before.

The core's drop count arrives with each datagram and is reported as `stepscope.telemetry.dropped`
(kind `events`, process `core`) and in the drop log line. At EOF (the core closed the stream or
exited) or SIGTERM it builds what is left, flushes for at most 5 s and exits; it also exits when the
core dies (parent-death signal). A failure in span building stops tracing (one log line), never the
core, which only ever sees a socket it cannot write to.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import marshal
import os
import select
import signal
import socket
import sys
import time
import traceback

from instrumentation.config import TelemetryConfig, TelemetryError
from instrumentation.core_sink import decode_events
from instrumentation.gpu import GpuSampler
from instrumentation.providers import Telemetry
from instrumentation.step_spans import StepTracer


class Exporter:
    """Builds spans from the core's datagrams. `handle(data)` takes one; `run(sock)` reads to EOF."""

    def __init__(self, telemetry: Telemetry, gpu: GpuSampler | None = None, poll_s: float = 0.25) -> None:
        self.telemetry, self.gpu, self.poll_s = telemetry, gpu, poll_s
        self.tracer = StepTracer(telemetry, gpu=gpu.take_fresh if gpu else None)
        self.core_dropped = 0  # events the core could not send, as it last told us
        # A datagram never exceeds the sender's buffer: SO_SNDBUF, which the kernel doubles.
        self._buffer = memoryview(bytearray(2 * telemetry.config.sink_buffer_bytes))
        self.failed = False
        telemetry.extra_dropped["events"] = lambda: self.core_dropped
        if gpu is not None:
            gpu.register_gauges(telemetry.meter)
            gpu.start()

    def handle(self, data: bytes) -> None:
        try:
            dropped, events = decode_events(data)
            self.core_dropped = max(self.core_dropped, dropped)
            if not self.failed:
                self.tracer.consume(events)
        except Exception:  # a tracing bug stops tracing, never the engine
            if not self.failed:
                traceback.print_exc()
                print("stepscope telemetry: building spans failed; tracing stops", file=sys.stderr)
            self.failed = True

    def run(self, sock: socket.socket) -> None:
        """Build spans from what arrives until the core closes the stream."""
        while True:
            select.select([sock], [], [])
            if not self.drain(sock):
                return
            time.sleep(self.poll_s)  # let a few steps gather: fewer wake-ups, same spans

    def drain(self, sock: socket.socket) -> bool:
        """Handle every datagram pending now; False at EOF."""
        while True:
            try:
                n = sock.recv_into(self._buffer, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not n:
                return False
            self.handle(self._buffer[:n])

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the sampler, flush and stop the providers (giving up after `timeout_s`)."""
        if self.gpu is not None:
            self.gpu.stop()
        self.telemetry.shutdown(timeout_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="instrumentation.exporter_proc")
    p.add_argument("--fd", type=int, required=True, help="inherited SOCK_SEQPACKET fd connected to the core")
    p.add_argument("--config", required=True, help="TelemetryConfig as JSON")
    args = p.parse_args(argv)
    from engine.core_proc import _die_with_parent  # no torch: the front end imports it too

    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the core decides
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    sock = socket.socket(fileno=args.fd)
    try:
        telemetry = Telemetry.open(TelemetryConfig(**json.loads(args.config)), process="core")
        exporter = Exporter(telemetry, GpuSampler(pid=os.getppid()))  # the core spawned us
    except Exception as e:
        reason = str(e) if isinstance(e, TelemetryError) else f"{type(e).__name__}: {e}"
        sock.send(marshal.dumps(("error", reason)))
        return 1
    sock.send(marshal.dumps(("ready", "")))
    try:
        exporter.run(sock)
    except SystemExit:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the flush below is bounded; let it finish
        with contextlib.suppress(Exception):  # never fail before the flush
            exporter.drain(sock)  # what the core sent before it went
        exporter.close()
    return 0


def _exit_on_sigterm(signum: int, frame_: object) -> None:
    raise SystemExit(0)


if __name__ == "__main__":
    sys.exit(main())
