"""Spans decoded once, when they arrive, and held in memory until their group is inserted.

Before it acknowledges an export request, the request thread feeds it into one shared decoder
(collector/spans.py): the decode is also the check that refuses what does not parse. The rows stay in the
decoder's buffers. When the insert thread forms a group, it takes everything fed so far as one Arrow table
(a generation) and inserts the slices of it that belong to the group's entries: no second decode, no copy.
A generation is dropped once every request fed into it is inserted or refused; the rows of a request whose
spooling failed are never referenced.

    ticket, batch = held.feed(payload)            # ticket None: over the bound, only checked
    held.attach(name, ticket)                     # before the spool publishes the entry `name`
    names, tables = held.take(names)              # the held rows of those entries, a table per generation
    held.release(names)                           # after the insert (or when the entries are dropped)

At most `max_rows` rows are held; past that a request is only checked, and its spans are decoded again
from the spool at insert, as after a restart.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import NamedTuple

import pyarrow as pa

from collector import convert, spans


class Ticket(NamedTuple):
    """Where one request's rows are: rows [start, end) of generation `generation`."""

    generation: int
    start: int
    end: int


class HeldSpans:
    """The rows of acknowledged, not yet inserted span batches, decoded once. Thread-safe."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self._decoder = spans.SpanDecoder()
        self._lock = threading.Lock()
        self._generation = 0  # the generation the decoder is filling
        self._tables: dict[int, pa.Table] = {}  # generations taken out of the decoder
        self._refs: dict[int, int] = {}  # generation -> tickets given out and not released
        self._entries: dict[str, Ticket] = {}  # spool entry name -> its rows
        self._rows = 0  # rows of the tickets not released

    @property
    def rows(self) -> int:
        return self._rows

    def feed(self, payload: bytes) -> tuple[Ticket | None, convert.Batch]:
        """Decode one ExportTraceServiceRequest and hold its rows: (ticket, its counts as
        `convert.check_traces` gives them). The ticket is None when the request has no row to hold or the
        bound is reached (then it was only checked). PayloadError, with nothing held, if the bytes are not
        a valid request."""
        with self._lock:
            if self._rows < self.max_rows:
                start = self._decoder.rows
                rejected = self._decoder.feed(payload)
                end = self._decoder.rows
                if end == start:
                    return None, convert.trace_batch(None, rejected)
                ticket = Ticket(self._generation, start, end)
                self._refs[ticket.generation] = self._refs.get(ticket.generation, 0) + 1
                self._rows += end - start
                return ticket, convert.trace_batch(None, rejected, deferred_rows=end - start)
        return None, convert.check_traces(payload)

    def attach(self, name: str, ticket: Ticket) -> None:
        """Name the spool entry that holds the request `ticket` came from."""
        with self._lock:
            self._entries[name] = ticket

    def drop(self, ticket: Ticket, name: str | None = None) -> None:
        """Forget a request that was not acknowledged (its spooling failed)."""
        with self._lock:
            if name is not None:
                self._entries.pop(name, None)
            self._unref(ticket)

    def rows_of(self, name: str) -> int | None:
        ticket = self._entries.get(name)
        return None if ticket is None else ticket.end - ticket.start

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def take(self, names: Iterable[str]) -> tuple[set[str], list[pa.Table]]:
        """The held rows of those of `names` that have them: (those names, a table per generation they were
        fed in). Each table is slices of its generation as they are, chunks sharing its dictionaries;
        `convert.merge` makes tables of several generations one block."""
        with self._lock:
            tickets = [(name, self._entries[name]) for name in names if name in self._entries]
            if any(t.generation == self._generation for _, t in tickets):
                self._tables[self._generation] = self._decoder.table()
                self._generation += 1
            generations = {t.generation: self._tables[t.generation] for _, t in tickets}
        out = []
        for generation, table in sorted(generations.items()):
            runs: list[list[int]] = []  # adjacent rows in one slice
            for start, end in sorted((t.start, t.end) for _, t in tickets if t.generation == generation):
                if runs and start == runs[-1][1]:
                    runs[-1][1] = end
                else:
                    runs.append([start, end])
            pieces = [table.slice(start, end - start) for start, end in runs]
            out.append(pieces[0] if len(pieces) == 1 else pa.concat_tables(pieces))
        return {name for name, _ in tickets}, out

    def release(self, names: Iterable[str]) -> None:
        """Forget the rows of entries that were inserted (or set aside)."""
        with self._lock:
            for name in names:
                ticket = self._entries.pop(name, None)
                if ticket is not None:
                    self._unref(ticket)

    def _unref(self, ticket: Ticket) -> None:
        self._rows -= ticket.end - ticket.start
        generation = ticket.generation
        left = self._refs[generation] - 1
        if left:
            self._refs[generation] = left
            return
        del self._refs[generation]
        self._tables.pop(generation, None)
        if generation == self._generation:  # every row in the decoder is unreferenced: start it afresh
            self._decoder.reset()
