"""Acknowledge a batch once it is fsynced to the spool; insert spooled batches into the store in groups.

    request -> decode (held) -> spool.put (fsync) -> ack
                                        |
    insert thread: pending entries -> group manifest (fsync) -> the group's held rows as one Arrow table
                   -> one insert per table (group token) -> remove entries, then the manifest

Every batch takes the same road, so "acknowledged" always means "on disk", whether the store is up, slow or
unreachable, and the store sees few large inserts instead of many small ones: ClickHouse's cost per insert
(a part per table and per view) is what limits a row-at-a-time pipeline, not the rows. A group replayed
after a crash carries the token it was recorded with, so ClickHouse drops what had already gone in.

Spans go through the compiled decoder (collector/spans.py) once, in the request thread before the
acknowledgement: the decode refuses what does not parse and counts what is rejected, and its rows are held
in memory (collector/held.py, up to HELD_MAX_ROWS) until their group is inserted, as slices of one table
with no copy. What is not held (spooled before a restart, or past the bound) is decoded straight from the
spooled bytes of a whole group, mostly in a helper thread while the previous group is being inserted.
Without a C compiler spans are converted in Python when they arrive (in `--convert-workers` processes),
kept in memory up to CACHE_MAX_ROWS and merged per group, as metrics and logs are.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collector import convert, otlp, sglang, spans
from collector.held import HeldSpans
from collector.spool import Entry, Spool, SpoolFull
from collector.store import Store, StoreError, StoreUnavailable
from collector.workers import ConvertPool

log = logging.getLogger(__name__)

# Rows per insert; bounds the memory of one insert (the group's columns are held about five times over
# while ClickHouse takes them: decoded, Arrow IPC, the client's copy, chDB's read and its columns).
GROUP_MAX_ROWS = 50_000
CACHE_MAX_ROWS = 500_000  # converted rows kept in memory for the insert thread; past it, re-decoded from disk
HELD_MAX_ROWS = 100_000  # spans decoded on arrival and held (about 90 MB); past it, decoded again at insert
# A group under GROUP_MIN_ROWS waits for more while batches keep coming (the newest is under QUIET_S old),
# for up to LINGER_MAX_S after its oldest. ClickHouse's CPU per row is several times higher in inserts of a
# few thousand rows than of 20,000 (a part per table and view, then merges of those parts: docs/collector.md),
# so a steady stream is grouped into large inserts (also when a loaded machine stalls it for a moment), and
# the end of a burst is inserted QUIET_S after it.
# With no request in flight the stream has likely ended, so IDLE_QUIET_S is enough.
GROUP_MIN_ROWS = 20_000
QUIET_S = 0.5
IDLE_QUIET_S = 0.05
LINGER_MAX_S = 2.0
MAX_ATTEMPTS = 5  # store errors (not outages) on one group before it is split, or one batch set aside


class Backpressure(Exception):
    """Refuse for now (429 or 503) and tell the client when to retry."""

    def __init__(self, status: int, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to one export request: how many items were rejected, and why."""

    rejected: int
    error_message: str


