"""The router's engine client: the OpenAI front end (engine/server.py) over prefill and decode workers.

    add(req) -> pick a decode worker by load -> Add(req) (it reserves blocks)
             -> pick a prefill worker by load -> Handoff(req, decode kv_addr)
    prefill Outputs "handoff"  -> phase transfer (deadline: kv_timeout_s)
    decode Outputs             -> the request's queue (the first token arrives with the committed KV)

Workers register by connecting to the router's worker port and sending READY (role, KV address, model);
then Outputs, Error and WorkerStats frames flow (engine/protocol.py). A worker whose connection closes is
dead: requests that have not streamed a token are retried on other workers (under a new wire id, so a
dead worker's late frames cannot touch the retry); the others fail with a clear error. A worker silent
for `stale_after_s` is unhealthy (not picked) until it speaks again. `alive` needs one healthy worker
of each role; `/health` lists them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

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
    Handoff,
    Message,
    Outputs,
    ProtocolError,
    Ready,
    Shutdown,
    WorkerStats,
    frame,
    get_codec,
)
from engine.request import EngineRequest

ROLES = ("prefill", "decode")
_SENDER_KEYS = ("kv_bytes_sent", "kv_transfers_sent", "kv_send_seconds")  # prefill workers' counters
ADMIN_TIMEOUT_S = 30.0  # a worker busy with a long step answers between steps


@dataclass(eq=False)
class WorkerHandle:
    """One registered worker as the router sees it."""

    worker_id: str
    role: str
    info: dict[str, object]
    writer: asyncio.StreamWriter
    codec: Codec = field(default_factory=Codec)
    stats: EngineStats = field(default_factory=EngineStats)
    counters: dict[str, object] = field(default_factory=dict)  # the latest WorkerStats
    last_seen: float = field(default_factory=time.monotonic)
    state: str = "healthy"  # healthy | unhealthy (silent) | dead (connection closed)
    assigned: set[str] = field(default_factory=set)  # wire ids of requests it holds

    @property
    def kv_addr(self) -> str:
        return str(self.info.get("kv_addr", ""))

    def send(self, msg: Message) -> None:
        if self.state != "dead":
            self.writer.write(frame(self.codec.encode(msg)))

    def report(self) -> dict[str, object]:
        c = self.counters
        keys = ("running", "waiting", "reserved", "kv_blocks_free", "kv_blocks_total")
        out = {"id": self.worker_id, "role": self.role, "state": self.state, "pid": self.info.get("pid")}
        out.update({k: c[k] for k in keys if k in c})
        out["seen_s_ago"] = round(time.monotonic() - self.last_seen, 3)
        out["kv_addr"] = self.kv_addr or None
        return out


@dataclass(eq=False)
class _Route:
    """A request in flight: where it is and what the client has seen."""

    req: EngineRequest
    queue: OutputQueue
    wire_id: str = ""
    prefill: WorkerHandle | None = None
    decode: WorkerHandle | None = None
    phase: str = "prefill"  # prefill | transfer | decode
    handoff_ns: int = 0  # the prefill worker sampled the first token (monotonic)
    deadline: float = 0.0  # transfer phase: fail or retry after this (monotonic s)
    tokens_sent: bool = False
    attempts: int = 0


class DisaggClient:
    """The front end's engine client over workers (the same surface as `AsyncEngineClient`)."""

    def __init__(self, host: str, port: int, kv_timeout_s: float = 30.0, stale_after_s: float = 15.0) -> None:
        self.host, self.port, self.kv_timeout_s, self.stale_after_s = host, port, kv_timeout_s, stale_after_s
        self.workers: list[WorkerHandle] = []
        self.gone: list[dict[str, object]] = []  # the last dead workers, for /health
        self.routes: dict[str, _Route] = {}  # by the client-facing request id
        self.by_wire: dict[str, _Route] = {}
        self.info: dict[str, object] = {}
        self.retries = self.failures = self.handoffs = 0
        self._admin_seq = 0
        self._admin: dict[int, asyncio.Future[AdminReply]] = {}
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._registered = asyncio.Event()

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Listen for workers (idempotent: `serve --disagg` starts it before the HTTP app)."""
        if self._server is None:
            self._server = await asyncio.start_server(self._on_worker, self.host, self.port)
            self.port = self._server.sockets[0].getsockname()[1]
            self._spawn(self._watchdog())

    async def wait_for_workers(self, num_prefill: int, num_decode: int, timeout_s: float) -> None:
        """Until that many workers of each role are registered; TimeoutError otherwise."""
        deadline = time.monotonic() + timeout_s
        while self._count("prefill") < num_prefill or self._count("decode") < num_decode:
            if time.monotonic() > deadline:
                have = f"{self._count('prefill')}/{num_prefill} prefill, {self._count('decode')}/{num_decode}"
                raise TimeoutError(f"{have} decode workers registered in time")
            self._registered.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._registered.wait(), 0.5)

    async def close(self) -> None:
        for w in self.workers:
            w.send(Shutdown())
            with contextlib.suppress(OSError):
                await w.writer.drain()
            w.writer.close()
        if self._server is not None:
            self._server.close()
        for task in self._tasks:
            task.cancel()

    # -- the engine-client surface ---------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """Requests are admitted while each role has a connected worker (a silent one may be in a long
        step); `/health` is stricter: 503 unless each role has a healthy one."""
        return all(any(w.role == role for w in self.workers) for role in ROLES)

    @property
    def stats(self) -> EngineStats:
        total = EngineStats()
        for w in self._healthy():
            for name in EngineStats.__slots__:
                setattr(total, name, getattr(total, name) + getattr(w.stats, name))
        total.kv_usage = total.kv_blocks_used / total.kv_blocks_total if total.kv_blocks_total else 0.0
        return total

    @property
    def num_inflight(self) -> int:
        return len(self.routes)

    @property
    def num_waiting(self) -> int:
        s = self.stats
        return max(s.waiting, len(self.routes) - s.running)

    @property
    def num_kv_blocks(self) -> int:
        """The smallest pool a prompt must fit (every worker holds it whole)."""
        pools = [w.stats.kv_blocks_total or int(w.info["num_kv_blocks"]) for w in self._healthy()]
        return min(pools) if pools else sys.maxsize

    def is_finished(self, req_id: str) -> bool:
        return req_id not in self.routes

    def add(self, req: EngineRequest) -> OutputQueue:
        """Route a request; its outputs arrive on the returned queue (synchronous, like the local one)."""
        queue = OutputQueue()
        route = self.routes[req.req_id] = _Route(req, queue)
        self._dispatch(route)
        return queue

    def abort(self, req_id: str) -> None:
        route = self.routes.pop(req_id, None)
        if route is not None:
            self._release(route)

    async def admin(self, changes: dict[str, object] | None) -> dict[str, object]:
        """Read or change the limits on every worker; the decode workers' answer is returned."""
        make = (lambda seq: AdminGet(seq)) if changes is None else (lambda seq: AdminSet(seq, changes))
        replies = await self._ask_all(make)
        return replies[-1].payload

    async def set_faults(self, settings: dict[str, object]) -> dict[str, object]:
        """Switch the engine-side faults on every worker (kv_transfer_mbps throttles the prefill senders)."""
        replies = await self._ask_all(lambda seq: FaultSet(seq, settings))
        codec = get_codec(str(replies[-1].payload["rpc_codec"]))
        for w in self._healthy():
            w.codec = codec
        return replies[-1].payload

    def watch_steps(self, observe: Callable[[int], None]) -> None:
        """Steps happen in the workers, whose own /metrics pages count them: none reach the router."""

    def health_report(self) -> dict[str, object]:
        roles = {role: self._count(role) for role in ROLES}
        workers = [w.report() for w in self.workers] + self.gone
        return {
            "status": "ok" if all(roles.values()) else "unhealthy",
            "healthy_workers": roles,
            "register": f"{self.host}:{self.port}",  # where workers (`serve --role ... --router`) connect
            "workers": workers,
        }

    def extra_metrics(self) -> str:
        """Prometheus lines of the disaggregated deployment (appended to /metrics)."""
        lines = ["# TYPE stepscope:disagg_workers gauge"]
        for role in ROLES:
            for state in ("healthy", "unhealthy"):
                n = sum(1 for w in self.workers if w.role == role and w.state == state)
                lines.append(f'stepscope:disagg_workers{{role="{role}",state="{state}"}} {n}')
        for name, key in (
            ("stepscope:kv_transfer_bytes_sent_total", "kv_bytes_sent"),
            ("stepscope:kv_transfer_bytes_received_total", "kv_bytes_received"),
            ("stepscope:kv_transfers_sent_total", "kv_transfers_sent"),
            ("stepscope:kv_transfers_received_total", "kv_transfers_received"),
            ("stepscope:kv_transfer_send_seconds_total", "kv_send_seconds"),
        ):
            lines.append(f"# TYPE {name} counter")
            for w in self.workers:
                if key in w.counters and (w.role == "prefill") == (key in _SENDER_KEYS):
                    lines.append(f'{name}{{instance="{w.worker_id}",role="{w.role}"}} {w.counters[key]}')
        for name, value in (("retries", self.retries), ("failures", self.failures)):
            metric = f"stepscope:disagg_{name}_total"
            lines += [f"# TYPE {metric} counter", f"{metric} {value}"]
        return "\n".join(lines) + "\n"

    # -- routing -------------------------------------------------------------------------------
    def _dispatch(self, route: _Route) -> None:
        decode = self._pick("decode", route.req)
        prefill = self._pick("prefill", route.req)
        if decode is None or prefill is None:
            missing = "decode" if decode is None else "prefill"
            self._fail(route, f"no healthy {missing} worker", status=503)
            return
        rid = route.req.req_id
        route.wire_id = f"{rid}.retry{route.attempts}" if route.attempts else rid
        req = dataclasses.replace(route.req, req_id=route.wire_id)
        route.prefill, route.decode, route.phase = prefill, decode, "prefill"
        self.by_wire[route.wire_id] = route
        for w in (prefill, decode):
            w.assigned.add(route.wire_id)
        decode.send(Add(req))  # first: it reserves blocks for the KV that will come
        prefill.send(Handoff(req, decode.kv_addr))

    def _pick(self, role: str, req: EngineRequest) -> WorkerHandle | None:
        """By load: decode workers by free blocks after what they already hold, then fewest sequences;
        prefill workers by fewest requests in hand."""
        candidates = [w for w in self._healthy() if w.role == role]
        candidates = candidates or [w for w in self.workers if w.role == role]  # silent beats none
        if not candidates:
            return None
        if role == "prefill":
            return min(candidates, key=lambda w: (len(w.assigned), w.stats.waiting))
        need = -(-(len(req.prompt_token_ids) + 1) // int(self.info.get("block_size", 16)))

        def load(w: WorkerHandle) -> tuple[int, int, int]:
            free = int(w.counters.get("kv_blocks_free", w.stats.kv_blocks_total - w.stats.kv_blocks_used))
            return (free < need, len(w.assigned), -free)

        return min(candidates, key=load)

    def _retry_or_fail(self, route: _Route, reason: str) -> None:
        """No token sent yet and not retried twice: again on other workers; otherwise fail it."""
        self._release(route)
        if route.tokens_sent or route.attempts >= 2:
            self._fail(route, reason)
            return
        route.attempts += 1
        self.retries += 1
        print(f"stepscope router: retrying {route.req.req_id}: {reason}", file=sys.stderr)
        self._dispatch(route)

    def _release(self, route: _Route) -> None:
        """Forget the route's current attempt on its workers (abort where it may still hold blocks)."""
        self.by_wire.pop(route.wire_id, None)
        for w in (route.prefill, route.decode):
            if w is not None and route.wire_id in w.assigned:
                w.assigned.discard(route.wire_id)
                w.send(Abort([route.wire_id]))

    def _fail(self, route: _Route, reason: str, status: int | None = None) -> None:
        if self.routes.pop(route.req.req_id, None) is not None:
            self.failures += 1
            route.queue.put_nowait(CoreError(reason, fatal=True, status=status))

    # -- worker connections --------------------------------------------------------------------
    async def _on_worker(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frames, codec, worker = FrameBuffer(), Codec(), None
        try:
            while data := await reader.read(1 << 16):
                for body in frames.feed(data):
                    msg = (worker.codec if worker else codec).decode(body)
                    if worker is None:
                        worker = self._register(msg, writer)
                    else:
                        self._on_message(worker, msg)
        except (OSError, ProtocolError, ValueError) as e:
            print(f"stepscope router: worker connection failed: {e}", file=sys.stderr)
        finally:
            writer.close()
            if worker is not None:
                self._on_dead(worker)

    def _register(self, msg: Message, writer: asyncio.StreamWriter) -> WorkerHandle:
        if not isinstance(msg, Ready) or msg.info.get("role") not in ROLES:
            raise ValueError("a worker must register with READY naming its role")
        info = msg.info
        if info["role"] == "decode" and not info.get("kv_addr"):
            raise ValueError("a decode worker must advertise its KV address")
        if self.info and (info["model"], info["block_size"]) != (self.info["model"], self.info["block_size"]):
            raise ValueError(f"worker serves {info['model']} (block {info['block_size']}), not this model")
        self.info = self.info or dict(info)
        worker_id = str(info.get("instance_id") or info.get("pid"))
        worker = WorkerHandle(worker_id, str(info["role"]), info, writer)
        worker.stats.kv_blocks_total = int(info["num_kv_blocks"])
        self.workers.append(worker)
        print(f"stepscope router: {worker.role} worker {worker.worker_id} registered", file=sys.stderr)
        self._registered.set()
        return worker

    def _on_message(self, worker: WorkerHandle, msg: Message) -> None:
        worker.last_seen = time.monotonic()
        if worker.state == "unhealthy":
            worker.state = "healthy"
        if isinstance(msg, Outputs):
            worker.stats = msg.stats
            for out in msg.outputs:
                route = self.by_wire.get(out.req_id)
                if route is not None:
                    self._on_output(worker, route, out)
        elif isinstance(msg, WorkerStats):
            worker.counters = msg.stats
        elif isinstance(msg, Error):
            route = self.by_wire.get(msg.req_id)
            if route is None:
                return
            if msg.message.startswith("KV transfer"):
                self._retry_or_fail(route, f"{worker.role} worker {worker.worker_id}: {msg.message}")
            else:  # the request itself was refused: a client error
                self._release(route)
                if self.routes.pop(route.req.req_id, None) is not None:
                    route.queue.put_nowait(CoreError(msg.message))
        elif isinstance(msg, AdminReply):
            future = self._admin.pop(msg.seq, None)
            if future is not None and not future.done():
                future.set_result(msg)

    def _on_output(self, worker: WorkerHandle, route: _Route, out: object) -> None:
        if worker is route.prefill and route.phase == "prefill":
            if out.finish_reason == "handoff":
                route.phase, route.handoff_ns = "transfer", out.timings.first_token_ns
                route.deadline = time.monotonic() + self.kv_timeout_s
                worker.assigned.discard(route.wire_id)
                self.handoffs += 1
                return
            if not out.finished or out.finish_reason == "abort":
                return
            worker.assigned.discard(route.wire_id)  # ended at its first token: nothing to transfer
            self._release(route)
            route.prefill = route.decode = None
        elif worker is route.decode:
            if route.phase != "decode" and route.handoff_ns and out.timings.first_token_ns:
                route.queue.kv_transfer_ns = max(out.timings.first_token_ns - route.handoff_ns, 0)
            route.phase = "decode"
        else:
            return
        out.req_id = route.req.req_id
        if out.new_token_ids:
            route.tokens_sent = True
            if out.timings.last_token_ns:
                route.queue.rpc_delay.observe(max(time.monotonic_ns() - out.timings.last_token_ns, 0))
        route.queue.put_nowait(out)
        if out.finished:
            self.routes.pop(route.req.req_id, None)
            self.by_wire.pop(route.wire_id, None)
            if route.decode is not None:
                route.decode.assigned.discard(route.wire_id)

    def _on_dead(self, worker: WorkerHandle) -> None:
        if worker.state == "dead":
            return
        worker.state = "dead"
        self.workers.remove(worker)
        self.gone = [*self.gone, worker.report()][-16:]
        print(f"stepscope router: {worker.role} worker {worker.worker_id} is gone", file=sys.stderr)
        for wire_id in list(worker.assigned):
            route = self.by_wire.get(wire_id)
            if route is not None:
                self._retry_or_fail(route, f"the {worker.role} worker {worker.worker_id} died mid-request")
        for future in self._admin.values():
            if not future.done():
                future.set_exception(CoreError(f"worker {worker.worker_id} died", fatal=True))

    async def _watchdog(self) -> None:
        """Transfer deadlines and stale workers, four times a second."""
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            for route in list(self.by_wire.values()):
                if route.phase == "transfer" and now > route.deadline:
                    self._retry_or_fail(route, f"KV transfer timed out after {self.kv_timeout_s:g} s")
            for w in self.workers:
                if w.state == "healthy" and now - w.last_seen > self.stale_after_s:
                    w.state = "unhealthy"
                    print(f"stepscope router: {w.role} worker {w.worker_id} is silent", file=sys.stderr)

    async def _ask_all(self, make: object) -> list[AdminReply]:
        workers = sorted(self._healthy(), key=lambda w: w.role == "decode")
        if not workers:
            raise CoreError("no healthy worker", fatal=True)
        futures = []
        for w in workers:
            self._admin_seq += 1
            future = self._admin[self._admin_seq] = asyncio.get_running_loop().create_future()
            w.send(make(self._admin_seq))
            futures.append(future)
        try:
            replies = await asyncio.wait_for(asyncio.gather(*futures), ADMIN_TIMEOUT_S)
        except TimeoutError:
            raise CoreError("a worker did not answer the admin request in time", fatal=True) from None
        for reply in replies:
            if not reply.ok:
                raise ValueError(reply.payload.get("error", "refused"))
        return list(replies)

    # -- helpers -------------------------------------------------------------------------------
    def _healthy(self) -> list[WorkerHandle]:
        return [w for w in self.workers if w.state == "healthy"]

    def _count(self, role: str) -> int:
        return sum(1 for w in self._healthy() if w.role == role)

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
