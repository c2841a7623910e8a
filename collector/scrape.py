"""Pull engines' Prometheus `/metrics` pages on a schedule into `engine_samples`.

    scheduler --due target--> worker thread: HTTP GET (keep-alive) -> text -> samples -> buffer
    buffer of every target --one Arrow insert per interval--> engine_samples

Each distinct series (a metric name and its labels) is read by prometheus_client's parser the first time it
appears and remembered, so later scrapes cost a lookup and a float() a line; only series with a stepscope
name (collector/engine_names.py) are stored. Text the parser cannot read fails the scrape with the
parser's own message. A target
that is down or answers garbage is logged and retried with backoff (the interval, doubling per failure up
to BACKOFF_MAX_S); it never stops the collector or the other targets. Each scrape also stores, as
Prometheus does, `up` (1 or 0, the error in the label `error`) and `scrape_samples` for its instance, so
scrape health is a query (`stepscope query scrape_health`) as well as part of `/health`.
"""

from __future__ import annotations

import heapq
import http.client
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import pyarrow as pa
from prometheus_client.parser import text_string_to_metric_families

from collector.engine_names import stepscope_name

log = logging.getLogger(__name__)

BACKOFF_MAX_S = 60.0
BUFFER_MAX_ROWS = 1_000_000  # rows kept while the store is down; past it the oldest round is dropped
MAX_PAGE_BYTES = 16 << 20
WORKERS = 8  # fetches at once: a slow target holds one worker for up to its timeout
# Targets due within SLOT_S of each other go to one job, at most BATCH of them (scraped in turn): fewer
# wake-ups of the pool's threads, each of which costs more than a small page's parse. The slot is at most
# a quarter of the interval: a target is due again one interval after its scrape started, so a slot as
# long as the interval would hand it out again at once and scrape it back to back.
SLOT_S = 0.25
BATCH = 4
FLUSH_MIN_S = 10.0  # the scraped rows go into the store at most this often
COLUMNS = ("time", "service", "instance", "metric", "value", "labels", "source_metric", "origin")
DEFAULT_SERVICE = "engine"


class ScrapeError(Exception):
    """A page could not be fetched or parsed."""


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    """One `/metrics` URL and how its samples are labelled. `instance` defaults to the URL's host:port,
    as in Prometheus."""

    url: str
    instance: str = ""
    service: str = DEFAULT_SERVICE
    bearer_token: str | None = None

    def __post_init__(self) -> None:
        url = urlparse(self.url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"scrape target {self.url!r} is not an http(s) URL")
        if not self.instance:
            port = url.port or (443 if url.scheme == "https" else 80)
            object.__setattr__(self, "instance", f"{url.hostname}:{port}")
        if not self.service:
            object.__setattr__(self, "service", DEFAULT_SERVICE)


@dataclass(slots=True)
class TargetHealth:
    """What `/health` shows for one target."""

    url: str
    instance: str
    service: str
    up: bool = False
    last_error: str = ""
    last_scrape: float | None = None  # epoch seconds of the last attempt
    last_success: float | None = None
    samples: int = 0  # samples stored from the last successful scrape
    scrapes: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    next_delay_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


def parse_exposition(text: str, memo: dict[str, Any] | None = None) -> list[Sample]:
    """(stepscope metric, value, labels, exposed name) of every mapped sample of a Prometheus text page.
    Raises ScrapeError when the page is not Prometheus text exposition.

    prometheus_client's parser reads each distinct series (name and labels) once; `memo` keeps what it
    read, so a page that repeats the series of the previous scrape costs a dict lookup and a float() a
    line (the library's parser walks labels a character at a time, ~0.2 ms a labelled line)."""
    return [(m, v, dict(labels), src) for m, v, labels, src in _samples(text, {} if memo is None else memo)]


def _samples(text: str, memo: dict[str, Any]) -> Iterator[tuple[str, float, tuple, str]]:
    for line in text.splitlines():
        if not line or line[0] == "#" or line.isspace():
            continue
        cut = line.rfind("}") + 1 or len(line.split(None, 1)[0])
        series = line[:cut]
        hit = memo.get(series)
        if hit is None:
            hit = _parse_series(series)
            _value(line, cut)  # a series is read whole the first time: garbage fails here
            memo[series] = hit
            if len(memo) > MEMO_MAX:
                memo.clear()
        if hit is _UNMAPPED:
            continue  # a series stepscope does not store, known good: its value is never read
        yield hit[0], _value(line, cut), hit[1], hit[2]


def _value(line: str, cut: int) -> float:
    """The sample value after the series (which ends at `cut`); ScrapeError when it is not a number."""
    try:
        return float(line[cut:].split()[0])
    except (IndexError, ValueError):
        raise ScrapeError(f"not Prometheus text exposition: bad value in {line[:120]!r}") from None


Sample = tuple[str, float, dict[str, str], str]
MEMO_MAX = 200_000
_UNMAPPED: Any = ()


