"""The front end's side of the core process: start it, stop it, and talk to it from asyncio.

    start_core_process(config) -> CoreProcess (the child, its socket, what READY said)
    AsyncEngineClient(core)    -> the `EngineClient` (engine/engine_client.py) the HTTP server uses

The child's side (`main`, `CoreLoop`) is engine/core_proc.py; the two share only the messages of
engine/protocol.py. This module imports no torch: the front end must not pay for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from engine.channel import RECV_BYTES, Channel, send_quietly
from engine.config import EngineConfig
from engine.engine_client import CoreError, OutputQueue
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


class CoreStartupError(RuntimeError):
    """The core process could not load the model or build the engine; the message says why."""


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
                send_quietly(Channel(self.sock, self.codec), Shutdown())
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


class AsyncEngineClient:
    """The front end's end of the channel: one reader task dispatches OUTPUTS to per-request queues.

    A request's queue receives its `RequestOutput`s, then (instead of a finished output) possibly a
    `CoreError`. The queue is dropped when the request finishes, fails or is aborted.
    """

    def __init__(self, core: CoreProcess, on_exit: Callable[[str], None]) -> None:
        self.core, self.on_exit = core, on_exit
        self.queues: dict[str, asyncio.Queue] = {}
        self.info = core.ready.info
        self.stats = EngineStats(kv_blocks_total=int(core.ready.info["num_kv_blocks"]))
        self.alive = False
        self._on_step: Callable[[int], None] | None = None
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

    def health_report(self) -> None:
        return None  # one core: `alive` says it all

    def extra_metrics(self) -> str:
        return ""

    def watch_steps(self, observe: Callable[[int], None]) -> None:
        self._on_step = observe

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
            while data := await reader.read(RECV_BYTES):
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
            if msg.stats.step_tokens and self._on_step is not None:
                self._on_step(msg.stats.step_tokens)
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
