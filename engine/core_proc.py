"""The engine core process: the step loop, alone, behind one end of a socket pair.

    front end (HTTP, tokenize, detokenize, SSE)          core process (this module)
    -------------------------------------------          --------------------------
    start_core_process(config) ---- fork/exec ---------> main(): EngineCore(config)
                               <--------- READY -------- model loaded (or ERROR, exit 1)
    ADD / ABORT / ADMIN_* ------------------------------> applied between steps
                               <-------- OUTPUTS ------- one frame per step (+ stats)
    SHUTDOWN or socket closed --------------------------> exit

HTTP parsing and tokenization never stall the step loop: the loop reads whatever messages are
pending without blocking, runs a step while there is work, and blocks on the socket only when idle.
The core process exits when the front end goes away (EOF on the socket, or the parent-death
signal), so it can never be orphaned.

Instrumentation hook: `CoreLoop(event_sink=...)` (in the process: `start_core_process(config,
event_sink="module:factory")`, `factory(options) -> sink`) receives the typed events of
`core.drain_events()` once per step. This module never imports OpenTelemetry; a
sink that fails is reported once and dropped, never breaking the step loop.

This module is the child's side; the front end's side (`start_core_process`, `CoreProcess`, the
asyncio `AsyncEngineClient`) is engine/core_client.py.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine.channel import Channel, send_quietly
from engine.config import EngineConfig
from engine.faults import EngineFaults, FaultSettings
from engine.protocol import (
    Abort,
    Add,
    AdminGet,
    AdminReply,
    AdminSet,
    EngineStats,
    Error,
    FaultSet,
    Message,
    Outputs,
    Ready,
    Shutdown,
    get_codec,
)

if TYPE_CHECKING:  # other processes import its helpers too, and must not pay for torch
    from engine.core import EngineCore
    from engine.events import Event

EventSink = Callable[[list["Event"]], None]


class CoreLoop:
    """Drives an `EngineCore` from messages on a `Channel`; `run()` returns when told to stop."""

    def __init__(
        self,
        core: EngineCore,
        channel: Channel,
        event_sink: EventSink | None = None,
        faults: EngineFaults | None = None,
    ) -> None:
        self.core, self.channel, self.event_sink = core, channel, event_sink
        self.faults = faults or EngineFaults()  # engine/faults.py: the step lock, the codec switch
        self.stopping = False

    def run(self) -> None:
        core = self.core
        while not self.stopping:
            msgs = self.channel.receive(block=not core.has_unfinished_requests())
            if msgs is None:
                return  # the front end went away
            for msg in msgs:
                self.apply(msg)
            if not self.stopping and core.has_unfinished_requests():
                with self.faults.step_lock:  # uncontended unless the scheduler_stall fault is on
                    outputs = core.step()
                self.sink(core.drain_events())  # once per step, so the buffer never grows
                stats = EngineStats.from_core(core.stats())
                stats.step_tokens = core.last_step_tokens
                self.channel.send(Outputs(outputs, stats))

    def apply(self, msg: Message) -> None:
        if isinstance(msg, Add):
            try:
                self.core.add_request(msg.request)
            except ValueError as e:
                self.channel.send(Error(msg.request.req_id, str(e)))
        elif isinstance(msg, Abort):
            for req_id in msg.req_ids:
                self.core.abort_request(req_id)
        elif isinstance(msg, AdminGet):
            self.channel.send(AdminReply(msg.seq, True, self.core.limits()))
        elif isinstance(msg, AdminSet):
            try:
                reply = AdminReply(msg.seq, True, self.core.update_limits(**msg.changes))
            except (ValueError, TypeError) as e:
                reply = AdminReply(msg.seq, False, {"error": str(e)})
            self.channel.send(reply)
            self.channel.send(Outputs([], EngineStats.from_core(self.core.stats())))  # show the new pool
        elif isinstance(msg, FaultSet):
            try:
                settings = FaultSettings.from_json(msg.settings)
                reply = AdminReply(msg.seq, True, self.faults.apply(settings, self.channel, self.core))
            except (ValueError, TypeError) as e:
                reply = AdminReply(msg.seq, False, {"error": str(e)})
            self.channel.send(reply)
        elif isinstance(msg, Shutdown):
            self.stopping = True

    def sink(self, events: list[Event]) -> None:
        if self.event_sink is None or not events:
            return
        try:
            self.event_sink(events)
        except Exception:  # a broken observer must never break the engine
            traceback.print_exc()
            print("stepscope core: event sink failed; events are dropped from now on", file=sys.stderr)
            self.event_sink = None


def ready_info(core: EngineCore) -> dict[str, Any]:
    """What the front end needs to know about the loaded model and engine."""
    mc, tok = core.model_config, core.tokenizer
    return {
        "model": core.config.model,
        "max_model_len": mc.max_model_len,
        "vocab_size": mc.vocab_size,
        "eos_token_id": tok.eos_token_id,
        "bos_token_id": tok.bos_token_id,
        "block_size": core.config.block_size,
        "kv_dtype": core.config.kv_dtype,
        "enable_prefix_caching": core.config.enable_prefix_caching,
        "num_kv_blocks": core.kv.num_blocks,
        "device": str(core.device),
        "dtype": core.weight_dtype,
        "limits": core.limits(),
        "pid": os.getpid(),
    }


# -- the child process ---------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Entry point of the core process: `python -m engine.core_proc --fd N --options JSON`."""
    p = argparse.ArgumentParser(prog="engine.core_proc")
    p.add_argument("--fd", type=int, required=True, help="inherited socket fd connected to the front end")
    p.add_argument("--options", required=True, help="JSON: engine config, codec, event sink, otlp endpoint")
    args = p.parse_args(argv)
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the front end decides
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    opts = json.loads(args.options)
    channel = Channel(socket.socket(fileno=args.fd), get_codec(opts.get("codec", "binary")))
    try:
        config = EngineConfig(**opts["engine"])  # EngineCore applies num_threads before loading
        sink = _load_sink(opts.get("event_sink"), opts)
        from engine.core import EngineCore

        core = EngineCore(config, record_events=sink is not None)
    except Exception as e:  # report any failure to start, with its cause, then exit
        if not isinstance(e, ValueError):  # a bad setting explains itself; anything else is a bug
            traceback.print_exc()
        send_quietly(channel, Error("", f"{type(e).__name__}: {e}"))
        return 1
    try:
        channel.send(Ready(ready_info(core)))
        CoreLoop(core, channel, sink).run()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the front end is gone: nobody to report to
    return 0


def _load_sink(spec: str | None, opts: dict[str, Any]) -> EventSink | None:
    """`module:factory` -> factory(opts) -> sink; imported only when configured."""
    if not spec:
        return None
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)(opts)


def _exit_on_sigterm(signum: int, frame_: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one would break into the exit handlers
    raise SystemExit(0)


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies (covers a long model load)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() == 1:  # the parent died before prctl took effect
        raise SystemExit(0)


if __name__ == "__main__":
    sys.exit(main())
