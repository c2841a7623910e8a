"""The KV link: a prefill worker's sender thread and a decode worker's listener, over plain TCP.

    prefill worker step loop                      decode worker
    ------------------------                      -------------
    after each step: copy the request's newly     KVReceiver: accept thread + one reader thread per
    full blocks -> KVSender.send(...)  --TCP-->   connection; decoded frames queue up for the step
    sender thread: one connection per decode      loop, which writes them into the reserved blocks
    worker, writes paced by a token bucket        between steps (one wake-up byte per frame)

The step loop never blocks on the network: the sender thread owns the sockets. The token bucket is the
`kv_transfer_mbps` fault (engine/faults.py): real bytes written slowly, as a congested link would.
A write that cannot proceed for `send_timeout_s` fails the transfer (the router's timeout then
fails or retries the request).
"""

from __future__ import annotations

import collections
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.disagg.kv_wire import (
    MAX_KV_FRAME_BYTES,
    DoneFrame,
    KVFrame,
    KVWireError,
    LayerBlocks,
    decode_frame,
    encode_abort,
    encode_blocks,
    encode_done,
    num_tensor_bytes,
)

_CHUNK = 1 << 16  # bytes per paced write


class TokenBucket:
    """Paces writes to `mbps` MB/s (10^6 bytes/s); 0 means unthrottled. Thread-safe enough: one writer."""

    def __init__(self) -> None:
        self.bytes_per_s = 0.0
        self._next_free = 0.0

    def set_mbps(self, mbps: float) -> None:
        self.bytes_per_s = float(mbps) * 1e6

    def wait(self, nbytes: int) -> None:
        """Sleep until `nbytes` more may go out."""
        rate = self.bytes_per_s
        if rate <= 0:
            return
        now = time.monotonic()
        start = max(now, self._next_free)
        self._next_free = start + nbytes / rate
        if start > now:
            time.sleep(start - now)


@dataclass(slots=True)
class SendRecord:
    """One request's transfer as the sender saw it."""

    req_id: str
    peer: str
    trace_context: str
    first_ns: int = 0  # first frame queued
    end_ns: int = 0  # DONE written
    kv_bytes: int = 0
    num_blocks: int = 0
    busy_ns: int = 0  # time spent writing (paced): bytes / busy = the link's achieved bandwidth
    error: str = ""


