"""What the OpenAI front end (engine/server.py) needs from "an engine": one interface, two implementations.

- `engine.core_client.AsyncEngineClient`: the local engine core process over a socket pair (colocated).
- `engine.disagg.router.DisaggClient`: prefill and decode workers behind a router (docs/disagg.md).

Both hand each request's outputs to an `OutputQueue` and report failures as `CoreError`s.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.protocol import EngineStats
    from engine.request import EngineRequest


class CoreError(Exception):
    """The core refused a request (`fatal=False`), or the core is gone (`fatal=True`)."""

    def __init__(self, message: str, fatal: bool = False, status: int | None = None) -> None:
        super().__init__(message)
        self.fatal = fatal
        self.status = status  # an HTTP status the client chose (503: no healthy worker of a role)


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
        self.kv_transfer_ns = 0  # disaggregated: prefill's first token -> the decode worker's commit


class EngineClient(Protocol):
    """The asyncio-side handle on an engine. `add` is synchronous so admission control stays exact."""

    info: dict[str, object]  # READY: model, max_model_len, vocab_size, eos/bos ids, block_size, ...

    @property
    def alive(self) -> bool: ...

    @property
    def stats(self) -> EngineStats: ...

    @property
    def num_inflight(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_kv_blocks(self) -> int: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def is_finished(self, req_id: str) -> bool: ...

    def add(self, req: EngineRequest) -> OutputQueue:
        """Send a request; its `RequestOutput`s (or a `CoreError`) arrive on the returned queue."""
        ...

    def abort(self, req_id: str) -> None: ...

    async def admin(self, changes: dict[str, object] | None) -> dict[str, object]: ...

    async def set_faults(self, settings: dict[str, object]) -> dict[str, object]: ...

    def health_report(self) -> dict[str, object] | None:
        """A JSON body for `/health` (its "status" "ok" or not), or None: `alive` alone decides."""
        ...

    def extra_metrics(self) -> str:
        """Prometheus lines appended to `/metrics` ("" for none)."""
        ...

    def watch_steps(self, observe: Callable[[int], None]) -> None:
        """Call `observe(tokens)` for every engine step the client hears of (with the tokens it
        scheduled); a client that hears of none never calls it."""
        ...
