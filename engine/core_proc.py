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

Both ends of the boundary live here: `main`/`CoreLoop` in the child; `start_core_process`,
`CoreProcess` and the asyncio `AsyncEngineClient` in the front end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.faults import EngineFaults, FaultSettings
from engine.protocol import (
    Abort,
    Add,
    AdminGet,
    AdminReply,
    AdminSet,
    Codec,
    EngineStats,
    Error,
    FaultSet,
    FrameBuffer,
    Message,
    Outputs,
    ProtocolError,
    Ready,
    Shutdown,
    frame,
    get_codec,
)
from engine.request import EngineRequest

if TYPE_CHECKING:  # the front end imports this module too, and must not pay for torch
    from engine.core import EngineCore
    from engine.events import Event

EventSink = Callable[[list["Event"]], None]
_RECV_BYTES = 1 << 16


class CoreStartupError(RuntimeError):
    """The core process could not load the model or build the engine; the message says why."""


class Channel:
    """Blocking framed I/O over one socket; the core's side of the RPC channel."""

    def __init__(self, sock: socket.socket, codec: Codec) -> None:
        self.sock, self.codec, self.frames = sock, codec, FrameBuffer()
        self.eof = False
        self.sock.setblocking(True)

    def send(self, msg: Message) -> None:
        self.sock.sendall(frame(self.codec.encode(msg)))

    def receive(self, block: bool, timeout: float | None = None) -> list[Message] | None:
        """Every complete message pending now; with `block`, first wait until the socket is readable
        (`timeout` None: forever). None at EOF: the other side is gone."""
        if self.eof:
            return None
        if block and not select.select([self.sock], [], [], timeout)[0]:
            return []
        msgs: list[Message] = []
        while True:
            try:
                data = self.sock.recv(_RECV_BYTES, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return msgs
            if not data:
                self.eof = True  # messages that came before EOF still count (a core's last words)
                return msgs or None
            msgs += [self.codec.decode(b) for b in self.frames.feed(data)]


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
                self.channel.send(Outputs(outputs, EngineStats.from_core(core.stats())))

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
        _send_quietly(channel, Error("", f"{type(e).__name__}: {e}"))
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


def _send_quietly(channel: Channel, msg: Message) -> None:
    with contextlib.suppress(OSError):
        channel.send(msg)


def _exit_on_sigterm(signum: int, frame_: object) -> None:
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


# -- the front end's handle on the child ---------------------------------------------------------
@dataclasses.dataclass(slots=True)
class CoreProcess:
    """A started core process: its `Popen`, the front end's socket, and what READY said."""

    proc: subprocess.Popen
    sock: socket.socket
    codec: Codec
    ready: Ready
    frames: FrameBuffer  # bytes read past READY belong to the front end's reader

    def stop(self, timeout_s: float = 10.0) -> int:
        """Ask the core to exit, wait for it, kill it if it will not; returns its exit code."""
        if self.proc.poll() is None:
            if self.sock.fileno() != -1:  # still ours (the async client closes it when it is done)
                _send_quietly(Channel(self.sock, self.codec), Shutdown())
            self.sock.close()  # EOF stops the core even if the SHUTDOWN frame could not be sent
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.sock.close()
        return self.proc.returncode


def start_core_process(
    config: EngineConfig,
    codec_name: str = "binary",
    event_sink: str | None = None,
    extra: dict[str, Any] | None = None,
    startup_timeout_s: float | None = None,
) -> CoreProcess:
    """Spawn the core process and wait for READY. Raises `CoreStartupError` with the core's reason."""
    codec = get_codec(codec_name)
    ours, theirs = socket.socketpair()
    opts = {
        "engine": dataclasses.asdict(config),
        "codec": codec_name,
        "event_sink": event_sink,
        **(extra or {}),
    }
    cmd = [
        sys.executable,
        "-m",
        "engine.core_proc",
        "--fd",
        str(theirs.fileno()),
        "--options",
        json.dumps(opts),
    ]
    proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),))
    theirs.close()
    channel = Channel(ours, codec)
    deadline = None if startup_timeout_s is None else time.monotonic() + startup_timeout_s
    try:
        msg = _await_first_message(channel, proc, deadline)
    except BaseException:
        proc.kill()
        proc.wait()
        ours.close()
        raise
    return CoreProcess(proc, ours, codec, msg, channel.frames)