class KVSender:
    """Sends KV frames to decode workers from one thread. `on_done(record)` runs on that thread when a
    request's DONE (or a failure) is written."""

    def __init__(self, on_done: Callable[[SendRecord], None], send_timeout_s: float = 30.0) -> None:
        self.on_done, self.send_timeout_s = on_done, send_timeout_s
        self.bucket = TokenBucket()
        self.kv_bytes_sent = 0
        self.transfers_sent = 0
        self.transfers_failed = 0
        self.transfers_aborted = 0
        self.send_busy_ns = 0  # time spent writing: kv_bytes_sent / this = the link's achieved bandwidth
        self._records: dict[str, SendRecord] = {}
        self._queue: queue.Queue = queue.Queue()
        self._socks: dict[str, socket.socket] = {}
        self._thread = threading.Thread(target=self._run, name="stepscope-kv-sender", daemon=True)
        self._thread.start()

    def begin(self, req_id: str, peer: str, trace_context: str) -> None:
        """Start accounting a transfer (call before its first frame)."""
        self._records[req_id] = SendRecord(req_id, peer, trace_context, first_ns=time.monotonic_ns())

    def send_blocks(self, req_id: str, first_block: int, blocks: list[LayerBlocks]) -> None:
        frame = encode_blocks(req_id, first_block, blocks)
        self._queue.put((req_id, frame, num_tensor_bytes(blocks), blocks[0][0].shape[1], ""))

    def send_done(self, done: DoneFrame) -> None:
        """The request's last frame; `on_done` follows once it is written."""
        self._queue.put((done.req_id, [encode_done(done)], 0, 0, "done"))

    def send_abort(self, req_id: str, reason: str) -> None:
        """End the request's stream without a DONE (the prefill worker dropped it)."""
        self._queue.put((req_id, [encode_abort(req_id, reason)], 0, 0, "abort"))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)
        for sock in self._socks.values():
            sock.close()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            req_id, buffers, nbytes, nblocks, last = item
            rec = self._records.get(req_id)
            if rec is None:
                continue
            if not rec.error:  # after a failure the request's later frames are dropped
                start = time.monotonic_ns()
                try:
                    self._write(rec.peer, buffers)
                    rec.kv_bytes += nbytes
                    rec.num_blocks += nblocks
                    self.kv_bytes_sent += nbytes
                except OSError as e:
                    rec.error = f"KV transfer to {rec.peer} failed: {e}"
                    self._drop(rec.peer)
                    print(f"stepscope worker: {rec.error}", file=sys.stderr)
                busy = time.monotonic_ns() - start
                rec.busy_ns += busy
                self.send_busy_ns += busy
            if last:
                self._finish(rec, aborted=last == "abort")

    def _finish(self, rec: SendRecord, aborted: bool) -> None:
        self._records.pop(rec.req_id, None)
        rec.end_ns = time.monotonic_ns()
        if rec.error:
            self.transfers_failed += 1
        elif aborted:  # ended without a DONE: not a transfer, no span
            self.transfers_aborted += 1
            return
        else:
            self.transfers_sent += 1
        self.on_done(rec)

    def _write(self, peer: str, buffers: list[bytes | memoryview]) -> None:
        sock = self._socks.get(peer)
        if sock is None:
            host, _, port = peer.rpartition(":")
            sock = socket.create_connection((host, int(port)), timeout=self.send_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socks[peer] = sock
        for buf in buffers:
            view = memoryview(buf).cast("B")
            for i in range(0, len(view), _CHUNK):
                chunk = view[i : i + _CHUNK]
                self.bucket.wait(len(chunk))
                sock.sendall(chunk)

    def _drop(self, peer: str) -> None:
        sock = self._socks.pop(peer, None)
        if sock is not None:
            sock.close()


@dataclass(slots=True)
class Received:
    frame: KVFrame
    ts_ns: int
    kv_bytes: int


class KVReceiver:
    """Listens for prefill workers' KV streams; decoded frames wait in `frames` for the step loop, which
    `wake_fd` (readable once per frame) wakes up."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.listener = socket.create_server((host, port))
        self.address = f"{host}:{self.listener.getsockname()[1]}"
        self.frames: collections.deque[Received] = collections.deque()
        self.kv_bytes_received = 0
        self.errors = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        threading.Thread(target=self._accept, name="stepscope-kv-accept", daemon=True).start()

    @property
    def wake_fd(self) -> int:
        return self._wake_r

    def drain(self) -> list[Received]:
        """Every frame received so far, in arrival order; clears the wake-ups."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while self.frames:
            out.append(self.frames.popleft())
        return out

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(conn,), name="stepscope-kv-recv", daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with conn:
            try:
                while (body := _read_frame(conn)) is not None:
                    frame = decode_frame(body)
                    nbytes = num_tensor_bytes(frame.blocks) if hasattr(frame, "blocks") else 0
                    self.kv_bytes_received += nbytes
                    self.frames.append(Received(frame, time.monotonic_ns(), nbytes))
                    os.write(self._wake_w, b"k")
            except (OSError, KVWireError) as e:  # a dead or broken sender: the router times it out
                self.errors += 1
                print(f"stepscope worker: KV stream closed: {e}", file=sys.stderr)


def _read_frame(conn: socket.socket) -> bytearray | None:
    head = _read_exact(conn, 4)
    if head is None:
        return None
    n = int.from_bytes(head, "little")
    if n == 0 or n > MAX_KV_FRAME_BYTES:
        raise KVWireError(f"bad KV frame length {n}")
    body = _read_exact(conn, n)
    if body is None:
        raise KVWireError("KV stream ended inside a frame")
    return body


def _read_exact(conn: socket.socket, n: int) -> bytearray | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return None
            raise KVWireError("KV stream ended inside a frame")
        got += k
    return buf
