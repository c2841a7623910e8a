"""A disaggregated worker: an engine core with a role, registered with the router over TCP.

    router --Handoff(req, kv_addr)--> prefill worker: prefill-only; after each step the request's newly
                                      full blocks go to the KV link; at the first token the last partial
                                      block and a DONE frame (first token, timings); blocks released
    router --Add(req)---------------> decode worker: reserve the prompt's blocks; write KV frames as they
                                      arrive (between steps); at DONE commit: run on from the first token
    worker --Outputs / WorkerStats--> router: one Outputs frame per step (or per commit); stats every
                                      `heartbeat_s` (load for picking, KV bytes for checking, liveness)

It is `engine/core_proc.py`'s `CoreLoop` with a role: the same messages, limits, faults and event sink,
over a TCP connection the worker opened to the router (so a worker on another host, or a restarted one,
registers by connecting). The step loop never waits on the network: the KV link has its own threads.
"""

from __future__ import annotations

import collections
import select
import time
from dataclasses import dataclass

from engine.channel import Channel
from engine.core_proc import CoreLoop, EventSink
from engine.disagg import handoff as H
from engine.disagg.kv_link import KVReceiver, KVSender, Received, SendRecord
from engine.disagg.kv_wire import AbortFrame, BlocksFrame, DoneFrame, KVWireError, num_tensor_bytes
from engine.events import KVTransferEvent
from engine.faults import EngineFaults
from engine.protocol import Abort, Add, Error, FaultSet, Handoff, Message, Outputs, WorkerStats
from engine.protocol import EngineStats as Stats
from engine.request import EngineRequest, RequestOutput

ROLES = ("prefill", "decode")


@dataclass(slots=True)
class _Outgoing:
    """Prefill side: a request whose KV streams to `peer`."""

    peer: str
    sent_blocks: int = 0
    kv_bytes: int = 0


@dataclass(slots=True)
class _Incoming:
    """Decode side: a reserved request whose KV is arriving."""

    request: EngineRequest
    reserved_ns: int
    first_ns: int = 0  # first frame received
    last_ns: int = 0  # latest frame received
    kv_bytes: int = 0
    num_blocks: int = 0


