"""Acknowledge a batch only once it is in the store or fsynced to the spool; drain the spool with retries.

    request -> decode -> columns -> insert (token) ------------------------------> ack
                                      | store down or failing
                                      v
                                 spool.put (fsync) --> ack      drainer thread: spool -> insert (same token)

The de-duplication token is a hash of the batch's bytes, so a replay after a crash, or a client resending a
batch whose reply it lost, is stored once.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass

from collector import convert, otlp
from collector.spool import Entry, Spool, SpoolFull
from collector.store import Store, StoreError, StoreUnavailable

log = logging.getLogger(__name__)

MAX_DRAIN_ATTEMPTS = 5  # store errors (not outages) on one batch before it is set aside in spool/failed


class Backpressure(Exception):
    """Refuse for now (429 or 503) and tell the client when to retry."""

    def __init__(self, status: int, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to one export request: how many items were rejected and why, and where it went."""

    rejected: int
    error_message: str
    spooled: bool


class Ingestor:
    """Owns the store connection, the spool and the drain thread of one collector."""

    def __init__(
        self, dsn: str, spool: Spool, *, ttl_days: int = 0, max_inflight: int = 64, retry_after_s: int = 2
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
        self._attempts: dict[str, int] = {}

    # --- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Open the spool and the store, then start draining. A server that does not answer is not fatal
        (batches spool until it does); a chDB directory held by another process is (StoreError)."""
        self.spool.open()
        try:
            self._connect()
        except StoreUnavailable as e:
            log.warning("%s; spooling until it answers", e)
        self._thread = threading.Thread(target=self._drain_loop, name="spool-drain", daemon=True)
        self._thread.start()

    def stop(self, drain_timeout_s: float = 5.0) -> None:
        """Stop draining (what is left stays spooled for the next start) and close the store."""
        deadline = time.monotonic() + drain_timeout_s
        while self.spool.count and self._healthy and time.monotonic() < deadline:
            self._wake.set()
            time.sleep(0.05)
        self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join(timeout=30)
        if self.store:
            self.store.close()
            self.store = None

    @property
    def healthy(self) -> bool:
        """True while the store takes inserts."""
        return self._healthy

    def status(self) -> dict[str, object]:
        return {
            "store": "up" if self._healthy else "down",
            "store_error": self.store_error,
            "spooled_batches": self.spool.count,
            "spooled_bytes": self.spool.bytes_used,
            "failed_batches": self.spool.failed_count(),
        }

    # --- ingest ---------------------------------------------------------------------------------------
    def submit(self, signal: str, decoded: otlp.Decoded) -> Outcome:
        """Store one decoded export request, or spool it; return only once it is durable.
        Raises Backpressure when too many requests are in flight or the spool is full."""
        with self._lock:
            if self._inflight >= self.max_inflight:
                raise Backpressure(429, "too many concurrent export requests", self.retry_after_s)
            self._inflight += 1
        try:
            arrival_ns = time.time_ns()
            batch = convert.CONVERTERS[signal](decoded.message)
            if not batch.tables:
                return Outcome(batch.rejected, batch.error_message, spooled=False)
            token = batch_token(signal, decoded.payload)
            if self._healthy and self.store is not None:
                try:
                    self._insert(self.store, batch, token)
                    return Outcome(batch.rejected, batch.error_message, spooled=False)
                except StoreError as e:
                    self._mark_down(e)
            try:
                self.spool.put(signal, token, decoded.payload, arrival_ns)
            except SpoolFull as e:
                raise Backpressure(
                    503, f"{e}; the store is {self.store_error or 'behind'}", self.retry_after_s * 5
                ) from e
            self._wake.set()
            return Outcome(batch.rejected, batch.error_message, spooled=True)
        finally:
            with self._lock:
                self._inflight -= 1

    # --- internals ------------------------------------------------------------------------------------
    def _connect(self) -> Store:
        self.store = Store.open(self.dsn, ttl_days=self.ttl_days)
        self._healthy = True
        self.store_error = ""
        log.info("store %s open", self.store.target.description)
        return self.store

    def _mark_down(self, e: Exception) -> None:
        if self._healthy:
            log.warning("store failed, spooling: %s", e)
        self._healthy = False
        self.store_error = str(e)
        self._wake.set()

    @staticmethod
    def _insert(store: Store, batch: convert.Batch, token: str) -> None:
        for table, columns in batch.tables.items():
            store.insert(table, batch.columns[table], columns, token=token)

    def _drain_loop(self) -> None:
        backoff = 0.25
        while not self._stop.is_set():
            try:
                progressed = self._drain_once()
            except StoreError as e:
                self._mark_down(e)
                progressed = False
            except Exception:  # the drain thread must outlive any surprise; the batch stays spooled
                log.exception("spool drain failed")
                progressed = False
            if progressed:
                backoff = 0.25
                continue
            wait = backoff if (self.spool.count or not self._healthy) else 1.0
            self._wake.wait(timeout=wait)
            self._wake.clear()
            backoff = min(backoff * 2, 10.0) if (self.spool.count or not self._healthy) else 0.25

    def _drain_once(self) -> bool:
        """Insert spooled batches oldest first; True if any went in."""
        if self.store is None:
            try:
                self._connect()
            except StoreUnavailable as e:
                self.store_error = str(e)
                return False
        store = self.store
        entries = self.spool.pending()
        if not entries:
            if not self._healthy:  # a failed direct insert with nothing spooled: probe the store
                store.query("SELECT 1")
                self._healthy, self.store_error = True, ""
            return False
        done = 0
        for entry in entries:
            if self._stop.is_set():
                break
            try:
                if not self._replay(store, entry):
                    continue
            except StoreUnavailable:
                raise
            except StoreError as e:
                if not self._count_failure(entry, e):
                    raise
                continue
            self.spool.remove(entry)
            self._attempts.pop(entry.token, None)
            done += 1
            self._healthy, self.store_error = True, ""
        if done:
            log.info("drained %d spooled batch(es), %d left", done, self.spool.count)
        return done > 0

    def _replay(self, store: Store, entry: Entry) -> bool:
        """Insert one spooled batch; False if it could not be read and was set aside instead."""
        try:
            message = otlp.parse_canonical(entry.signal, self.spool.read(entry))
        except Exception as e:  # a spool file that no longer parses can never be inserted
            target = self.spool.set_aside(entry)
            log.error("spooled batch %s does not parse (%s); moved to %s", entry.path.name, e, target)
            return False
        self._insert(store, convert.CONVERTERS[entry.signal](message), entry.token)
        return True

    def _count_failure(self, entry: Entry, e: StoreError) -> bool:
        """Count a store error on one batch; set it aside after MAX_DRAIN_ATTEMPTS. True when set aside."""
        n = self._attempts.get(entry.token, 0) + 1
        self._attempts[entry.token] = n
        if n < MAX_DRAIN_ATTEMPTS:
            return False
        target = self.spool.set_aside(entry)
        self._attempts.pop(entry.token, None)
        log.error("store refused spooled batch %d times (%s); moved to %s", n, e, target)
        return True


def batch_token(signal: str, payload: bytes) -> str:
    """The de-duplication token of a batch: a hash of its signal and bytes."""
    return hashlib.blake2b(signal.encode() + b"\0" + payload, digest_size=16).hexdigest()
