"""What the OpenAI front end (engine/server.py) needs from "an engine": one interface, two implementations.

- `engine.core_proc.AsyncEngineClient`: the local engine core process over a socket pair (colocated).
- `engine.disagg.router.DisaggClient`: prefill and decode workers behind a router (docs/disagg.md).

Optional extras the server uses when present: `health_report()` (a JSON body for `/health`) and
`extra_metrics()` (Prometheus lines appended to `/metrics`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.core_proc import OutputQueue
    from engine.protocol import EngineStats
    from engine.request import EngineRequest


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