class Ingestor:
    """Owns the store connection, the spool and the insert thread of one collector."""

    def __init__(
        self,
        dsn: str,
        spool: Spool,
        *,
        ttl_days: int = 0,
        max_inflight: int = 64,
        retry_after_s: int = 2,
        convert_workers: int = 0,
    ) -> None:
        self.dsn = dsn
        self.spool = spool
        self.ttl_days = ttl_days
        self.max_inflight = max_inflight
        self.retry_after_s = retry_after_s
        self.store: Store | None = None
        self.store_error = ""
        self._healthy = False
        self._inflight = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cache: dict[str, convert.Batch] = {}  # spool file name -> its columns
        self._cached_rows = 0
        self._sizes: dict[str, int] = {}  # spool file name -> rows, of batches decoded at insert
        self._native = False  # spans through the compiled decoder (set in start())
        self._held: HeldSpans | None = None  # spans decoded on arrival, until inserted (with the decoder)
        self._finishing = False
        self.sglang_groups = 0  # groups inserted with SGLang request roots (the SGLang assembler waits)
        self._attempts: dict[str, int] = {}
        self._alone: set[str] = set()  # entries to insert one by one after their group kept failing
        self._convert_workers = convert_workers
        self._workers: ConvertPool | None = None
        self._helper: ThreadPoolExecutor | None = None  # decodes the next group during an insert
        self._ahead: tuple[list[Entry], Future] | None = None

    # --- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Open the spool and the store, then start inserting. A server that does not answer is not
        fatal (batches spool until it does); a chDB directory held by another process is (StoreError)."""
        self.spool.open()
        self._native = spans.available()
        if self._native and self._held is None:
            self._held = HeldSpans(HELD_MAX_ROWS)
        if self._convert_workers > 0 and not self._native:  # the compiled decoder needs no workers
            self._workers = ConvertPool(self._convert_workers)
            self._workers.start()
        try:
            self._connect()
        except StoreUnavailable as e:
            log.warning("%s; spooling until it answers", e)
            self.store_error = str(e)
        self._thread = threading.Thread(target=self._insert_loop, name="spool-insert", daemon=True)
        self._thread.start()

    def stop(self, drain_timeout_s: float = 10.0) -> None:
        """Insert what is spooled (for up to `drain_timeout_s`), stop, close the store. What is left
        stays spooled for the next start."""
        deadline = time.monotonic() + drain_timeout_s
        while self.spool.count and self._healthy and time.monotonic() < deadline:
            self._wake.set()
            time.sleep(0.05)
        self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join(timeout=60)
        if self.store:
            self.store.close()
            self.store = None
        if self._workers:
            self._workers.close()
        if self._helper:
            self._helper.shutdown(wait=True, cancel_futures=True)
            self._helper, self._ahead = None, None

    def status(self) -> dict[str, object]:
        return {
            "store": "up" if self._healthy else "down",
            "store_error": self.store_error,
            "spooled_batches": self.spool.count,
            "spooled_bytes": self.spool.bytes_used,
            "failed_batches": self.spool.failed_count(),
        }

    def wait_drained(self, timeout_s: float) -> bool:
        """Block until nothing is spooled and no group is left half cleaned up (True) or `timeout_s`
        passes (False)."""
        deadline = time.monotonic() + timeout_s
        while (self.spool.count or self._finishing) and time.monotonic() < deadline:
            self._wake.set()
            time.sleep(0.02)
        return not (self.spool.count or self._finishing)

    # --- ingest ---------------------------------------------------------------------------------------
    def submit(self, signal: str, decoded: otlp.Decoded) -> Outcome:
        """Make one decoded export request durable (fsynced to the spool) and return what was rejected.
        Raises Backpressure when too many requests are in flight or the spool is full."""
        with self._lock:
            if self._inflight >= self.max_inflight:
                raise Backpressure(429, "too many concurrent export requests", self.retry_after_s)
            self._inflight += 1
        try:
            ticket = None
            if signal == "traces" and self._held is not None:
                ticket, batch = self._held.feed(decoded.payload)
            else:
                batch = self._convert(signal, decoded.message, decoded.payload)
            if batch.tables or batch.deferred_rows:
                token, arrival_ns = batch_token(signal, decoded.payload), time.time_ns()
                if ticket is not None:  # named before the spool shows the entry to the insert thread
                    name = self.spool.name_of(signal, token, arrival_ns)
                    self._held.attach(name, ticket)
                try:
                    entry = self.spool.put(signal, token, decoded.payload, arrival_ns)
                except BaseException as e:
                    if ticket is not None:
                        self._held.drop(ticket, name)
                    if isinstance(e, SpoolFull):
                        detail = f"{e}; the store is {self.store_error or 'behind'}"
                        raise Backpressure(503, detail, self.retry_after_s * 5) from e
                    raise
                rows = _rows(batch)
                with self._lock:  # held rows are sized by self._held
                    if ticket is None and batch.deferred_rows:
                        self._sizes[entry.path.name] = batch.deferred_rows
                    elif ticket is None and self._cached_rows + rows <= CACHE_MAX_ROWS:
                        self._cache[entry.path.name] = batch
                        self._cached_rows += rows
                self._wake.set()
            return Outcome(batch.rejected, batch.error_message)
        finally:
            with self._lock:
                self._inflight -= 1
                idle = not self._inflight
            if idle:  # a lingering group may go in now (_linger_s)
                self._wake.set()

    # --- the insert thread ----------------------------------------------------------------------------
    def _insert_loop(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                progressed = self._insert_once()
            except StoreError as e:
                self._mark_down(e)
                progressed = False
            except Exception:  # the thread must outlive any surprise; the batches stay spooled
                log.exception("inserting spooled batches failed")
                progressed = False
            if progressed:
                backoff = 0.1
                continue
            idle = not self.spool.count and self._healthy
            self._wake.wait(timeout=1.0 if idle else backoff)
            self._wake.clear()
            backoff = 0.1 if idle else min(backoff * 2, 10.0)

    def _insert_once(self) -> bool:
        """Finish recorded groups, then group and insert pending entries. True if anything went in, or if
        a small group waited for more (waiting is no failure: the loop must not back off after it)."""
        store = self.store or self._connect()
        progressed = False
        for manifest, token, entries in self.spool.groups():
            progressed |= self._insert_group(store, manifest, token, entries)
        pending = self.spool.pending()
        if not pending:
            if not self._healthy:  # nothing to insert: probe the store so /health tells the truth
                store.query("SELECT 1")
                self._set_up()
            return progressed
        linger_s = self._linger_s(pending)
        if linger_s > 0:  # woken early by each new batch, to see whether the group is large enough now
            self._wake.wait(timeout=linger_s)
            self._wake.clear()
            return True
        group, rows = [], 0
        for entry in pending:
            if entry.path.name in self._alone:
                if not group:
                    group = [entry]
                break
            group.append(entry)
            rows += self._rows_of(entry)
            if rows >= GROUP_MAX_ROWS or self._stop.is_set():
                break
        token = batch_token("group", "".join(e.token for e in group).encode())
        manifest = self.spool.write_group(token, group)
        return self._insert_group(store, manifest, token, group, pending) or progressed

    def _linger_s(self, pending: list[Entry]) -> float:
        """How long the pending entries may wait for more before they go in as a group (0: now)."""
        if self._stop.is_set() or any(e.path.name in self._alone for e in pending):
            return 0.0
        now = time.time_ns()
        oldest_age_s = (now - int(pending[0].path.name[:20])) / 1e9
        newest_age_s = (now - int(pending[-1].path.name[:20])) / 1e9
        quiet_s = QUIET_S if self._inflight else IDLE_QUIET_S
        wait_s = min(LINGER_MAX_S - oldest_age_s, quiet_s - newest_age_s)
        if wait_s <= 0 or sum(map(self._rows_of, pending)) >= GROUP_MIN_ROWS:
            return 0.0
        return wait_s

    def _insert_group(
        self, store: Store, manifest: Path, token: str, entries: list[Entry], pending: Sequence[Entry] = ()
    ) -> bool:
        """Insert one recorded group; with `pending` (the spool's entries the group was taken from), the
        rest of them start decoding beside the insert."""
        if not entries:
            self.spool.drop_group(manifest)
            return False
        batches = self._batches_of(entries)
        merged = convert.merge(batches) if batches else convert.Batch()
        self._decode_ahead(entries, pending)  # beside this insert, on the other core: the next group
        try:
            for table, columns in merged.tables.items():
                store.insert(table, merged.columns[table], columns, token=token)
        except StoreUnavailable:
            raise
        except StoreError as e:
            self._count_failure(manifest, token, entries, e)
            return False
        log.debug("inserted a group of %d batches, %d rows", len(entries), _rows(merged))
        self._finishing = True  # the entries go before the manifest: not drained until both have
        try:
            self.spool.finish_group(manifest, entries)
        finally:
            self._finishing = False
        self._forget(entries)
        spans_table = merged.tables.get("otel_traces")
        if spans_table is not None and sglang.has_roots(spans_table):
            self.sglang_groups += 1
        self._set_up()
        return True

    def _decode_ahead(self, group: list[Entry], pending: Sequence[Entry]) -> None:
        """Start decoding the spooled spans of `pending` that are not in `group` (at most a group's worth)
        in a helper thread, while the store takes `group`: the decoder releases the GIL, so the next group's
        decoding overlaps this group's insert instead of following it. `_batches_of` uses the result when
        the next group holds those entries, and otherwise drops it."""
        if not self._native or self._ahead is not None or self._stop.is_set():
            return
        taken = {e.path.name for e in group}
        ahead, rows = [], 0
        for entry in pending:
            name = entry.path.name
            if name in taken or name in self._alone or (self._held is not None and name in self._held):
                continue
            if entry.signal != "traces" or name in self._cache:
                break  # keep to a run of spooled spans at the front of what is pending
            ahead.append(entry)
            rows += self._rows_of(entry)
            if rows >= GROUP_MAX_ROWS:
                break
        if not ahead:
            return
        if self._helper is None:
            self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode-ahead")
        self._ahead = (ahead, self._helper.submit(self._decode_entries, ahead))

    def _decode_entries(self, entries: list[Entry]) -> tuple[convert.Batch | None, list[tuple[Entry, Any]]]:
        """Entries' spans as one table, and the entries that could not be read or parsed (with why)."""
        payloads, read, bad = [], [], []
        for entry in entries:
            try:
                payloads.append(self.spool.read(entry))
                read.append(entry)
            except OSError as e:
                bad.append((entry, e))
        if not payloads:
            return None, bad
        batch, unparsed = convert.traces_rows(payloads)
        bad.extend((read[i], "not an ExportTraceServiceRequest") for i in unparsed)
        return batch, bad

    def _take_ahead(self, entries: list[Entry]) -> tuple[set[str], list[convert.Batch]]:
        """The batch decoded ahead if each entry it covers is in `entries`: (the names it covers, [batch])."""
        if self._ahead is None:
            return set(), []
        ahead, future = self._ahead
        self._ahead = None
        names = {e.path.name for e in ahead}
        try:
            batch, bad = future.result()
        except Exception:  # decoded again below, where a failure is handled entry by entry
            log.exception("decoding spooled spans ahead failed")
            return set(), []
        if not names <= {e.path.name for e in entries}:
            return set(), []  # the group came out otherwise (split, capped): decode it as it is
        for entry, why in bad:
            self._set_aside(entry, why)
        return names, [batch] if batch is not None else []

    def _batches_of(self, entries: list[Entry]) -> list[convert.Batch]:
        """The rows of a group's entries: cached or converted one by one, and the spans of the rest decoded
        together into one table (some of them ahead, during the previous insert). An entry that cannot be
        read or parsed is set aside."""
        done, batches = self._take_ahead(entries)
        if self._held is not None:
            held, tables = self._held.take(e.path.name for e in entries if e.path.name not in done)
            batches += [convert.trace_batch(table, 0) for table in tables]
            done |= held
        decode = []
        for entry in entries:
            if entry.path.name in done:
                continue
            if entry.signal == "traces" and self._native and entry.path.name not in self._cache:
                decode.append(entry)
            else:
                batch = self._batch_of(entry)
                if batch is not None:
                    batches.append(batch)
        if decode:
            batch, bad = self._decode_entries(decode)
            for entry, why in bad:
                self._set_aside(entry, why)
            if batch is not None:
                batches.append(batch)
        return batches

    def _set_aside(self, entry: Entry, why: object) -> None:
        target = self.spool.set_aside(entry)
        log.error("spooled batch %s does not parse (%s); moved to %s", entry.path.name, why, target)

    def _batch_of(self, entry: Entry) -> convert.Batch | None:
        batch = self._cache.get(entry.path.name)
        if batch is not None:
            return batch
        try:
            return self._convert(entry.signal, None, self.spool.read(entry))
        except Exception as e:  # a spool file that does not parse can never be inserted
            self._set_aside(entry, e)
            return None

    def _convert(self, signal: str, message: Any, payload: bytes) -> convert.Batch:
        """Rows of one request: traces in a worker process when there are workers, the rest here."""
        if signal == "traces":
            return self._workers.traces(payload) if self._workers else convert.traces_payload(payload)
        if message is None:
            message = otlp.parse_canonical(signal, payload)
        return convert.CONVERTERS[signal](message)

    def _rows_of(self, entry: Entry) -> int:
        batch = self._cache.get(entry.path.name)
        if batch is not None:
            return _rows(batch)
        held = self._held.rows_of(entry.path.name) if self._held is not None else None
        if held is not None:
            return held
        rows = self._sizes.get(entry.path.name)
        # an entry from before a restart is about 400 bytes a row in protobuf: good enough to size groups
        return rows if rows is not None else max(1, entry.size // 400)

    def _forget(self, entries: list[Entry]) -> None:
        if self._held is not None:
            self._held.release(e.path.name for e in entries)
        with self._lock:
            for entry in entries:
                batch = self._cache.pop(entry.path.name, None)
                if batch is not None:
                    self._cached_rows -= _rows(batch)
                self._sizes.pop(entry.path.name, None)
                self._alone.discard(entry.path.name)

    def _count_failure(self, manifest: Path, token: str, entries: list[Entry], e: StoreError) -> None:
        """A store error that is not an outage: retry; then split the group; then set the batch aside."""
        n = self._attempts.get(token, 0) + 1
        self._attempts[token] = n
        log.warning("store refused group %s (attempt %d): %s", token[:8], n, e)
        if n < MAX_ATTEMPTS:
            return
        self._attempts.pop(token, None)
        if len(entries) > 1:
            self._alone.update(entry.path.name for entry in entries)
            self.spool.drop_group(manifest)
            return
        target = self.spool.set_aside(entries[0])
        self.spool.drop_group(manifest)
        self._forget(entries)
        log.error("store refused spooled batch %d times; moved to %s", n, target)

    def _connect(self) -> Store:
        try:
            self.store = Store.open(self.dsn, ttl_days=self.ttl_days)
        except StoreError as e:
            self.store_error = str(e)
            raise
        self._set_up()
        log.info("store %s open", self.store.target.description)
        return self.store

    def _set_up(self) -> None:
        self._healthy, self.store_error = True, ""

    def _mark_down(self, e: Exception) -> None:
        if self._healthy:
            log.warning("store failed, spooling until it recovers: %s", e)
        self._healthy = False
        self.store_error = str(e)


def _rows(batch: convert.Batch) -> int:
    return sum(batch.rows(t) for t in batch.tables)


def batch_token(signal: str, payload: bytes) -> str:
    """The de-duplication token of a batch: a hash of its signal and bytes (SHA-256, which CPUs with SHA
    instructions hash about three times as fast as blake2b, cut to 128 bits)."""
    h = hashlib.sha256(signal.encode() + b"\0")
    h.update(payload)
    return h.hexdigest()[:32]