def _await_first_message(channel: Channel, proc: subprocess.Popen, deadline: float | None) -> Ready:
    while True:
        msgs = channel.receive(block=True, timeout=0.5)
        if msgs is None:
            raise CoreStartupError(f"the engine core exited during startup (exit code {proc.wait()})")
        for msg in msgs:
            if isinstance(msg, Ready):
                return msg
            if isinstance(msg, Error):
                raise CoreStartupError(msg.message)
        if proc.poll() is not None:
            raise CoreStartupError(f"the engine core exited during startup (exit code {proc.returncode})")
        if deadline is not None and time.monotonic() > deadline:
            raise CoreStartupError("the engine core did not become ready in time")


# -- the front end's asyncio client --------------------------------------------------------------
class CoreError(Exception):
    """The core refused a request (`fatal=False`), or the core is gone (`fatal=True`)."""

    def __init__(self, message: str, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


@dataclasses.dataclass(slots=True)
class RpcDelay:
    """One request's delays between the core producing its tokens (the output's `last_token_ns`) and
    the front end receiving them (CLOCK_MONOTONIC is system-wide, so the two processes compare)."""

    count: int = 0
    sum_ns: int = 0
    max_ns: int = 0

    def observe(self, delay_ns: int) -> None:
        self.count += 1
        self.sum_ns += delay_ns
        self.max_ns = max(self.max_ns, delay_ns)

    @property
    def mean_s(self) -> float | None:
        return self.sum_ns / self.count / 1e9 if self.count else None

    @property
    def max_s(self) -> float | None:
        return self.max_ns / 1e9 if self.count else None


class OutputQueue(asyncio.Queue):
    """A request's outputs as they arrive, and the RPC delays they had on the way."""

    def __init__(self) -> None:
        super().__init__()
        self.rpc_delay = RpcDelay()


class AsyncEngineClient:
    """The front end's end of the channel: one reader task dispatches OUTPUTS to per-request queues.

    A request's queue receives its `RequestOutput`s, then (instead of a finished output) possibly a
    `CoreError`. The queue is dropped when the request finishes, fails or is aborted.
    """

    def __init__(self, core: CoreProcess, on_exit: Callable[[str], None]) -> None:
        self.core, self.on_exit = core, on_exit
        self.queues: dict[str, asyncio.Queue] = {}
        self.stats = EngineStats(kv_blocks_total=int(core.ready.info["num_kv_blocks"]))
        self.alive = False
        self._admin: dict[int, asyncio.Future[AdminReply]] = {}
        self._admin_seq = 0
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        reader, self._writer = await asyncio.open_unix_connection(sock=self.core.sock)
        self.alive = True
        self._task = asyncio.create_task(self._read_loop(reader))

    @property
    def num_inflight(self) -> int:
        return len(self.queues)

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: the core's count, or in-flight minus running if that is larger
        (it also counts requests sent since the core's last step)."""
        return max(self.stats.waiting, len(self.queues) - self.stats.running)

    @property
    def num_kv_blocks(self) -> int:
        return self.stats.kv_blocks_total

    def is_finished(self, req_id: str) -> bool:
        return req_id not in self.queues

    def add(self, req: EngineRequest) -> OutputQueue:
        """Send a request to the core; its outputs arrive on the returned queue. Synchronous, so
        the request counts as in flight from the moment it is admitted."""
        if not self.alive:
            raise CoreError("the engine core is not running", fatal=True)
        queue = OutputQueue()
        self.queues[req.req_id] = queue
        self._send(Add(req))
        return queue

    def abort(self, req_id: str) -> None:
        """Forget the request and tell the core to free it (synchronous: safe in `finally`)."""
        if self.queues.pop(req_id, None) is not None and self.alive:
            self._send(Abort([req_id]))

    async def admin(self, changes: dict[str, object] | None) -> dict[str, object]:
        """The runtime limits, after applying `changes` (None: just read). ValueError if refused."""
        if not self.alive:
            raise CoreError("the engine core is not running", fatal=True)
        self._admin_seq += 1
        future = self._admin[self._admin_seq] = asyncio.get_running_loop().create_future()
        self._send(AdminGet(self._admin_seq) if changes is None else AdminSet(self._admin_seq, changes))
        reply = await future
        if not reply.ok:
            raise ValueError(reply.payload.get("error", "refused"))
        return reply.payload

    async def set_faults(self, settings: dict[str, object]) -> dict[str, object]:
        """Switch the engine-side faults (engine/faults.py) in the core, then this end's codec.
        ValueError if the core refuses them."""
        if not self.alive:
            raise CoreError("the engine core is not running", fatal=True)
        self._admin_seq += 1
        future = self._admin[self._admin_seq] = asyncio.get_running_loop().create_future()
        self._send(FaultSet(self._admin_seq, settings))
        reply = await future
        if not reply.ok:
            raise ValueError(reply.payload.get("error", "refused"))
        self.core.codec = get_codec(str(reply.payload["rpc_codec"]))  # same wire format: switch any time
        return reply.payload

    async def close(self) -> None:
        """Tell the core to exit and close the channel (the core also exits on EOF)."""
        if self.alive:
            self.alive = False
            self._send(Shutdown())
            with contextlib.suppress(OSError):
                await self._writer.drain()
        if self._writer is not None:
            self._writer.close()
        if self._task is not None:
            self._task.cancel()

    def _send(self, msg: Message) -> None:
        self._writer.write(frame(self.core.codec.encode(msg)))

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        reason = "the engine core exited"
        try:
            for body in self.core.frames.feed(b""):  # anything that arrived with READY
                self._dispatch(self.core.codec.decode(body))
            while data := await reader.read(_RECV_BYTES):
                for body in self.core.frames.feed(data):
                    self._dispatch(self.core.codec.decode(body))
        except (OSError, ProtocolError) as e:
            reason = f"the RPC channel to the engine core failed: {e}"
        if self.alive:  # not a shutdown we asked for
            self.alive = False
            self._fail_all(reason)
            self.on_exit(reason)

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, Outputs):
            self.stats = msg.stats
            now_ns = time.monotonic_ns()  # once per frame: it arrived (and decoded) now
            for out in msg.outputs:
                queue = self.queues.get(out.req_id)
                if queue is not None:  # None: aborted by the front end, its last output is moot
                    if out.new_token_ids and out.timings.last_token_ns:
                        queue.rpc_delay.observe(max(now_ns - out.timings.last_token_ns, 0))
                    queue.put_nowait(out)
                    if out.finished:
                        del self.queues[out.req_id]
        elif isinstance(msg, Error):
            queue = self.queues.pop(msg.req_id, None)
            if queue is not None:
                queue.put_nowait(CoreError(msg.message))
        elif isinstance(msg, AdminReply):
            future = self._admin.pop(msg.seq, None)
            if future is not None and not future.done():
                future.set_result(msg)

    def _fail_all(self, reason: str) -> None:
        for queue in self.queues.values():
            queue.put_nowait(CoreError(reason, fatal=True))
        self.queues.clear()
        for future in self._admin.values():
            if not future.done():
                future.set_exception(CoreError(reason, fatal=True))
        self._admin.clear()


if __name__ == "__main__":
    sys.exit(main())