class WorkerLoop(CoreLoop):
    """`CoreLoop` plus a role: prefill workers take `Handoff`, decode workers take `Add` as a reservation."""

    def __init__(
        self,
        core: object,
        channel: Channel,
        role: str,
        event_sink: EventSink | None = None,
        faults: EngineFaults | None = None,
        receiver: KVReceiver | None = None,
        kv_timeout_s: float = 30.0,
        heartbeat_s: float = 0.5,
    ) -> None:
        super().__init__(core, channel, event_sink, faults)
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        self.role, self.receiver = role, receiver
        self.kv_timeout_s, self.heartbeat_s = kv_timeout_s, heartbeat_s
        self.kv_events: collections.deque = collections.deque()  # KVTransferEvents from the sender thread
        self.sender = KVSender(self._sent, send_timeout_s=kv_timeout_s) if role == "prefill" else None
        self.outgoing: dict[str, _Outgoing] = {}
        self.incoming: dict[str, _Incoming] = {}
        self.pending: collections.deque[EngineRequest] = collections.deque()  # no room to reserve yet
        self.early: dict[str, list[Received]] = {}  # frames that beat their request's Add
        self.ready_outputs: list[RequestOutput] = []  # commits and refusals, sent with the next frame
        self.transfers_received = 0
        self._next_heartbeat = 0.0

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> None:
        core, fds = self.core, [self.channel.sock]
        if self.receiver is not None:
            fds.append(self.receiver.wake_fd)
        while not self.stopping:
            busy = core.has_unfinished_requests() or self.ready_outputs
            wait = 0 if busy else max(self._next_heartbeat - time.monotonic(), 0.0)
            select.select(fds, [], [], wait)
            msgs = self.channel.receive(block=False)
            if msgs is None:
                return  # the router went away
            for msg in msgs:
                self.apply(msg)
            if self.receiver is not None:
                self._take_frames(self.receiver.drain())
                self._reserve_pending()
                self._expire()
            if not self.stopping:
                self._step_once()
            if time.monotonic() >= self._next_heartbeat:
                self.channel.send(WorkerStats(self.worker_stats()))
                self._next_heartbeat = time.monotonic() + self.heartbeat_s

    def _step_once(self) -> None:
        outputs, self.ready_outputs = self.ready_outputs, []
        if self.core.has_unfinished_requests():
            with self.faults.step_lock:
                outputs += self.core.step()
            if self.role == "prefill":
                self._ship(outputs)
        events = self.core.drain_events()
        while self.kv_events:
            events.append(self.kv_events.popleft())
        self.sink(events)
        if outputs:
            self.channel.send(Outputs(outputs, Stats.from_core(self.core.stats())))

    def apply(self, msg: Message) -> None:
        if isinstance(msg, Handoff) and self.role == "prefill":
            self._prefill(msg)
        elif isinstance(msg, Add):
            if self.role == "decode":
                self._reserve(msg.request)
            else:
                self.channel.send(Error(msg.request.req_id, "a prefill worker takes Handoff, not Add"))
        elif isinstance(msg, Abort):
            for req_id in msg.req_ids:
                self._forget(req_id)
            super().apply(msg)
        else:
            super().apply(msg)
            if isinstance(msg, FaultSet) and self.sender is not None:
                self.sender.bucket.set_mbps(self.faults.settings.kv_transfer_mbps)

    def worker_stats(self) -> dict[str, object]:
        """Load and KV-transfer counters for the router (picking, /metrics, /health)."""
        stats = dict(self.core.stats())
        stats.update(role=self.role, reserved=len(self.incoming), pending=len(self.pending))
        if self.receiver is not None:  # every KV byte that arrived (also of requests aborted meanwhile)
            stats.update(kv_bytes_received=self.receiver.kv_bytes_received)
            stats.update(kv_transfers_received=self.transfers_received)
        if self.sender is not None:
            s = self.sender
            stats.update(kv_bytes_sent=s.kv_bytes_sent, kv_transfers_sent=s.transfers_sent)
            stats.update(kv_transfers_failed=s.transfers_failed, kv_transfers_aborted=s.transfers_aborted)
            stats.update(kv_send_seconds=s.send_busy_ns / 1e9)
        return stats

    # -- prefill side ----------------------------------------------------------------------------
    def _prefill(self, msg: Handoff) -> None:
        req = msg.request
        try:
            H.add_prefill_only(self.core, req)
        except ValueError as e:
            self.channel.send(Error(req.req_id, str(e)))
            return
        self.sender.begin(req.req_id, msg.kv_addr, req.trace_context)
        self.outgoing[req.req_id] = _Outgoing(msg.kv_addr)

    def _ship(self, outputs: list[RequestOutput]) -> None:
        """After a step: stream newly final blocks; at the handoff the rest and DONE; then free them."""
        bs = self.core.config.block_size
        for req_id, seq in H.prefill_sequences(self.core).items():
            out = self.outgoing.get(req_id)
            if out is None:
                continue
            n = H.num_sendable_blocks(seq, bs)
            if n > out.sent_blocks:
                blocks = H.read_kv(self.core, seq, out.sent_blocks, n)
                self.sender.send_blocks(req_id, out.sent_blocks, blocks)
                out.kv_bytes += num_tensor_bytes(blocks)
                out.sent_blocks = n
            if seq.finished:  # handed off: the copies are taken, the blocks can go
                t = seq.timings
                done = DoneFrame(
                    req_id, seq.token_ids[-1], n, out.kv_bytes, max(seq.num_cached_tokens, 0),
                    t.first_scheduled_ns, t.first_token_ns,
                )  # fmt: skip
                self.sender.send_done(done)
                H.release_handoff(self.core, req_id)
                del self.outgoing[req_id]
        for o in outputs:  # finished here (EOS or max_tokens at the first token, abort): no DONE
            if o.finished and o.finish_reason != "handoff" and o.req_id in self.outgoing:
                del self.outgoing[o.req_id]
                self.sender.send_abort(o.req_id, f"finished on the prefill worker ({o.finish_reason})")

    def _sent(self, rec: SendRecord) -> None:
        """On the sender thread: one transfer fully written (or failed)."""
        busy_s = rec.busy_ns / 1e9
        self.kv_events.append(
            KVTransferEvent(
                "send", rec.req_id, rec.first_ns, rec.end_ns, rec.trace_context, rec.kv_bytes, rec.num_blocks,
                rec.kv_bytes / busy_s if busy_s > 0 else 0.0, rec.peer, rec.error,
            )
        )  # fmt: skip

    # -- decode side -----------------------------------------------------------------------------
    def _reserve(self, req: EngineRequest) -> None:
        try:
            blocks = H.reserve_remote(self.core, req)
        except ValueError as e:
            self.channel.send(Error(req.req_id, str(e)))
            return
        if blocks is None:
            self.pending.append(req)
            return
        self.incoming[req.req_id] = _Incoming(req, time.monotonic_ns())
        self._take_frames(self.early.pop(req.req_id, []))

    def _reserve_pending(self) -> None:
        while self.pending:
            req = self.pending[0]
            if H.reserve_remote(self.core, req) is None:
                return
            self.pending.popleft()
            self.incoming[req.req_id] = _Incoming(req, time.monotonic_ns())
            self._take_frames(self.early.pop(req.req_id, []))

    def _take_frames(self, frames: list[Received]) -> None:
        for rec in frames:
            req_id = rec.frame.req_id
            inc = self.incoming.get(req_id)
            if inc is None:
                self.early.setdefault(req_id, []).append(rec)
                continue
            try:
                self._take(inc, rec)
            except (KeyError, ValueError, KVWireError) as e:
                self._fail(req_id, f"KV transfer failed: {e}")

    def _take(self, inc: _Incoming, rec: Received) -> None:
        frame, req_id = rec.frame, rec.frame.req_id
        inc.first_ns = inc.first_ns or rec.ts_ns
        inc.last_ns = rec.ts_ns
        if isinstance(frame, BlocksFrame):
            H.write_remote_kv(self.core, req_id, frame.first_block, frame.blocks)
            inc.kv_bytes += rec.kv_bytes
            inc.num_blocks += frame.num_blocks
        elif isinstance(frame, DoneFrame):
            if frame.kv_bytes != inc.kv_bytes or frame.num_blocks != inc.num_blocks:
                raise ValueError(
                    f"received {inc.kv_bytes} bytes in {inc.num_blocks} blocks, sent "
                    f"{frame.kv_bytes} in {frame.num_blocks}"
                )
            out = H.commit_remote(
                self.core, req_id, frame.first_token, frame.first_scheduled_ns, frame.num_cached_tokens
            )
            del self.incoming[req_id]
            self.transfers_received += 1
            self.ready_outputs.append(out)
            span_s = (inc.last_ns - inc.first_ns) / 1e9
            self.kv_events.append(
                KVTransferEvent(
                    "receive", req_id, inc.first_ns, out.timings.first_token_ns, inc.request.trace_context,
                    inc.kv_bytes, inc.num_blocks, inc.kv_bytes / span_s if span_s > 0 else 0.0,
                )
            )  # fmt: skip
        elif isinstance(frame, AbortFrame):
            pass  # the prefill worker ended it; the router aborts it here too

    def _expire(self) -> None:
        """Fail transfers that started and then went quiet for `kv_timeout_s` (a dead or stuck sender)."""
        now, limit = time.monotonic_ns(), self.kv_timeout_s * 1e9
        for req_id, inc in list(self.incoming.items()):
            if inc.first_ns and now - inc.last_ns > limit:
                self._fail(req_id, f"KV transfer timed out after {self.kv_timeout_s:g} s without data")
        for req_id, frames in list(self.early.items()):
            if now - frames[-1].ts_ns > limit:
                del self.early[req_id]  # frames of a request that was aborted or never came

    def _fail(self, req_id: str, message: str) -> None:
        self._forget(req_id)
        self.core.abort_request(req_id)
        self.channel.send(Error(req_id, message))

    def _forget(self, req_id: str) -> None:
        self.incoming.pop(req_id, None)
        self.early.pop(req_id, None)
        if self.pending and any(r.req_id == req_id for r in self.pending):
            self.pending = collections.deque(r for r in self.pending if r.req_id != req_id)
        out = self.outgoing.pop(req_id, None)
        if out is not None:
            self.sender.send_abort(req_id, "aborted")


def worker_info(loop: WorkerLoop, instance_id: str) -> dict[str, object]:
    """What the worker tells the router when it registers (beside the core's READY info)."""
    from engine.core_proc import ready_info

    info = ready_info(loop.core)
    info.update(role=loop.role, instance_id=instance_id, kv_dtype=loop.core.kv_dtype)
    if loop.receiver is not None:
        info["kv_addr"] = loop.receiver.address
    return info


def abort_all(loop: WorkerLoop) -> None:
    """The router is gone: drop every request (a rejoining worker starts clean, no blocks held)."""
    sched = loop.core.scheduler
    ids = [s.req_id for s in sched.live_sequences()] + [r.req_id for r in loop.pending]
    for req_id in dict.fromkeys(ids):
        loop._forget(req_id)
        loop.core.abort_request(req_id)
    while loop.core.has_unfinished_requests():
        loop.core.step()  # reports the aborts (nothing else is left to run)
    loop.core.drain_events()
    loop.ready_outputs.clear()
