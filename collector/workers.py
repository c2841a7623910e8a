"""Trace conversion in worker processes, off the receiving process's GIL.

    request thread: payload bytes --pipe--> worker: parse, spans -> Arrow columns, Arrow IPC
                    Batch (zero-copy read of the IPC bytes) <--pipe--

Converting spans to columns is the collector's largest cost in Python (collector/traces.py), and in one
process it shares the GIL with HTTP, the spool and the insert thread. In a worker process it runs beside
them, on the other core, while ClickHouse inserts and merges release the GIL anyway. The worker raises the
same PayloadError as the in-process converter, so the answer to a bad payload is the same 400.

Workers are spawned (not forked: the parent holds chDB and threads). A worker that dies fails its
requests over to in-process conversion, and the pool is started again.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import BrokenExecutor, ProcessPoolExecutor

import pyarrow as pa

from collector import convert

log = logging.getLogger(__name__)


def traces_ipc(payload: bytes) -> tuple[pa.Buffer, int, list[str]]:
    """In a worker: an ExportTraceServiceRequest's bytes -> its otel_traces rows as Arrow IPC bytes, the
    number of spans rejected and why. Raises PayloadError for a payload the receiver must refuse."""
    batch = convert.traces_payload(payload)
    table = batch.tables["otel_traces"]
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue(), batch.rejected, batch.errors


def _ready() -> bool:
    return True


def _exit_with(parent_pid: int) -> None:
    """In a worker: exit once the collector is gone, even after a `kill -9` that reached it alone."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class ConvertPool:
    """`workers` processes converting trace payloads; `traces()` blocks the calling thread (not the GIL)."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError("a ConvertPool needs at least one worker")
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Spawn the workers and have each import its modules now, not on the first request."""
        with self._lock:
            if self._pool is None:
                spawn = multiprocessing.get_context("spawn")
                self._pool = ProcessPoolExecutor(
                    self.workers, mp_context=spawn, initializer=_exit_with, initargs=(os.getpid(),)
                )
                for _ in range(self.workers):
                    self._pool.submit(_ready)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def traces(self, payload: bytes) -> convert.Batch:
        """The otel_traces rows of one canonical ExportTraceServiceRequest payload (as convert.traces)."""
        pool = self._pool
        if pool is None:
            return convert.traces_payload(payload)
        try:
            ipc, rejected, errors = pool.submit(traces_ipc, payload).result()
        except BrokenExecutor:
            log.warning("a conversion worker died; converting in-process and starting the pool again")
            self._restart(pool)
            return convert.traces_payload(payload)
        table = pa.ipc.open_stream(ipc).read_all()
        batch = convert.Batch(tables={"otel_traces": table}, columns={"otel_traces": convert.TRACE_COLUMNS})
        batch.rejected, batch.errors = rejected, errors
        return batch

    def _restart(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is not broken:
                return  # another thread did it already
            self._pool = None
        broken.shutdown(wait=False, cancel_futures=True)
        self.start()