def _parse_series(series: str) -> Any:
    """(stepscope name, labels, exposed name) of one series as prometheus_client's parser reads it, or
    _UNMAPPED. Raises ScrapeError with the parser's message when it is not a series."""
    try:
        families = list(text_string_to_metric_families(series + " 0\n"))
        sample = families[0].samples[0]
    except Exception as e:  # the parser raises ValueError, IndexError, ... on text it cannot read
        detail = str(e).removesuffix(" 0")[:200] or f"{type(e).__name__} in {series[:120]!r}"
        raise ScrapeError(f"not Prometheus text exposition: {detail}") from None
    name = stepscope_name(sample.name)
    return _UNMAPPED if name is None else (name, tuple(sample.labels.items()), sample.name)


class Scraper:
    """Scrapes `targets` every `interval_s` (a scheduler thread hands due targets to WORKERS threads) and
    inserts what it reads with `insert(table)` (an Arrow table with COLUMNS), once per interval. `insert`
    raising keeps the rows buffered (up to BUFFER_MAX_ROWS) for the next round."""

    def __init__(
        self,
        targets: list[ScrapeTarget],
        interval_s: float,
        insert: Callable[[pa.Table], None],
        *,
        timeout_s: float | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("the scrape interval must be positive")
        self.targets = list(targets)
        self.interval_s = interval_s
        self.timeout_s = timeout_s if timeout_s is not None else min(10.0, interval_s)
        self._insert = insert
        self.health = {t.url: TargetHealth(t.url, t.instance, t.service) for t in self.targets}
        self._memos: dict[str, dict[str, Any]] = {t.url: {} for t in self.targets}
        self._rows: list[list[Any]] = [[] for _ in COLUMNS]
        self._rounds: list[int] = []  # row count of each buffered round, oldest first
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._due: list[tuple[float, int]] = []  # (monotonic time, target index), a heap
        self._due_changed = threading.Condition(self._lock)
        self._conns: dict[str, http.client.HTTPConnection] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._thread: threading.Thread | None = None
        self.dropped_rows = 0
        self.insert_error = ""

    # --- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the scheduler thread; targets are spread over the first interval."""
        now = time.monotonic()
        n = max(1, len(self.targets))
        self._due = [(now + self.interval_s * i / n, i) for i in range(len(self.targets))]
        heapq.heapify(self._due)
        self._pool = ThreadPoolExecutor(max_workers=min(WORKERS, max(1, n)), thread_name_prefix="scrape")
        self._thread = threading.Thread(target=self._schedule, name="scrape-schedule", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop scraping and insert what is buffered (once)."""
        self._stop.set()
        with self._lock:
            self._due_changed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        for conn in list(self._conns.values()):
            conn.close()
        self.flush()

    def status(self) -> dict[str, Any]:
        return {
            "interval_s": self.interval_s,
            "targets": [h.as_dict() for h in self.health.values()],
            "buffered_rows": sum(self._rounds),
            "dropped_rows": self.dropped_rows,
            "insert_error": self.insert_error,
        }

    # --- the loop -------------------------------------------------------------------------------------
    def _schedule(self) -> None:
        """Hand the targets due within the next slot (SLOT_S, at most a quarter of the interval) to the pool,
        BATCH to a job; insert the buffer every FLUSH_MIN_S or interval, whichever is longer (fewer, larger
        parts for the store to merge)."""
        flush_every = max(self.interval_s, FLUSH_MIN_S)
        slot = min(SLOT_S, self.interval_s / 4)
        next_flush = time.monotonic() + flush_every
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_flush:
                next_flush = now + flush_every
                self._pool.submit(self.flush)  # type: ignore[union-attr]
            with self._lock:
                due = []
                while self._due and self._due[0][0] <= now + slot:
                    due.append(heapq.heappop(self._due)[1])
                for k in range(0, len(due), BATCH):
                    self._pool.submit(self._job, due[k : k + BATCH])  # type: ignore[union-attr]
                wait = min(next_flush, self._due[0][0] if self._due else next_flush) - now
                if wait > 0:
                    self._due_changed.wait(timeout=wait)

    def _job(self, indices: list[int]) -> None:
        for index in indices:
            target = self.targets[index]
            started = time.monotonic()
            self.scrape_once(target)
            health = self.health[target.url]
            delay = self.interval_s
            if health.consecutive_failures:
                delay = min(BACKOFF_MAX_S, self.interval_s * 2 ** (health.consecutive_failures - 1))
            health.next_delay_s = delay
            with self._lock:
                heapq.heappush(self._due, (started + delay, index))
                self._due_changed.notify()

    def scrape_once(self, target: ScrapeTarget) -> None:
        """Fetch, parse and buffer one page; record the outcome in `health` (never raises)."""
        health = self.health[target.url]
        now_ns = time.time_ns()
        health.last_scrape = now_ns / 1e9
        health.scrapes += 1
        try:
            rows = list(_samples(self._fetch(target), self._memos[target.url]))
        except ScrapeError as e:
            self._failed(target, health, str(e), now_ns)
            return
        except Exception as e:  # a scrape must never end its target's schedule
            self._failed(target, health, f"{type(e).__name__}: {e}", now_ns)
            return
        if health.consecutive_failures:
            log.info("scrape target %s is back after %d failures", target.url, health.consecutive_failures)
        health.up, health.last_error, health.last_success = True, "", now_ns / 1e9
        health.samples, health.consecutive_failures = len(rows), 0
        rows.append(("up", 1.0, (), "up"))
        rows.append(("scrape_samples", float(len(rows) - 1), (), "scrape_samples"))
        self._buffer(target, now_ns, rows)

    def _fetch(self, target: ScrapeTarget) -> str:
        """The page's text, over a keep-alive connection of this target's own (http.client: a tenth of
        an async client's CPU per request, which matters at a hundred targets)."""
        url = urlparse(target.url)
        conn = self._conns.get(target.url)
        if conn is None:
            kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
            conn = self._conns[target.url] = kind(url.hostname, url.port, timeout=self.timeout_s)
        headers = {"Accept": "text/plain;version=0.0.4"}
        if target.bearer_token:
            headers["Authorization"] = f"Bearer {target.bearer_token}"
        path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        try:
            conn.request("GET", path, headers=headers)
            response = conn.getresponse()
            body = response.read(MAX_PAGE_BYTES + 1)
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise ScrapeError(f"{type(e).__name__}: {str(e) or 'the connection closed'}") from None
        if response.will_close:
            conn.close()
        if response.status != 200:
            raise ScrapeError(f"HTTP {response.status}: {body[:200].decode(errors='replace').strip()}")
        if len(body) > MAX_PAGE_BYTES:
            conn.close()
            raise ScrapeError(f"the page is over {MAX_PAGE_BYTES} bytes")
        return body.decode("utf-8", errors="replace")

    def _failed(self, target: ScrapeTarget, health: TargetHealth, error: str, now_ns: int) -> None:
        if health.up or not health.consecutive_failures:
            log.warning("scrape target %s failed: %s (retrying with backoff)", target.url, error)
        health.up, health.last_error = False, error
        health.failures += 1
        health.consecutive_failures += 1
        self._buffer(target, now_ns, [("up", 0.0, (("error", error[:500]),), "up")])

    def _buffer(self, target: ScrapeTarget, now_ns: int, rows: list[tuple]) -> None:
        n = len(rows)
        with self._lock:
            cols = self._rows
            cols[0].extend([now_ns] * n)
            cols[1].extend([target.service] * n)
            cols[2].extend([target.instance] * n)
            for m, v, labels, src in rows:
                cols[3].append(m)
                cols[4].append(v)
                cols[5].append(labels)
                cols[6].append(src)
            cols[7].extend(["scrape"] * n)
            self._rounds.append(n)
            while sum(self._rounds) > BUFFER_MAX_ROWS and len(self._rounds) > 1:
                old = self._rounds.pop(0)
                for col in cols:
                    del col[:old]
                self.dropped_rows += old

    def flush(self) -> int:
        """Insert the buffered rows (all targets, one insert); on failure keep them. Returns rows inserted."""
        with self._lock:
            if not self._rounds:
                return 0
            columns, self._rows = self._rows, [[] for _ in COLUMNS]
            rounds, self._rounds = self._rounds, []
        try:
            self._insert(to_arrow(columns))
        except Exception as e:  # the store is down or refused: keep the rows for the next round
            self.insert_error = str(e)[:500]
            log.warning("inserting %d scraped samples failed: %s", sum(rounds), self.insert_error)
            with self._lock:
                for old, new in zip(columns, self._rows, strict=True):
                    old.extend(new)
                self._rows, self._rounds = columns, rounds + self._rounds
            return 0
        self.insert_error = ""
        return sum(rounds)


def to_arrow(columns: list[list[Any]]) -> pa.Table:
    """The buffered columns (COLUMNS order, times in epoch ns) as the Arrow table `engine_samples` takes."""
    # the same few label sets recur on every row of a series: convert each once, then take by index
    distinct: dict[tuple, int] = {}
    index = [distinct.setdefault(items, len(distinct)) for items in columns[5]]
    labels = pa.array([list(items) for items in distinct], pa.map_(pa.string(), pa.string())).take(
        pa.array(index, pa.int32())
    )
    return pa.table(
        {
            "time": pa.array(columns[0], pa.int64()).cast(pa.timestamp("ns")),
            "service": pa.array(columns[1], pa.string()),
            "instance": pa.array(columns[2], pa.string()),
            "metric": pa.array(columns[3], pa.string()),
            "value": pa.array(columns[4], pa.float64()),
            "labels": labels,
            "source_metric": pa.array(columns[6], pa.string()),
            "origin": pa.array(columns[7], pa.string()),
        }
    )
